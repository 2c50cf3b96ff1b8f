"""`router`: intent routing by the nearest label centroid over sentence embeddings."""

from __future__ import annotations

from typing import Any

import torch
import yaml

from inference.child.handlers.base import top_label
from inference.child.handlers.embedding import EmbeddingHandler
from inference.core.registry import ModelSpec


def load_routes(path: str) -> dict[str, list[str]]:
    """Label -> example utterances; every label needs at least one example."""
    with open(path, encoding="utf-8") as handle:
        routes = yaml.safe_load(handle) or {}
    if not isinstance(routes, dict) or not routes:
        raise ValueError(f"{path}: expected a mapping of label to example utterances")
    for label, examples in routes.items():
        if not examples or not all(isinstance(e, str) and e.strip() for e in examples):
            raise ValueError(f"{path}: label {label!r} needs a list of non-empty example strings")
    return {str(label): list(examples) for label, examples in routes.items()}


class RouterHandler(EmbeddingHandler):
    """Embeds texts and scores them against each label's centroid (cosine similarity)."""

    def __init__(self, spec: ModelSpec, tokenizer, model) -> None:
        super().__init__(spec, tokenizer, model)
        routes = load_routes(str(spec.resolved_routes()))
        self.labels = list(routes)
        self.centroids = torch.stack([self._centroid(examples) for examples in routes.values()])

    def _centroid(self, examples: list[str]) -> torch.Tensor:
        input_ids, mask = self.to_device(self.tokenize(examples))
        with torch.inference_mode():
            vectors = self.embed(self.run_model(input_ids, mask), mask)
        return torch.nn.functional.normalize(vectors.mean(dim=0), p=2, dim=0)

    def postprocess(self, output: Any, attention_mask: torch.Tensor) -> list[dict[str, Any]]:
        similarity = (self.embed(output, attention_mask) @ self.centroids.T).float().cpu()
        return [top_label(self.labels, row) for row in similarity.tolist()]
