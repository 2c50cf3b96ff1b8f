"""What every handler shares: tokenizing once, padding to the batch's longest text, one copy to the device.

Weights load on the child's device (inference/core/gpu.py picks it) in the model's `dtype` (float32 unless
the models file says float16 or bfloat16); outputs are cast back to float32 before they become JSON.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import cache
from typing import Any

import torch
from transformers import (
    AutoModel,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from inference.core.gpu import resolve_device
from inference.core.registry import ModelSpec

logger = logging.getLogger(__name__)
_MODEL_CLASSES = {
    "encoder": AutoModel,
    "classifier": AutoModelForSequenceClassification,
    "question-answering": AutoModelForQuestionAnswering,
    "token-classifier": AutoModelForTokenClassification,
}


def model_class(kind: str) -> Any:
    """The transformers class a handler's `kind` loads: a short name above, or any transformers class by
    name (a plugin's handler sets `kind = "AutoModelForMaskedLM"` without changing this table)."""
    import transformers

    found = _MODEL_CLASSES.get(kind) or getattr(transformers, kind, None)
    if found is None:
        raise ValueError(f"unknown model kind {kind!r}: one of {', '.join(_MODEL_CLASSES)} or a transformers class")
    return found


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str | None) -> torch.dtype:
    """The spec's dtype as torch's; None is float32 (never transformers' default "auto", which would
    load a checkpoint saved in float16 as float16 on a CPU without anyone asking)."""
    return _DTYPES[name or "float32"]


@cache
def load_pretrained(
    path: str, kind: str, device: str, dtype: str = "float32"
) -> tuple[PreTrainedTokenizerBase, torch.nn.Module]:
    """Load weights once per process; a router and an embedding model over the same files, device and
    dtype share them."""
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = model_class(kind).from_pretrained(path, local_files_only=True, dtype=torch_dtype(dtype))
    model.eval().to(device)
    return tokenizer, model


class Handler:
    """Runs one model batch at a time; subclasses turn the model's output into one dict per text."""

    kind = "encoder"

    def __init__(self, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.model = model
        self.device = torch.device(spec.device)
        self.pad_id = tokenizer.pad_token_id or 0

    @classmethod
    def load(cls, spec: ModelSpec) -> Handler:
        """Load on this process's device ("cuda" becomes this pool child's GPU) in the spec's dtype."""
        device = resolve_device(spec.device)
        dtype = spec.dtype or "float32"
        if device.startswith("cuda"):
            torch.cuda.set_device(device)  # so torch's default CUDA device is this child's GPU
        elif dtype != "float32":
            # Allowed: torch runs these encoders in half precision on a CPU. It saves memory but is slower
            # unless the CPU has native support (AMX, AVX512-BF16/FP16): on an AVX2 host all-MiniLM-L6-v2
            # ran 6.4 x (bfloat16) and 5.6 x (float16) slower than float32.
            logger.warning(
                "%s: %s on %s (CPU capability %s) saves memory but is usually slower than float32",
                spec.name,
                dtype,
                device,
                torch.backends.cpu.get_cpu_capability(),
            )
        tokenizer, model = load_pretrained(str(spec.resolved_path()), cls.kind, device, dtype)
        return cls(dataclasses.replace(spec, device=device), tokenizer, model)

    def cost(self, item: Any) -> tuple[int, int]:
        """What one tokenized input costs a pass: (sequences, tokens in its longest sequence).

        A text is one sequence; a handler whose inputs become several sequences (a question over a
        long context: overlapping windows) says so here, and runtime.run keeps them in one `forward`
        call (which runs them in sub-passes within the model's budget when they exceed it)."""
        return 1, len(item)

    def tokenize(self, texts: list[Any]) -> list[Any]:
        """Token ids per text, truncated but not padded: lengths decide how batches are cut.

        Handlers of structured inputs return their own item per input (whatever their `forward` and
        `cost` take)."""
        encoded = self.tokenizer(
            texts, truncation=True, max_length=self.spec.max_seq_length, padding=False, return_attention_mask=False
        )
        return encoded["input_ids"]

    def to_device(self, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad to the batch's own longest text; ids and mask travel in one host-to-device copy."""
        longest = max(len(row) for row in ids)
        host = torch.zeros((2, len(ids), longest), dtype=torch.long)
        host[0].fill_(self.pad_id)
        for i, row in enumerate(ids):
            host[0, i, : len(row)] = torch.tensor(row, dtype=torch.long)
            host[1, i, : len(row)] = 1
        on_device = host.to(self.device, non_blocking=True)
        return on_device[0], on_device[1]

    def forward(self, ids: list[Any]) -> list[dict[str, Any]]:
        """One forward pass over a batch padded to its own longest text (items from `tokenize`)."""
        input_ids, attention_mask = self.to_device(ids)
        with torch.inference_mode():
            return self.postprocess(self.run_model(input_ids, attention_mask), attention_mask)

    def predict(self, texts: list[Any]) -> list[dict[str, Any]]:
        return self.forward(self.tokenize(texts))

    def largest_pass_rows(self) -> int:
        """Most sequences of max_seq_length tokens one pass may hold: the shape warm-up runs."""
        return max(1, min(self.spec.max_batch_size, self.spec.max_batch_tokens // self.spec.max_seq_length))

    def warm_up(self) -> None:
        """Run the largest batch shape once, so the first real request neither compiles nor allocates."""
        size = self.largest_pass_rows()
        filler = self.tokenizer.convert_tokens_to_ids(["the"])[0]
        self.forward([[filler] * self.spec.max_seq_length for _ in range(size)])

    def run_model(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask)

    def postprocess(self, output: Any, attention_mask: torch.Tensor) -> list[dict[str, Any]]:
        raise NotImplementedError


def mean_pool(last_hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of token vectors over real (unpadded) tokens, L2-normalised."""
    last_hidden = last_hidden.float()  # sum 256 tokens in float32 even when the model runs in half precision
    mask = attention_mask.unsqueeze(-1).to(last_hidden.dtype)
    summed = (last_hidden * mask).sum(dim=1)
    pooled = summed / mask.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def top_label(labels: list[str], row: list[float]) -> dict[str, Any]:
    """The best label, its score and every label's score, as handlers answer for one text."""
    top = max(range(len(row)), key=row.__getitem__)
    return {
        "label": labels[top],
        "score": round(row[top], 6),
        "scores": {label: round(value, 6) for label, value in zip(labels, row, strict=False)},
    }
