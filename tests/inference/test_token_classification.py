"""`token-classification`: entity merging as a pure function, then the tiny random model as a worker loads it.

The merging tests give per-token labels by hand (offsets from the text, or from the real tokenizer); the
model tests check what holds whatever the random weights say: spans are slices of the text, labels carry
no B-/I- prefix, no entity starts or ends inside a word, long texts say `truncated`, and a padded batch
answers what each text answers alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from benchmarks.tiny_bert import ENTITY_LABELS, MINILM
from inference.child import runtime
from inference.child.handlers.token_classification import TokenClassificationHandler, merge_entities
from inference.core.registry import ModelSpec

PLAIN_LABELS = {label.removeprefix("B-").removeprefix("I-") for label in ENTITY_LABELS} - {"O"}
MAX_SEQ_LENGTH_TOKENS = 32
EXAMPLE = "Zoë Müller met Barack Obama of Washingtonville Inc. in 北京, then flew to São Paulo."


def _tokens(text: str, pieces: list[tuple[str, int, str, float]]) -> tuple[list, list, list, list]:
    """Per-token (labels, scores, offsets, word ids) for `pieces` = (piece text, word id, label, score),
    found in `text` left to right, between a [CLS] and a [SEP] as a tokenizer gives them."""
    labels, scores, offsets, word_ids = ["O"], [0.9], [(0, 0)], [None]
    cursor = 0
    for piece, word_id, label, score in pieces:
        start = text.index(piece, cursor)
        cursor = start + len(piece)
        labels.append(label)
        scores.append(score)
        offsets.append((start, cursor))
        word_ids.append(word_id)
    return labels + ["B-PER"], scores + [0.9], offsets + [(0, 0)], word_ids + [None]


def _merge(text: str, pieces: list[tuple[str, int, str, float]]) -> list[dict]:
    return merge_entities(text, *_tokens(text, pieces))


def test_token_classification_merges_sub_word_pieces_into_one_word():
    text = "Washington is big"
    # The second and third pieces' labels are ignored: a word takes its first piece's label and score.
    pieces = [("Wash", 0, "B-LOC", 0.8), ("ing", 0, "O", 0.3), ("ton", 0, "I-PER", 0.2), ("is", 1, "O", 0.9)]
    assert _merge(text, pieces) == [{"label": "LOC", "text": "Washington", "start": 0, "end": 10, "score": 0.8}]


def test_token_classification_merges_b_then_i_words_into_one_entity():
    text = "Barack Hussein Obama spoke"
    pieces = [
        ("Barack", 0, "B-PER", 0.9),
        ("Hussein", 1, "I-PER", 0.6),
        ("Ob", 2, "I-PER", 0.3),
        ("ama", 2, "O", 0.1),
        ("spoke", 3, "O", 0.99),
    ]
    # Mean of the three words' scores (the first piece's for "Obama"), six decimals.
    assert _merge(text, pieces) == [
        {"label": "PER", "text": "Barack Hussein Obama", "start": 0, "end": 20, "score": 0.6}
    ]


def test_token_classification_b_after_b_starts_a_new_entity():
    text = "Alice Bob"
    entities = _merge(text, [("Alice", 0, "B-PER", 0.5), ("Bob", 1, "B-PER", 0.7)])
    assert [(e["text"], e["label"], e["score"]) for e in entities] == [("Alice", "PER", 0.5), ("Bob", "PER", 0.7)]


def test_token_classification_i_without_b_starts_an_entity_and_a_label_change_ends_one():
    text = "Acme Corp Paris London"
    pieces = [
        ("Acme", 0, "I-ORG", 0.4),  # no B- before it: still an entity
        ("Corp", 1, "I-ORG", 0.5),
        ("Paris", 2, "I-LOC", 0.6),  # I- of another label: a new entity
        ("London", 3, "I-LOC", 0.7),
    ]
    entities = _merge(text, pieces)
    assert [(e["text"], e["label"]) for e in entities] == [("Acme Corp", "ORG"), ("Paris London", "LOC")]
    assert [e["score"] for e in entities] == [0.45, 0.65]


def test_token_classification_drops_o_and_o_splits_entities():
    text = "Alice and Bob"
    assert _merge(text, [("Alice", 0, "O", 0.9), ("and", 1, "O", 0.9), ("Bob", 2, "O", 0.9)]) == []
    entities = _merge(text, [("Alice", 0, "B-PER", 0.9), ("and", 1, "O", 0.9), ("Bob", 2, "I-PER", 0.9)])
    assert [e["text"] for e in entities] == ["Alice", "Bob"]


def test_token_classification_label_without_prefix_is_its_own_label():
    text = "Big Co sells Widgets"
    pieces = [("Big", 0, "ORG", 0.5), ("Co", 1, "ORG", 0.5), ("sells", 2, "O", 0.5), ("Widgets", 3, "MISC", 0.5)]
    entities = _merge(text, pieces)
    assert [(e["text"], e["label"]) for e in entities] == [("Big Co", "ORG"), ("Widgets", "MISC")]


def test_token_classification_scores_round_to_six_decimals():
    entities = _merge("Ann Lee", [("Ann", 0, "B-PER", 0.1234564), ("Lee", 1, "I-PER", 0.1234572)])
    assert entities[0]["score"] == 0.123457


def test_token_classification_offsets_slice_punctuation_and_unicode_text():
    """Offsets from the real tokenizer (which lower-cases and strips accents) still index the text as written."""
    from transformers import AutoTokenizer

    from inference.core.registry import resolve_path

    text = "Zoë Müller visited 北京, (Washingtonville)!"
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_path(MINILM)), local_files_only=True)
    encoded = tokenizer(text, return_offsets_mapping=True)
    word_ids = encoded.word_ids()
    tokens = encoded.tokens()
    assert "##ville" in tokens  # "Washingtonville" is two pieces
    words = {"zoe": "B-PER", "muller": "I-PER", "北": "B-LOC", "京": "I-LOC", "washington": "B-ORG", "##ville": "O"}
    labels = [words.get(token, "O") for token in tokens]
    scores = [0.5] * len(tokens)

    entities = merge_entities(text, labels, scores, encoded["offset_mapping"], word_ids)

    assert [(e["label"], e["text"], e["start"], e["end"]) for e in entities] == [
        ("PER", "Zoë Müller", 0, 10),
        ("LOC", "北京", 19, 21),
        ("ORG", "Washingtonville", 24, 39),
    ]
    assert all(text[e["start"] : e["end"]] == e["text"] for e in entities)


# The tiny random model, loaded as a worker child loads it.


@pytest.fixture(scope="module")
def entities_model(tiny_token_classifier: Path) -> Iterator[str]:
    """The tiny token classifier loaded and warmed up by runtime.load, as worker children do."""
    spec = ModelSpec(
        name="entities-under-test",
        task="token-classification",
        path=str(tiny_token_classifier),
        max_batch_size=8,
        max_batch_tokens=8 * MAX_SEQ_LENGTH_TOKENS,
        max_seq_length=MAX_SEQ_LENGTH_TOKENS,
        torch_threads=torch.get_num_threads(),  # load() sets the process's threads: keep them as they are
    )
    with pytest.MonkeyPatch.context() as patch:
        # load() also exports OMP_NUM_THREADS. setenv records the value before it (or its absence), and
        # leaving the context puts that back, so the live stack's workers start as they would have.
        patch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
        runtime.load([spec])
    yield spec.name


def _handler(model: str) -> TokenClassificationHandler:
    handler = runtime._handlers[model]
    assert isinstance(handler, TokenClassificationHandler)
    return handler


def _run(model: str, texts: list[str]) -> list[dict]:
    outputs, _ = runtime.run(model, texts)
    json.dumps(outputs)  # plain JSON: no tensors, no numpy scalars
    return outputs


def test_token_classification_records_an_example_extraction(entities_model, record_property):
    """A real extraction by the tiny random model (random weights: the labels mean nothing, the shape does)."""
    (output,) = _run(entities_model, [EXAMPLE])
    shown = json.dumps({"input": EXAMPLE, "output": output}, ensure_ascii=False, indent=1)
    print(shown)
    record_property("example_extraction", shown)
    assert output["truncated"] is False
    assert output["entities"], "the seeded random model tags some words"
    for entity in output["entities"]:
        assert set(entity) == {"label", "text", "start", "end", "score"}
        assert EXAMPLE[entity["start"] : entity["end"]] == entity["text"]
        assert entity["label"] in PLAIN_LABELS
        assert 0 < entity["score"] <= 1 and round(entity["score"], 6) == entity["score"]


def test_token_classification_entities_are_whole_words_of_the_text(entities_model):
    texts = [
        EXAMPLE,
        "Müllerstraße 12, 80331 München — ask for Dr. Ångström at Überwald GmbH.",
        "email zoe@example.com or call +1 (555) 010-9999; Washingtonville's mayor agreed",
    ]
    tokenizer = _handler(entities_model).tokenizer
    for text, output in zip(texts, _run(entities_model, texts), strict=True):
        encoding = tokenizer(text).encodings[0]
        spans = [encoding.word_to_chars(w) for w in sorted({w for w in encoding.word_ids if w is not None})]
        starts, ends = {start for start, _ in spans}, {end for _, end in spans}
        assert output["entities"]
        for entity in output["entities"]:
            assert text[entity["start"] : entity["end"]] == entity["text"]
            assert entity["label"] in PLAIN_LABELS
            # Pieces are merged: an entity begins where a word begins and ends where a word ends.
            assert entity["start"] in starts and entity["end"] in ends, (text, entity)
        starts_in_order = [entity["start"] for entity in output["entities"]]
        assert starts_in_order == sorted(starts_in_order)
        assert all(a["end"] <= b["start"] for a, b in pairwise(output["entities"]))


def test_token_classification_says_when_a_text_was_truncated(entities_model):
    words_that_fit = MAX_SEQ_LENGTH_TOKENS - 2  # [CLS] and [SEP] take two of the tokens
    fits = " ".join(["Paris"] * words_that_fit)
    one_too_many = " ".join(["Paris"] * (words_that_fit + 1))
    long_text = "Zoë Müller flew to Paris. " * 50
    outputs = _run(entities_model, [fits, one_too_many, long_text, ""])
    assert [output["truncated"] for output in outputs] == [False, True, True, False]
    assert outputs[3]["entities"] == []
    # Nothing is reported past what the model saw: about the first 30 tokens of a 300-token text.
    assert all(entity["end"] <= len(long_text) // 5 for entity in outputs[2]["entities"])


def test_token_classification_padded_batch_answers_as_each_text_alone(entities_model):
    texts = [
        EXAMPLE,
        "Ann",
        "Müllerstraße 12, 80331 München",
        "Zoë Müller flew to Paris. " * 10,  # truncated: the longest row of the pass
    ]
    handler = _handler(entities_model)
    together = handler.forward(handler.tokenize(texts))  # one pass, padded to the longest text
    alone = [handler.forward(handler.tokenize([text]))[0] for text in texts]
    assert [o["truncated"] for o in together] == [o["truncated"] for o in alone] == [False, False, False, True]
    for batched, single in zip(together, alone, strict=True):
        # Padding is masked, so only float noise may differ: spans and labels are identical.
        assert [(e["label"], e["start"], e["end"], e["text"]) for e in batched["entities"]] == [
            (e["label"], e["start"], e["end"], e["text"]) for e in single["entities"]
        ]
        for b, s in zip(batched["entities"], single["entities"], strict=True):
            assert b["score"] == pytest.approx(s["score"], abs=1e-5)
    # The worker's path (runtime.run cuts passes by length) answers the same.
    assert _run(entities_model, texts) == [
        {**o, "entities": [{**e, "score": pytest.approx(e["score"], abs=1e-5)} for e in o["entities"]]} for o in alone
    ]


@pytest.mark.integration
def test_token_classification_served_by_the_live_stack(stack):
    """The `entities` model of the test models file, through the web process and an online worker."""
    long_text = "Zoë Müller flew to Paris. " * 60  # well past the stack's 128 tokens
    response = stack.predict("entities", [EXAMPLE, long_text])
    assert response.status_code == 200, response.text
    example, long_output = response.json()["outputs"]
    assert (example["truncated"], long_output["truncated"]) == (False, True)
    for text, output in ((EXAMPLE, example), (long_text, long_output)):
        for entity in output["entities"]:
            assert text[entity["start"] : entity["end"]] == entity["text"]
            assert entity["label"] in PLAIN_LABELS
