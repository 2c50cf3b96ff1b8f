"""Django settings, all read from the environment with defaults that make `make run` work on a laptop."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()
# A .env file is optional; the environment always wins over it.
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

# Local state (SQLite file, generated secrets, credentials, redis data) lives here, never in git.
VAR_DIR = Path(env.str("PLATFORM_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def _local_secret(name: str) -> str:
    """Generate a secret once per checkout (var/<name>) so sessions and tokens survive restarts of `make run`.

    Written to a temporary file and linked into place, so processes starting together (web, workers)
    all read the one that won, never a half-written or different one.
    """
    path = VAR_DIR / name
    if not path.exists():
        tmp = VAR_DIR / f".{name}.{os.getpid()}"
        tmp.write_text(secrets.token_urlsafe(50))
        tmp.chmod(0o600)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        tmp.unlink()
    return path.read_text().strip()


# DJANGO_SECRET_KEY: set it in production; locally one is generated into var/.
SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="") or _local_secret("secret_key")
# DJANGO_DEBUG: off unless asked for.
DEBUG = env.bool("DJANGO_DEBUG", default=False)
# DJANGO_ALLOWED_HOSTS: comma-separated host names the web tier answers for.
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])
# DJANGO_CSRF_TRUSTED_ORIGINS: origins allowed to POST forms when behind a proxy.
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "inference",
    "jobs",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "platform_.urls"
ASGI_APPLICATION = "platform_.asgi.application"
WSGI_APPLICATION = "platform_.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# DATABASE_URL: PostgreSQL in production (postgres://user:pass@host/db); SQLite under var/ otherwise.
DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Web processes and worker children write concurrently: WAL lets readers run beside a writer,
    # the busy timeout waits for a lock instead of failing, and IMMEDIATE takes the write lock at
    # BEGIN so two transactions never deadlock upgrading a read lock.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # Tests share the database with live server and worker subprocesses, so it must be a file.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test_db.sqlite3")}
else:
    # DB_CONN_MAX_AGE_S: keep PostgreSQL connections open this long between requests.
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("DB_CONN_MAX_AGE_S", default=60)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
# SERVE_STATIC: the app serves collected static files itself; turn off behind a proxy that does.
SERVE_STATIC = env.bool("SERVE_STATIC", default=True)
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"

# DATA_UPLOAD_MAX_MEMORY_SIZE_BYTES: largest non-file request body (predict JSON), in bytes.
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("DATA_UPLOAD_MAX_MEMORY_SIZE_BYTES", default=4 * 1024 * 1024)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # DRF's TokenAuthentication plus failed-authentication throttling (429 after repeated bad tokens).
        "platform_.auth_throttle.ThrottledTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "platform_.errors.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Inference job platform API",
    "DESCRIPTION": "Online predictions with bounded admission and dynamic batching; offline CSV jobs.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The UI files come from drf-spectacular-sidecar, served by this app: no CDN needed.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "inference.api.schema.add_predict_endpoint",
        # After the others: documents the shared 4xx answers (auth, throttles, limits) on every operation.
        "platform_.schema_errors.add_error_responses",
    ],
}

# ---------------------------------------------------------------------------------------------
# Redis and Celery
# ---------------------------------------------------------------------------------------------
# REDIS_URL: broker, result backend, admission counters and reply channel.
REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")

# OFFLINE_TIME_LIMIT_S: hard limit for one offline task (minutes, not seconds).
OFFLINE_TIME_LIMIT_S = env.int("OFFLINE_TIME_LIMIT_S", default=30 * 60)
# OFFLINE_NICE: CPU priority of the offline worker (0 to 19; higher yields more to online work). It
# only matters when the cores are contended: alone, the offline worker runs at full speed anyway.
OFFLINE_NICE = env.int("OFFLINE_NICE", default=19)
# ONLINE_TIME_LIMIT_S: hard limit for one online batch; the deadline normally ends a request first.
ONLINE_TIME_LIMIT_S = env.int("ONLINE_TIME_LIMIT_S", default=30)

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
# A message not acked within this time is redelivered by Redis: it must exceed the longest task,
# or a long offline task runs twice.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": OFFLINE_TIME_LIMIT_S * 2}
CELERY_RESULT_EXPIRES = env.int("CELERY_RESULT_EXPIRES_S", default=15 * 60)
# Workers load a model at child start; the default 4 s is far shorter than a load plus warm-up.
CELERY_WORKER_PROC_ALIVE_TIMEOUT = env.float("WORKER_PROC_ALIVE_TIMEOUT_S", default=120.0)
# Django's cache (DRF's throttle counters) lives in Redis, so every web process counts the same requests.
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL, "KEY_PREFIX": "cache"}
}

# ---------------------------------------------------------------------------------------------
# Inference
# ---------------------------------------------------------------------------------------------
# INFERENCE_MODELS_FILE: YAML file listing the served models; the default is inference/models.yaml.
INFERENCE_MODELS_FILE = env.str("INFERENCE_MODELS_FILE", default=str(BASE_DIR / "inference" / "models.yaml"))
# INFERENCE_DEVICE: default device for models that do not name one (cpu or cuda).
INFERENCE_DEVICE = env.str("INFERENCE_DEVICE", default="cpu")
# TORCH_THREADS: intra-op threads per worker child; children x threads should not exceed cores.
TORCH_THREADS = env.int("TORCH_THREADS", default=1)
# WORKER_MODELS: comma-separated model names a worker loads; empty means every registered model.
WORKER_MODELS = env.list("WORKER_MODELS", default=[])

# ONLINE_MAX_INPUTS: most texts in one predict call.
ONLINE_MAX_INPUTS = env.int("ONLINE_MAX_INPUTS", default=64)
# ONLINE_MAX_TEXT_CHARS: longest single text accepted, in characters.
ONLINE_MAX_TEXT_CHARS = env.int("ONLINE_MAX_TEXT_CHARS", default=10_000)
# ONLINE_DEADLINE_MS: default deadline of an online request; clients may ask for less (X-Deadline-Ms).
ONLINE_DEADLINE_MS = env.int("ONLINE_DEADLINE_MS", default=2_000)
# ONLINE_MAX_BACKLOG: requests queued plus in flight per model, across all web processes.
ONLINE_MAX_BACKLOG = env.int("ONLINE_MAX_BACKLOG", default=256)
# ONLINE_ADMISSION_HEADROOM: admit a request only if the queue ahead drains within this share of its
# remaining deadline. The rest is for its own dispatch (up to max_batch_size texts per child, run
# shortest first, so a long text waits for the whole dispatch) and for the rate dipping under load.
# Measured at 3x overload on 2 cores (docs/benchmarks.md): 1.0 let 30% of admitted requests miss a
# 2 s deadline, 0.5 under 1%, 0.35 none to 1 in 1,500, with no refusals at 40 closed-loop clients.
ONLINE_ADMISSION_HEADROOM = env.float("ONLINE_ADMISSION_HEADROOM", default=0.35)
# ONLINE_REFUSAL_HOLD_MS: after refusing a model's request, a web process refuses the model's next
# requests (no more patient than that one) for this long without reading their body or asking Redis.
# Short against the queue that a refusal implies (headroom x deadline of work), so it cannot starve
# the workers; it makes a refusal under overload about 5x cheaper (docs/benchmarks.md). 0: off.
ONLINE_REFUSAL_HOLD_MS = env.float("ONLINE_REFUSAL_HOLD_MS", default=50.0)
# ONLINE_BATCH_WAIT_MS: how long a free worker child waits for company before it takes a lone request.
# Batches form anyway while children are busy (see inference/batching.py); on a CPU a wait only adds
# latency, so 0. On a GPU, where a batch of 8 costs about what 1 does, 2 to 5 ms pays.
ONLINE_BATCH_WAIT_MS = env.float("ONLINE_BATCH_WAIT_MS", default=0.0)
# ONLINE_RATE_WINDOW_S: how far back the drain rate used by admission is measured.
ONLINE_RATE_WINDOW_S = env.int("ONLINE_RATE_WINDOW_S", default=10)
# WORKER_HEARTBEAT_S: how often each worker child says it is alive; it counts as gone after 3 misses.
WORKER_HEARTBEAT_S = env.float("WORKER_HEARTBEAT_S", default=2.0)
# DISPATCHER_HEARTBEAT_S: how often a worker's main process (which hands work to its children) says
# it is alive; after 3 misses its children no longer count as serving (admission answers no_worker).
DISPATCHER_HEARTBEAT_S = env.float("DISPATCHER_HEARTBEAT_S", default=1.0)
# ONLINE_MAX_DEADLINE_MS: the longest deadline a client may ask for with X-Deadline-Ms (for large
# requests that do not fit the default deadline); longer asks are capped to it.
ONLINE_MAX_DEADLINE_MS = env.int("ONLINE_MAX_DEADLINE_MS", default=max(ONLINE_DEADLINE_MS, 10_000))
# ONLINE_MAX_BACKLOG_TOKENS: tokens queued plus in flight per model, across all web processes. Admission
# prices requests in tokens (inference/tokens.py), so one request of 64 long texts weighs what it costs.
ONLINE_MAX_BACKLOG_TOKENS = env.int("ONLINE_MAX_BACKLOG_TOKENS", default=65_536)
# ONLINE_REQUEST_OVERHEAD_TOKENS: what a request costs beyond its tokens, in tokens (measured on a
# 2-core CPU: a lone one-text pass takes ~25 ms more than its tokens alone would, ~50 tokens' worth).
# Without it the drain rate, measured under light traffic, reads too low for heavy requests.
ONLINE_REQUEST_OVERHEAD_TOKENS = env.int("ONLINE_REQUEST_OVERHEAD_TOKENS", default=32)
# ONLINE_CLIENT_SHARE: the most of a model's admissible backlog (in tokens) one client may hold; its
# excess is refused with 429 while other clients are still admitted.
ONLINE_CLIENT_SHARE = env.float("ONLINE_CLIENT_SHARE", default=0.5)
# ONLINE_DISPATCH_TOKENS: most tokens a worker child is handed at once. Measured on a 2-core CPU with
# all-MiniLM-L6-v2, 1,024 tokens take about 0.5 s and are already at full batching speed; on a GPU raise it.
ONLINE_DISPATCH_TOKENS = env.int("ONLINE_DISPATCH_TOKENS", default=1_024)
# ONLINE_CONTENDED_DISPATCH_TOKENS: the same while several clients wait for the model, so a light request
# waits about one short dispatch behind a heavy client, not behind its backlog.
ONLINE_CONTENDED_DISPATCH_TOKENS = env.int("ONLINE_CONTENDED_DISPATCH_TOKENS", default=512)
# ONLINE_REFUSAL_DELAY_MS: a caller refused again within the refusal hold gets its 503/429 after this
# delay. A client that retries at once (ignoring Retry-After) then costs one cheap refusal per delay
# instead of a flood of them, and cannot take the CPU the model needs. 0: answer at once.
ONLINE_REFUSAL_DELAY_MS = env.float("ONLINE_REFUSAL_DELAY_MS", default=1000.0)
# ONLINE_MAX_JSON_DEPTH / ONLINE_MAX_NUMBER_DIGITS: a predict body nested deeper, or with an integer
# longer than this, is refused with 400 before it can exhaust the parser.
ONLINE_MAX_JSON_DEPTH = env.int("ONLINE_MAX_JSON_DEPTH", default=32)
ONLINE_MAX_NUMBER_DIGITS = env.int("ONLINE_MAX_NUMBER_DIGITS", default=64)
# API_TOKEN_CACHE_S: how long a web process trusts a token it looked up (a revoked token works this long).
API_TOKEN_CACHE_S = env.float("API_TOKEN_CACHE_S", default=30.0)
# AUTH_FAILURES_PER_WINDOW: failed authentications (bad token, bad password at a login form) one client
# address may make per AUTH_FAILURE_WINDOW_S before its credential checks get 429; 0: no limit.
AUTH_FAILURES_PER_WINDOW = env.int("AUTH_FAILURES_PER_WINDOW", default=20)
# AUTH_FAILURE_WINDOW_S: the window those failures are counted in, shared by all web processes through Redis.
AUTH_FAILURE_WINDOW_S = env.int("AUTH_FAILURE_WINDOW_S", default=60)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "filters": {"not_refusals": {"()": "platform_.errors.SkipExpectedRefusals"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["not_refusals"]},
    },
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
}
# WEB_REDIS_MAX_CONNECTIONS: Redis connections per web process; each waiting predict call holds one.
WEB_REDIS_MAX_CONNECTIONS = env.int("WEB_REDIS_MAX_CONNECTIONS", default=1024)

# ---------------------------------------------------------------------------------------------
# Offline jobs
# ---------------------------------------------------------------------------------------------
# JOBS_MAX_UPLOAD_BYTES: largest CSV accepted (413 above it).
JOBS_MAX_UPLOAD_BYTES = env.int("JOBS_MAX_UPLOAD_BYTES", default=256 * 1024 * 1024)
# JOBS_MAX_ROWS: most data rows in one CSV.
JOBS_MAX_ROWS = env.int("JOBS_MAX_ROWS", default=1_000_000)
# JOBS_MAX_TEXT_CHARS: a longer text cell fails its row ("text too long"), not the job.
JOBS_MAX_TEXT_CHARS = env.int("JOBS_MAX_TEXT_CHARS", default=20_000)
# JOBS_INGEST_BATCH_ROWS: rows inserted per bulk insert while a CSV is read.
JOBS_INGEST_BATCH_ROWS = env.int("JOBS_INGEST_BATCH_ROWS", default=2_000)
# JOBS_CHUNK_ROWS: rows per work unit (one message on the offline queue).
JOBS_CHUNK_ROWS = env.int("JOBS_CHUNK_ROWS", default=256)
# JOBS_DISPATCH_ROWS: most rows one offline batch (several chunks, across jobs) may hold.
JOBS_DISPATCH_ROWS = env.int("JOBS_DISPATCH_ROWS", default=1_024)
# JOBS_STALL_S: a chunk queued or running with no progress this long is re-enqueued by the reconciler.
JOBS_STALL_S = env.float("JOBS_STALL_S", default=120.0)
# JOBS_RECONCILE_S: how often the offline worker runs the reconciler.
JOBS_RECONCILE_S = env.float("JOBS_RECONCILE_S", default=30.0)
# JOBS_YIELD_MAX_MS: before each forward pass an offline child waits while online requests are in
# flight, at most this long (so a job still moves under constant online traffic). 0: never wait.
JOBS_YIELD_MAX_MS = env.float("JOBS_YIELD_MAX_MS", default=250.0)
# JOBS_PASS_TEXTS_BESIDE_ONLINE: most texts in an offline pass while online traffic runs (seen in the
# last second), so an offline pass is short next to online ones; without online traffic passes are
# as large as the model's limits allow.
JOBS_PASS_TEXTS_BESIDE_ONLINE = env.int("JOBS_PASS_TEXTS_BESIDE_ONLINE", default=4)
# JOBS_LOW_CONFIDENCE: rows whose top score is below this are flagged for review.
JOBS_LOW_CONFIDENCE = env.float("JOBS_LOW_CONFIDENCE", default=0.5)
# JOBS_RESULTS_PAGE_SIZE: rows per page of GET /api/v1/jobs/<id>/results.
JOBS_RESULTS_PAGE_SIZE = env.int("JOBS_RESULTS_PAGE_SIZE", default=100)
# JOBS_MAX_INGESTING_PER_USER: uploads of one user being read at once; more get 429 (ingests run one at
# a time on the offline worker, so one user's dozens would hold every other user's behind them).
JOBS_MAX_INGESTING_PER_USER = env.int("JOBS_MAX_INGESTING_PER_USER", default=2)
# JOBS_CREATE_RATE: job uploads one user may make (DRF rate: "60/min", "1000/hour"); over it, 429.
JOBS_CREATE_RATE = env.str("JOBS_CREATE_RATE", default="60/min")
# JOBS_RESULTS_RATE: results requests (JSON pages and CSV exports) one user may make; over it, 429.
JOBS_RESULTS_RATE = env.str("JOBS_RESULTS_RATE", default="600/min")

# ---------------------------------------------------------------------------------------------
# Observability
# ---------------------------------------------------------------------------------------------
# SLOW_REQUEST_MS: online requests slower than this (and every 504) go to the slow-request log.
SLOW_REQUEST_MS = env.float("SLOW_REQUEST_MS", default=1000.0)
# SLOW_REQUEST_LOG_MAX_PER_S: most slow-log rows one web process writes per second.
SLOW_REQUEST_LOG_MAX_PER_S = env.int("SLOW_REQUEST_LOG_MAX_PER_S", default=20)
# SLOW_REQUEST_KEEP: the slow-request log keeps this many newest rows.
SLOW_REQUEST_KEEP = env.int("SLOW_REQUEST_KEEP", default=10_000)
# METRICS_TOKEN: GET /metrics needs "Authorization: Bearer <token>" (or a staff session); unset, one
# is generated into var/metrics_token.
METRICS_TOKEN = env.str("METRICS_TOKEN", default="") or _local_secret("metrics_token")
# METRICS_PUBLIC: true opens GET /metrics to anyone, without a token (only on a network you trust).
METRICS_PUBLIC = env.bool("METRICS_PUBLIC", default=False)
# FLOWER_URL: where the dashboard links to Flower.
FLOWER_URL = env.str("FLOWER_URL", default="http://127.0.0.1:5555/")

# ---------------------------------------------------------------------------------------------
# Autoscaler (inference/autoscale.py)
# ---------------------------------------------------------------------------------------------
# A worker started with --autoscale=MAX,MIN sizes its pool with this class: an online worker on the
# predicted wait of its queues (backlog tokens over the measured drain rate), not on Celery's count of
# reserved tasks (always 0 for celery-batches tasks); an offline worker keeps Celery's own rule.
CELERY_WORKER_AUTOSCALER = "inference.autoscale:PredictedWaitAutoscaler"
# AUTOSCALE_GROW_WAIT_SHARE: grow by one child when the predicted wait passes this share of
# ONLINE_DEADLINE_MS (below ONLINE_ADMISSION_HEADROOM, so the pool grows before admission refuses).
AUTOSCALE_GROW_WAIT_SHARE = env.float("AUTOSCALE_GROW_WAIT_SHARE", default=0.25)
# AUTOSCALE_SHRINK_WAIT_SHARE: the wait counts as low when, with one child fewer, it would still be
# under this share of ONLINE_DEADLINE_MS.
AUTOSCALE_SHRINK_WAIT_SHARE = env.float("AUTOSCALE_SHRINK_WAIT_SHARE", default=0.1)
# AUTOSCALE_KEEPALIVE_S: shrink by one child once the wait has stayed low this long (seconds).
AUTOSCALE_KEEPALIVE_S = env.float("AUTOSCALE_KEEPALIVE_S", default=30.0)
# AUTOSCALE_INTERVAL_S: how often a worker's main process reads the gauges and decides (seconds; the
# sampler writes them once a second).
AUTOSCALE_INTERVAL_S = env.float("AUTOSCALE_INTERVAL_S", default=1.0)
# AUTOSCALE_STALE_S: gauges sampled longer ago than this (seconds) leave the pool as it is.
AUTOSCALE_STALE_S = env.float("AUTOSCALE_STALE_S", default=5.0)
