"""Task handlers: one module per task, each a Handler with `predict(inputs) -> list[dict]`.

Importing a handler imports torch, so only worker children do it (see inference/child/runtime.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.child.handlers.base import Handler
    from inference.core.registry import ModelSpec


def build_handler(spec: ModelSpec) -> Handler:
    """Load the model a spec names and wrap it in its task's handler."""
    if spec.task == "embedding":
        from inference.child.handlers.embedding import EmbeddingHandler

        return EmbeddingHandler.load(spec)
    if spec.task == "text-classification":
        from inference.child.handlers.classification import ClassificationHandler

        return ClassificationHandler.load(spec)
    if spec.task == "router":
        from inference.child.handlers.router import RouterHandler

        return RouterHandler.load(spec)
    if spec.task == "identity":
        from inference.child.handlers.identity import IdentityHandler

        return IdentityHandler.load(spec)  # type: ignore[return-value]
    if spec.task == "question-answering":
        from inference.child.handlers.question_answering import build_qa_handler

        return build_qa_handler(spec)
    if spec.task == "token-classification":
        from inference.child.handlers.token_classification import TokenClassificationHandler

        return TokenClassificationHandler.load(spec)
    raise ValueError(f"unknown task {spec.task!r}")
