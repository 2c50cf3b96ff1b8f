"""Token counts in the web tier: what a request will cost the model, before it is admitted.

Admission prices requests in tokens, not requests: one call with 64 texts of 2,000 characters costs
the model hundreds of times what a call with one short text does. The `tokenizers` library (Rust, no
torch) counts exactly what the worker's tokenizer will produce, truncation and special tokens
included, in about a microsecond per short text. It is also where text the model's tokenizer cannot
take is found, so the request gets a 400 naming the text instead of failing in a worker beside
other clients' requests.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

# The web tier tokenizes on its event loop thread only: the library's own thread pool would take
# cores from the model's children on the same host (measured: a flood of 64-text requests slowed a
# light client's P50 tenfold). Read by the library when it first encodes, so set at import.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer  # noqa: E402

from inference.registry import ModelSpec
from platform_.errors import ApiError


@cache
def tokenizer_for(spec: ModelSpec) -> Tokenizer:
    """The model's tokenizer (from its folder's tokenizer.json), truncating to its max_seq_length.

    Cached by spec: resolving a `package:` path searches the import path, ~100 µs a request."""
    return _tokenizer(str(spec.resolved_path()), spec.max_seq_length)


@cache
def _tokenizer(path: str, max_length: int) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    tokenizer.enable_truncation(max_length)
    tokenizer.no_padding()
    return tokenizer


# With a stopping point, texts are counted this many at a time.
_STEP_TEXTS = 8


def token_counts(spec: ModelSpec, texts: list[str], stop_above: int | None = None) -> list[int]:
    """Tokens the model will see for each text (after truncation to its max_seq_length).

    The tokenizer truncates only after encoding a whole text, so each text is cut first to a prefix
    that holds more than max_seq_length tokens of any ordinary text (8 characters a token): a request
    of 64 texts of 10,000 characters costs the event loop what 64 texts of ~2,000 do. A text whose
    prefix still comes out short is counted whole.

    With `stop_above`, counting stops once the total passes it (the request is too large to run
    anyway), and the counts returned cover only the texts counted so far.
    """
    tokenizer = tokenizer_for(spec)
    prefix_chars = 8 * spec.max_seq_length
    counts: list[int] = []
    step = len(texts) if stop_above is None else _STEP_TEXTS
    for first in range(0, len(texts), step):
        part = texts[first : first + step]
        heads = [text[:prefix_chars] for text in part]
        try:
            got = [len(e.ids) for e in encode_batch(tokenizer, heads)]
        except Exception:
            got = [_count_one(tokenizer, spec, first + i, text) for i, text in enumerate(heads)]
        for i, text in enumerate(part):
            if len(text) > prefix_chars and got[i] < spec.max_seq_length:
                got[i] = _count_one(tokenizer, spec, first + i, text)
        counts += got
        if stop_above is not None and sum(counts) > stop_above:
            break
    return counts


def encode_batch(tokenizer: Tokenizer, texts: list[str]) -> list:
    """Encodings of `texts`, without character offsets where the library can skip them (~20% cheaper)."""
    fast = getattr(tokenizer, "encode_batch_fast", None)  # tokenizers >= 0.20
    return (fast or tokenizer.encode_batch)(texts, add_special_tokens=True)


def _count_one(tokenizer: Tokenizer, spec: ModelSpec, index: int, text: str) -> int:
    try:
        return len(tokenizer.encode(text, add_special_tokens=True).ids)
    except Exception as exc:  # say which text the tokenizer refuses
        raise ApiError(
            400, "invalid_input", f"inputs[{index}] cannot be tokenized by model {spec.name!r}: {exc}"
        ) from None
