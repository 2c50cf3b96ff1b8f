"""A model's `dtype`: weights really load in it, outputs stay close to float32's and stay JSON floats.

On this CPU host: bfloat16 for the tiny random BERT classifier (benchmarks/tiny_bert.py) and for
all-MiniLM-L6-v2 as embedding and router; float16 is allowed on a CPU too (torch runs these encoders
in half precision there; it saves memory but is slower without native support, see handlers/base.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.tiny_bert import MINILM
from inference.child.handlers import build_handler
from inference.core.registry import ModelSpec

TEXTS = [
    "I was charged twice for my subscription",
    "the app crashes on start",
    "how do I reset my password?",
    "ok",
]
LIMITS = {"max_seq_length": 64, "max_batch_tokens": 256}


def _spec(task: str, path: str, dtype: str | None, **extra) -> ModelSpec:
    return ModelSpec(name=f"{task}-{dtype}", task=task, path=path, dtype=dtype, **LIMITS, **extra)


def _run(spec: ModelSpec) -> tuple[list[dict], set[torch.dtype]]:
    handler = build_handler(spec)
    outputs = handler.predict(TEXTS)
    json.dumps(outputs)  # JSON floats, not tensors or numpy scalars
    return outputs, {p.dtype for p in handler.model.parameters()}


def _floats(outputs: list[dict]) -> list[float]:
    values = []
    for out in outputs:
        values += out.get("embedding", []) + list(out.get("scores", {}).values())
    assert values and all(type(v) is float for v in values)
    return values


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_tiny_classifier_runs_in_half_precision(tiny_classifier, dtype):
    reference, ref_dtypes = _run(_spec("text-classification", str(tiny_classifier), None))
    outputs, dtypes = _run(_spec("text-classification", str(tiny_classifier), dtype))
    assert ref_dtypes == {torch.float32}
    assert dtypes == {getattr(torch, dtype)}
    _floats(outputs)
    # Probabilities within 1e-3 of float32's (measured: 4e-5 in bfloat16, 3e-6 in float16). A random
    # tiny head gives near-uniform probabilities, so the labels are not compared here.
    for ref, out in zip(reference, outputs, strict=True):
        assert out["scores"].keys() == ref["scores"].keys()
        assert max(abs(out["scores"][k] - ref["scores"][k]) for k in ref["scores"]) <= 1e-3


def test_minilm_embedding_in_bfloat16_is_close_to_float32():
    reference, _ = _run(_spec("embedding", MINILM, "float32"))
    outputs, dtypes = _run(_spec("embedding", MINILM, "bfloat16"))
    assert dtypes == {torch.bfloat16}
    _floats(outputs)
    ref = torch.tensor([o["embedding"] for o in reference])
    got = torch.tensor([o["embedding"] for o in outputs])
    assert got.shape == (len(TEXTS), 384)
    # Cosine similarity to the float32 vector at least 0.999 (measured: 0.99986), every component within 0.01.
    assert torch.nn.functional.cosine_similarity(ref, got).min().item() >= 0.999
    assert (ref - got).abs().max().item() <= 0.01
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-3)  # still unit vectors


def test_minilm_router_in_bfloat16_picks_the_same_labels():
    routes = {"routes": "inference/routes/support.yaml"}
    reference, _ = _run(_spec("router", MINILM, None, **routes))
    outputs, dtypes = _run(_spec("router", MINILM, "bfloat16", **routes))
    assert dtypes == {torch.bfloat16}
    _floats(outputs)
    for ref, out in zip(reference, outputs, strict=True):
        # Cosine scores within 0.01 of float32's (measured: 0.0014).
        assert max(abs(out["scores"][k] - ref["scores"][k]) for k in ref["scores"]) <= 0.01
        ranked = sorted(ref["scores"].values(), reverse=True)
        if ranked[0] - ranked[1] > 0.05:  # a near tie ("ok") may flip; a clear winner must not
            assert out["label"] == ref["label"]


def test_without_a_dtype_weights_are_float32_whatever_the_checkpoint(tmp_path, tiny_classifier):
    """transformers' default is the checkpoint's own dtype ("auto"); a spec without dtype means float32."""
    import shutil

    from transformers import AutoModelForSequenceClassification

    half = tmp_path / "saved-in-float16"
    shutil.copytree(tiny_classifier, half)
    AutoModelForSequenceClassification.from_pretrained(half, dtype=torch.float16).save_pretrained(half)
    _, dtypes = _run(_spec("text-classification", str(half), None))
    assert dtypes == {torch.float32}
