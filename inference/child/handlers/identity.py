"""`identity`: no weights; answers each text's length in characters and in tokens.

The platform's overhead probe, as Triton's identity model is used with perf_analyzer: a request to it
takes the whole real path (authentication, token pricing and admission, the Celery queue, the
worker's dispatcher, the pool pipe, a child, the reply) while the model itself costs next to
nothing, so its throughput and latency measure what the platform spends per request
(benchmarks/overhead.py). Tokens are counted with the model folder's `tokenizer.json`, the same
count the web tier prices the request with.
"""

from __future__ import annotations

from typing import Any

from inference.core.registry import ModelSpec
from inference.core.tokens import encode_batch, tokenizer_for


class _Row(list):
    """A text's token ids, carrying the text's length in characters to `forward`."""

    chars = 0


class IdentityHandler:
    """Same interface as `inference.child.handlers.base.Handler` (tokenize, cost, forward, predict, warm_up), no torch."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.tokenizer = tokenizer_for(spec)

    @classmethod
    def load(cls, spec: ModelSpec) -> IdentityHandler:
        return cls(spec)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        rows = []
        for text, encoding in zip(texts, encode_batch(self.tokenizer, texts), strict=True):
            row = _Row(encoding.ids)
            row.chars = len(text)
            rows.append(row)
        return rows

    def cost(self, item: list[int]) -> tuple[int, int]:
        return 1, len(item)

    def forward(self, ids: list[list[int]]) -> list[dict[str, Any]]:
        return [{"chars": getattr(row, "chars", 0), "tokens": len(row)} for row in ids]

    def predict(self, texts: list[str]) -> list[dict[str, Any]]:
        return self.forward(self.tokenize(texts))

    def warm_up(self) -> None:
        self.predict(["warm up"])
