"""`embedding`: mean-pooled, L2-normalised sentence vectors."""

from __future__ import annotations

from typing import Any

import torch

from inference.child.handlers.base import Handler, mean_pool


class EmbeddingHandler(Handler):
    """Sentence embeddings, one unit vector per text."""

    def embed(self, output: Any, attention_mask: torch.Tensor) -> torch.Tensor:
        return mean_pool(output.last_hidden_state, attention_mask)

    def postprocess(self, output: Any, attention_mask: torch.Tensor) -> list[dict[str, Any]]:
        vectors = self.embed(output, attention_mask).float().cpu()
        # Six decimals keep the JSON small; cosine similarities are unchanged at that precision.
        return [{"embedding": [round(v, 6) for v in row], "dim": len(row)} for row in vectors.tolist()]
