"""Task handlers: one module per task, each a Handler with `predict(inputs) -> list[dict]`.

Which handler a model runs is its task type's `handler` path (inference/core/task_types/), or the models
file's `handler:` for that model; either names a class with `load(spec)` or a function of the spec.
Importing a handler imports torch, so only worker children do it (see inference/child/runtime.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inference.core.task_types import import_path

if TYPE_CHECKING:
    from inference.child.handlers.base import Handler
    from inference.core.registry import ModelSpec


def build_handler(spec: ModelSpec) -> Handler:
    """Load the model a spec names and wrap it in its task's handler (or the handler its entry names)."""
    factory = import_path(spec.handler_path, f"model {spec.name!r}: handler")
    load = getattr(factory, "load", None)
    return load(spec) if callable(load) else factory(spec)
