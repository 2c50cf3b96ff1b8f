"""Token counts in the web tier: what a request will cost the model, before it is admitted.

Admission prices requests in tokens, not requests: one call with 64 texts of 2,000 characters costs
the model hundreds of times what a call with one short text does. The `tokenizers` library (Rust, no
torch) counts exactly what the worker's tokenizer will produce, truncation and special tokens
included: ~70 µs for a short text, ~25 µs for an ASCII corpus text through `ascii_counter` on a BERT tokenizer. It is also where text the model's tokenizer cannot
take is found, so the request gets a 400 naming the text instead of failing in a worker beside
other clients' requests.

A structured input is priced by its task type (inference/core/task_types/). A question over a context
(question-answering) costs what its handler runs: every sentence, or every
window of the whole context, so it is counted whole rather than on a prefix. Measured on this
project's 2-core machine: ~3 ms (span) to ~5 ms (sentence) for a context of 10,000 characters.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

# The web tier tokenizes on its event loop thread only: the library's own thread pool would take
# cores from the model's children on the same host (measured: a flood of 64-text requests slowed a
# light client's P50 tenfold). Read by the library when it first encodes, so set at import.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer  # noqa: E402

from inference.core import task_io
from inference.core.registry import ModelSpec
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
# Characters that hold more than one token of any ordinary text: a prefix of 8 * n characters comes
# out at more than n tokens unless the text is odd (then it is counted whole).
CHARS_PER_TOKEN_BOUND = 8


def token_counts(spec: ModelSpec, inputs: list[Any], stop_above: int | None = None) -> list[int]:
    """Tokens the model will run for each input: what admission prices a request by.

    A text (text tasks) is one sequence, truncated to max_seq_length. A structured input (a question over
    a context, a query and its documents) is what its task type's `input_tokens` says: for
    question-answering, `qa_tokens`.

    With `stop_above`, counting stops once the total passes it (the request is too large to run
    anyway), and the counts returned cover only the inputs counted so far.
    """
    task_type = spec.task_type
    if task_type.takes_text:
        return _text_counts(spec, inputs, stop_above)
    counts: list[int] = []
    for index, item in enumerate(inputs):  # each costs up to its fields' ONLINE_MAX_TEXT_CHARS
        count = task_type.input_tokens(spec, index, item)
        # A request is sliced between dispatches text by text, but one input runs whole on one child:
        # an input over one pass's budget would hold that child (and the requests behind it) for many
        # passes. 10,000 characters of prose fit; 3,000 one-word sentences (13,000 tokens, 6 s) do not.
        if count > spec.max_batch_tokens:
            raise ApiError(
                400,
                "invalid_input",
                f"inputs[{index}] is {count} tokens for model {spec.name!r} ({task_type.sequences_note}); "
                f"one input may be at most {spec.max_batch_tokens} tokens (the model's max_batch_tokens, one "
                f"forward pass): {task_type.split_hint}",
            )
        counts.append(count)
        if stop_above is not None and sum(counts) > stop_above:
            break
    return counts


_off_loop = threading.local()


def token_counts_off_loop(spec: ModelSpec, inputs: list[Any], stop_above: int | None = None) -> list[int]:
    """`token_counts` for a worker thread, where the web tier counts a large request so that its event loop
    keeps serving everyone else: the library only, which releases the GIL while it encodes. The ASCII
    counter is Python and would hold it (a hostile 64-text request cut the loop's turns to a sixth)."""
    _off_loop.library_only = True
    try:
        return token_counts(spec, inputs, stop_above)
    finally:
        _off_loop.library_only = False


def _text_counts(spec: ModelSpec, texts: list[str], stop_above: int | None) -> list[int]:
    """Tokens of each text, specials included, after truncation to max_seq_length.

    The tokenizer truncates only after encoding a whole text, so each text is cut first to a prefix
    that holds more than max_seq_length tokens of any ordinary text: a request of 64 texts of 10,000
    characters costs the event loop what 64 texts of ~2,000 do.
    """
    counts: list[int] = []
    step = len(texts) if stop_above is None else _STEP_TEXTS
    for first in range(0, len(texts), step):
        counts += _truncated_counts(spec, texts[first : first + step], lambda i, first=first: f"inputs[{first + i}]")
        if stop_above is not None and sum(counts) > stop_above:
            break
    return counts


def _truncated_counts(spec: ModelSpec, texts: list[str], where: Callable[[int], str]) -> list[int]:
    """Each text's tokens with specials, truncated to max_seq_length, counted on a prefix when that
    is enough; `where(i)` names text i in an error."""
    tokenizer = tokenizer_for(spec)
    prefix_chars = CHARS_PER_TOKEN_BOUND * spec.max_seq_length
    heads = [text[:prefix_chars] for text in texts]
    fast = None if getattr(_off_loop, "library_only", False) else ascii_counter(tokenizer)
    counts = [fast(head) if fast is not None and head.isascii() else -1 for head in heads]  # -1: not counted
    rest = [i for i, count in enumerate(counts) if count < 0]
    if rest:
        try:
            for i, encoding in zip(rest, encode_batch(tokenizer, [heads[i] for i in rest]), strict=True):
                counts[i] = len(encoding.ids)
        except Exception:
            for i in rest:
                counts[i] = _count_one(tokenizer, spec, where(i), heads[i])
    for i, text in enumerate(texts):
        if len(text) > prefix_chars and counts[i] < spec.max_seq_length:  # an odd text: counted whole
            counts[i] = _count_one(tokenizer, spec, where(i), text)
    return counts


def qa_tokens(spec: ModelSpec, index: int, question: str, context: str) -> int:
    """Tokens the model runs for one question over its context (inputs[index]), by `spec.qa_method`.

    "sentence": the question and each of the context's sentences (task_io.split_sentences) are a
    sequence each, specials included, each truncated to max_seq_length. "span": the question and the
    whole context go into overlapping windows (task_io.span_windows); every context token is counted.
    """
    if spec.qa_method == "sentence":
        # As the handler splits: a context without a sentence (whitespace) is one sequence as it is.
        spans = task_io.split_sentences(context) or [(0, len(context))]
        sequences = [question] + [context[start:end] for start, end in spans]
        field = ("question", "context")
        counts = _truncated_counts(spec, sequences, lambda i: f"inputs[{index}].{field[min(i, 1)]}")
        specials = tokenizer_for(spec).num_special_tokens_to_add(is_pair=False)
        if counts[0] <= specials:
            raise _unreadable(spec, f"inputs[{index}].question")
        if all(count <= specials for count in counts[1:]):
            raise _unreadable(spec, f"inputs[{index}].context")
        return sum(counts)
    tokenizer = _untruncated_for(spec)
    specials = tokenizer.num_special_tokens_to_add(is_pair=True)
    limit = task_io.max_question_tokens(spec.max_seq_length, specials)
    # The question is counted on a prefix first: a question of 10,000 characters is refused for what
    # its first max_seq_length tokens already show, and counted whole only for the message.
    prefix_chars = CHARS_PER_TOKEN_BOUND * spec.max_seq_length
    where = f"inputs[{index}].question"
    question_tokens = _bare_count(tokenizer, spec, where, question[:prefix_chars])
    if len(question) > prefix_chars and question_tokens <= limit:  # an odd question: counted whole
        question_tokens = _bare_count(tokenizer, spec, where, question)
    if question_tokens > limit:
        if len(question) > prefix_chars:
            question_tokens = _bare_count(tokenizer, spec, where, question)
        raise ApiError(
            400,
            "invalid_input",
            f"{where} is {question_tokens} tokens; the limit is {limit} for model {spec.name!r} (its windows of "
            f"max_seq_length {spec.max_seq_length} tokens must hold {task_io.MIN_CONTEXT_TOKENS_PER_WINDOW} "
            "context tokens beside the question)",
        )
    if question_tokens == 0:
        raise _unreadable(spec, where)
    context_tokens = _bare_count(tokenizer, spec, f"inputs[{index}].context", context)
    if context_tokens == 0:
        raise _unreadable(spec, f"inputs[{index}].context")
    stride = task_io.doc_stride(spec.doc_stride, spec.max_seq_length)
    return sum(task_io.span_windows(question_tokens, context_tokens, spec.max_seq_length, stride, specials))


def _unreadable(spec: ModelSpec, where: str) -> ApiError:
    """A field that is not blank but holds nothing the model reads (zero-width or direction marks, a BOM,
    lone combining marks, NUL): its tokenizer drops every character, so any answer would be noise."""
    return ApiError(
        400,
        "invalid_input",
        f"{where} has no text model {spec.name!r} can read: its tokenizer drops every character "
        "(only invisible, control or combining characters)",
    )


# BERT's clean-up (its normalizer's clean_text) drops these ASCII control characters; tab, newline and
# carriage return are whitespace. BERT's pre-tokenizer splits on whitespace and makes each ASCII
# punctuation character a word of its own.
_ASCII_DROPPED = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_ASCII_WORDS = re.compile(r"[^\s!-/:-@\[-`{-~]+|[!-/:-@\[-`{-~]")
# Words whose piece counts a web process keeps (per tokenizer; each at most max_input_chars_per_word,
# 100, characters: a few MB at most); past this the memo starts again.
_WORD_MEMO_MAX = 50_000


@cache
def ascii_counter(tokenizer: Tokenizer) -> Callable[[str], int] | None:
    """An exact token counter for ASCII text, for a BERT WordPiece tokenizer; None for any other.

    The library spends ~70 µs on a short text (its normalizer alone ~45 µs through the binding), a
    tenth of the web tier's CPU per request at the identity model's peak. For ASCII, BERT's normalizer
    and pre-tokenizer are a few lines (drop controls, lowercase, split on whitespace and punctuation);
    each word's WordPiece count comes from the tokenizer's own model and is memoised, as the words of
    real text repeat. tests/inference/test_tokens.py checks it against the library on random ASCII.
    """
    config = json.loads(tokenizer.to_str())
    normalizer, pre, model = (
        config.get("normalizer") or {},
        config.get("pre_tokenizer") or {},
        config.get("model") or {},
    )
    if not (
        normalizer.get("type") == "BertNormalizer"
        and normalizer.get("clean_text")
        and pre.get("type") == "BertPreTokenizer"
        and model.get("type") == "WordPiece"
    ):
        return None
    # The library finds added tokens ("[CLS]", "[MASK]" ...) in the raw text before normalizing: a text
    # holding one (in any case, to be safe) is left to it.
    added = tuple({token["content"].lower() for token in config.get("added_tokens") or [] if token.get("content")})
    lowercase = bool(normalizer.get("lowercase"))
    # WordPiece gives a longer word one [UNK]: counted without asking the model, and never memoised (a
    # client sending unique long words would otherwise fill the memo with them).
    longest = int(model.get("max_input_chars_per_word") or 100)
    specials = tokenizer.num_special_tokens_to_add(is_pair=False)
    truncation = tokenizer.truncation
    max_length = truncation["max_length"] if truncation else None
    word_model = tokenizer.model
    memo: dict[str, int] = {}

    def pieces(word: str) -> int:
        count = memo.get(word)
        if count is None:
            if len(word) > longest:
                return 1
            if len(memo) >= _WORD_MEMO_MAX:
                memo.clear()
            count = memo[word] = len(word_model.tokenize(word))
        return count

    def count(text: str) -> int:
        """Tokens of ASCII `text`, specials included, truncated; -1 when the library must count it."""
        folded = text.lower()
        if any(token in folded for token in added):
            return -1
        text = _ASCII_DROPPED.sub("", folded if lowercase else text)
        words = _ASCII_WORDS.findall(text)
        known = list(map(memo.get, words))
        total = specials + (sum(known) if None not in known else sum(map(pieces, words)))
        return total if max_length is None else min(total, max_length)

    return count


def encode_batch(tokenizer: Tokenizer, texts: list[str], add_special_tokens: bool = True) -> list:
    """Encodings of `texts`, without character offsets where the library can skip them (~20% cheaper
    on short texts; measured 3x cheaper than `encode` on a context of 10,000 characters)."""
    fast = getattr(tokenizer, "encode_batch_fast", None)  # tokenizers >= 0.20
    return (fast or tokenizer.encode_batch)(texts, add_special_tokens=add_special_tokens)


@cache
def _untruncated_for(spec: ModelSpec) -> Tokenizer:
    """The model's tokenizer without truncation: span QA runs every token of a context."""
    tokenizer = Tokenizer.from_file(str(spec.resolved_path() / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _bare_count(tokenizer: Tokenizer, spec: ModelSpec, where: str, text: str) -> int:
    """Tokens of `text` without special tokens (a span-QA window adds them once for the pair)."""
    try:
        return len(encode_batch(tokenizer, [text], add_special_tokens=False)[0].ids)
    except Exception as exc:  # say which field the tokenizer refuses
        raise ApiError(400, "invalid_input", f"{where} cannot be tokenized by model {spec.name!r}: {exc}") from None


def _count_one(tokenizer: Tokenizer, spec: ModelSpec, where: str, text: str) -> int:
    try:
        return len(tokenizer.encode(text, add_special_tokens=True).ids)
    except Exception as exc:  # say which text the tokenizer refuses
        raise ApiError(400, "invalid_input", f"{where} cannot be tokenized by model {spec.name!r}: {exc}") from None
