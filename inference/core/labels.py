"""The labels a served model can answer, read from its files without loading it (no torch).

A router's labels are the keys of its routes file; a text-classification model's are its config's
`id2label`, in id order (each task type's `labels` says which). Other tasks (embedding, identity) answer
no label: an empty list. Used by the admin review, where a reviewer picks a corrected label from the model's own labels.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

import yaml

from inference.core.registry import RegistryError, get_registry

logger = logging.getLogger(__name__)


def labels_for(model_name: str) -> list[str]:
    """The model's labels in the order it scores them; [] for an unknown model or one without labels.

    Which file holds them is the model's task type's to say (`TaskType.labels`)."""
    spec = get_registry().get(model_name)
    if spec is None:
        return []
    try:
        return list(spec.task_type.labels(spec))
    except (OSError, ValueError, RegistryError) as error:
        # A broken file is the worker's failure to report (it will not start); a review page still renders.
        logger.warning("labels of model %s unreadable: %s", model_name, error)
    return []


def read_labels(path: Path, kind: str) -> list[str]:
    """Labels from a routes file (`kind` "routes": its keys) or a config.json ("id2label": in id order)."""
    return list(_read_labels(str(path), kind, _mtime_ns(path)))


def _mtime_ns(path: Path | None) -> int:
    return path.stat().st_mtime_ns if path else 0


@lru_cache(maxsize=64)
def _read_labels(path: str, kind: str, mtime_ns: int) -> tuple[str, ...]:
    """Labels from one file, cached per modification time: an edited routes file is read again."""
    with open(path, encoding="utf-8") as handle:
        if kind == "routes":
            routes = yaml.safe_load(handle) or {}
            if not isinstance(routes, dict):
                raise ValueError(f"{path}: expected a mapping of label to example utterances")
            return tuple(str(label) for label in routes)
        id2label = (json.load(handle) or {}).get("id2label") or {}
    return tuple(str(id2label[key]) for key in sorted(id2label, key=int))
