"""The web tier's ASCII token counter (inference/core/tokens.py, `ascii_counter`) against the library.

Admission prices every request by these counts, and a text that counts as nothing but specials is a 400,
so the fast path must give exactly what the model's tokenizer gives: checked on the corpus and on random
ASCII built to hit the corners (controls, punctuation runs, long words, added tokens, truncation).
"""

from __future__ import annotations

import random
import string

import pytest
from tokenizers import Tokenizer

from inference.core import tokens
from inference.core.registry import get_registry

ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \t\n\r\x00\x01\x0b\x0c\x1b\x1f\x7f"
PIECES = ["refund", "Charged", "twice", "unbelievably", "xqzjv", "[SEP", "CLS]", "don't", "e-mail", "..."]
ADDED = ["[CLS]", "[mask]", "[SEP]", "[PAD]"]


def library_count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode_batch([text])[0].ids)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tokens.tokenizer_for(get_registry().get("router"))


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 40)):
        if rng.random() < 0.01:
            parts.append(rng.choice(ADDED))
        elif rng.random() < 0.3:
            parts.append(rng.choice(PIECES))
        elif rng.random() < 0.05:
            parts.append("a" * rng.randint(95, 130))  # about WordPiece's longest word (100 characters)
        else:
            parts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 12))))
        parts.append(rng.choice([" ", "", "\n", "  ", "\t"]))
    return "".join(parts)


def test_the_ascii_counter_gives_the_librarys_count_for_random_ascii(tokenizer):
    count = tokens.ascii_counter(tokenizer)
    assert count is not None, "all-MiniLM-L6-v2's BERT tokenizer should take the fast path"
    rng = random.Random(23)
    checked = 0
    for _ in range(3000):
        text = random_text(rng)
        fast = count(text)
        if fast == -1:  # holds an added token: left to the library
            assert any(t in text.lower() for t in ("[cls]", "[mask]", "[sep]", "[pad]", "[unk]"))
            continue
        assert fast == library_count(tokenizer, text), repr(text)
        checked += 1
    assert checked > 2000


def test_the_corpus_and_long_texts_count_the_same_and_truncate_at_max_seq_length(tokenizer):
    count = tokens.ascii_counter(tokenizer)
    corpus = [line.strip() for line in open("benchmarks/corpus.txt") if line.strip()]
    for text in [*corpus, "", "   ", "\x01\x02", "word " * 400, "!" * 300]:
        assert count(text) == library_count(tokenizer, text), repr(text[:80])
    assert count("word " * 400) == tokens.tokenizer_for(get_registry().get("router")).truncation["max_length"]


def test_a_request_is_priced_the_same_with_or_without_the_fast_path(monkeypatch):
    spec = get_registry().get("router")
    texts = ["I was charged twice", "café au lait", "[MASK] me", "\x00\x01", "tab\there", "x" * 3000]
    fast = tokens.token_counts(spec, texts)
    monkeypatch.setattr(tokens, "ascii_counter", lambda tokenizer: None)
    assert tokens.token_counts(spec, texts) == fast


def test_other_tokenizers_are_counted_by_the_library(tmp_path):
    from tokenizers import models, pre_tokenizers

    other = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    assert tokens.ascii_counter(other) is None
