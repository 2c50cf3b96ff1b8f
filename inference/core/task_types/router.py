"""`router`: a label per text by similarity to each label's example utterances (a routes file)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from inference.core.task_types import TaskType, TaskTypeError
from inference.core.task_types.text_classification import CLASSIFICATION_SCHEMA

if TYPE_CHECKING:
    from inference.core.registry import ModelSpec


class RouterTask(TaskType):
    """Embeds a text and answers the label whose examples are closest; labels are the routes file's keys."""

    name = "router"
    handler = "inference.child.handlers.router:RouterHandler"
    output_schema = "Classification"
    model_keys = ("routes",)
    # A router's scores are cosine similarities (negative ones included): headed "Score" they read as probabilities.
    score_heading = "Similarity"
    score_help = "cosine similarity between the text and the label's examples, from -1 to 1; not a probability"

    def schemas(self, max_chars: int) -> dict[str, dict[str, Any]]:
        return {"Classification": CLASSIFICATION_SCHEMA}

    def check_entry(self, entry: Mapping[str, Any]) -> None:
        if not entry.get("routes"):
            raise TaskTypeError("a router needs a `routes:` file")

    def labels(self, spec: ModelSpec) -> list[str]:
        from inference.core.labels import read_labels

        routes = spec.resolved_routes()
        return read_labels(routes, "routes") if routes else []
