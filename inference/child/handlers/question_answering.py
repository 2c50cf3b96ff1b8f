"""`question-answering`: the part of a context that answers a question, with its character offsets.

Two methods, chosen by the models file's `qa_method`:

- "sentence" (SentenceQAHandler): a sentence encoder embeds the question and each of the context's
  sentences; the answer is the sentence closest to the question (cosine similarity). Needs no QA
  training, so any embedding model answers "which sentence says it", never a phrase inside one.
- "span" (SpanQAHandler): an extractive head (AutoModelForQuestionAnswering) scores each context token
  as the answer's first and last token; a long context becomes overlapping windows, each window is scored
  on its own, and the best span of any window wins.

An input becomes several sequences, all in the one `forward` call runtime.run plans for it; `forward` runs
them in passes within the model's budget (max_batch_size sequences, max_batch_tokens padded tokens), so
an input of thousands of sentences or windows costs several passes of normal size, never one pass of
gigabytes of activations beside other clients' inputs (`_in_passes`).

Every answer is {"answer", "start", "end", "score"} with `context[start:end] == answer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from inference.child.handlers.base import Handler
from inference.child.handlers.embedding import EmbeddingHandler
from inference.core.planning import plan_batches
from inference.core.registry import ModelSpec

# The window arithmetic lives in task_io, torch-free, so that the web tier prices (and refuses) exactly the
# windows run here. A question leaving a window fewer than MIN_CONTEXT_TOKENS_PER_WINDOW context tokens is
# refused: such windows would turn a context into hundreds of them, and no longer hold a phrase.
from inference.core.task_io import MIN_CONTEXT_TOKENS_PER_WINDOW, doc_stride, split_sentences, window_stride

# Longest answer, in tokens, the span method considers (the transformers pipeline's max_answer_len is 15,
# SQuAD fine-tuning scripts use 30): extractive answers are short phrases, and the bound keeps a random or
# unsure head from answering with half a page, and the span search at windows x tokens x this.
MAX_ANSWER_TOKENS = 30
# Start and end logits of tokens that cannot be part of an answer (question, special tokens, padding)
# before the softmax, as the transformers pipeline masks them: their probability becomes ~0.
_EXCLUDED_LOGIT = -10000.0


def build_qa_handler(spec: ModelSpec) -> Handler:
    """The handler of the spec's `qa_method`."""
    if spec.qa_method == "sentence":
        return SentenceQAHandler.load(spec)
    return SpanQAHandler.load(spec)


def _in_passes(
    spec: ModelSpec, lengths: list[int], run: Callable[[list[int]], tuple[torch.Tensor, ...]]
) -> tuple[torch.Tensor, ...]:
    """`run(indices)` over sequences of these token lengths, in passes within the model's budget.

    `run` takes the indices of the sequences of one pass and returns CPU tensors with one row per
    sequence, in that order; the result is those tensors with a row per sequence in `lengths`' order.
    Sequences within max_batch_size and max_batch_tokens (padded to the longest) run in one pass; more,
    sorted by length and cut by plan_batches as runtime.run cuts inputs. Each row depends on its own
    sequence only (padding is masked), so the rows are those of one pass, within float tolerance.
    """
    if len(lengths) <= spec.max_batch_size and len(lengths) * max(lengths) <= spec.max_batch_tokens:
        return run(list(range(len(lengths))))
    passes = plan_batches(lengths, spec.max_batch_size, spec.max_batch_tokens, spec.max_padding_fraction)
    parts = [run(indices) for indices in passes]
    order = torch.tensor([index for indices in passes for index in indices])
    joined = []
    for part in zip(*parts, strict=True):
        rows = torch.cat(part)
        restored = torch.empty_like(rows)
        restored[order] = rows
        joined.append(restored)
    return tuple(joined)


def _answer(context: str, start_char: int, end_char: int, score: float) -> dict[str, Any]:
    return {"answer": context[start_char:end_char], "start": start_char, "end": end_char, "score": round(score, 6)}


# Sentence selection ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SentenceItem:
    """One input tokenized: the question's ids first, then each sentence's, and the sentences' spans."""

    context: str
    spans: list[tuple[int, int]]
    sequences: list[list[int]]


class SentenceQAHandler(EmbeddingHandler):
    """Answers with the context's sentence whose embedding is closest to the question's."""

    def tokenize(self, inputs: list[dict[str, str]]) -> list[SentenceItem]:
        spans_per_input = []
        texts: list[str] = []
        for item in inputs:
            context = item["context"]
            # A context of whitespace only has no sentence: it is its own (empty-looking) answer.
            spans = split_sentences(context) or [(0, len(context))]
            spans_per_input.append(spans)
            texts.append(item["question"])
            texts.extend(context[start:end] for start, end in spans)
        ids = super().tokenize(texts)  # every question and sentence in one tokenizer call
        items, at = [], 0
        for item, spans in zip(inputs, spans_per_input, strict=True):
            count = 1 + len(spans)
            items.append(SentenceItem(item["context"], spans, ids[at : at + count]))
            at += count
        return items

    def cost(self, item: SentenceItem) -> tuple[int, int]:
        return len(item.sequences), max(len(row) for row in item.sequences)

    def forward(self, items: list[SentenceItem]) -> list[dict[str, Any]]:
        """Every question and sentence of the batch embedded (in passes within the model's budget), then
        one argmax per input."""
        rows = [row for item in items for row in item.sequences]
        (vectors,) = _in_passes(self.spec, [len(row) for row in rows], lambda at: self._vectors([rows[i] for i in at]))
        outputs, at = [], 0
        for item in items:
            question, sentences = vectors[at], vectors[at + 1 : at + len(item.sequences)]
            at += len(item.sequences)
            similarity = sentences @ question  # unit vectors: dot product is cosine similarity
            best = int(similarity.argmax())
            start_char, end_char = item.spans[best]
            outputs.append(_answer(item.context, start_char, end_char, float(similarity[best])))
        return outputs

    def _vectors(self, rows: list[list[int]]) -> tuple[torch.Tensor]:
        """One pass: each sequence's unit vector (float32, on the CPU)."""
        input_ids, attention_mask = self.to_device(rows)
        with torch.inference_mode():
            return (self.embed(self.run_model(input_ids, attention_mask), attention_mask).float().cpu(),)

    def warm_up(self) -> None:
        rows = max(2, self.largest_pass_rows())  # a question and at least one sentence
        filler = self.tokenizer.convert_tokens_to_ids(["the"])[0]
        row = [filler] * self.spec.max_seq_length
        self.forward([SentenceItem("the", [(0, 3)] * (rows - 1), [row] * rows)])


# Span extraction ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpanItem:
    """One input tokenized into windows: [CLS] question [SEP] part of the context [SEP], each with its
    token types, which tokens are the context's, and each token's character span in the context."""

    context: str
    windows: list[list[int]]
    token_types: list[list[int]]
    context_tokens: list[list[bool]]
    offsets: list[list[tuple[int, int]]]


def best_spans(
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    context_mask: torch.Tensor,
    max_answer_tokens: int = MAX_ANSWER_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each window's best span over its context tokens: (score, start token, end token), each of shape
    (windows,). Score = P(start) x P(end), each a softmax over the window's context tokens (as the
    transformers pipeline scores); end >= start and at most `max_answer_tokens` tokens long. A window
    without context tokens scores -1."""
    windows, length = start_logits.shape
    start_p = torch.softmax(start_logits.float().masked_fill(~context_mask, _EXCLUDED_LOGIT), dim=-1)
    end_p = torch.softmax(end_logits.float().masked_fill(~context_mask, _EXCLUDED_LOGIT), dim=-1)
    # [window, start, k] = the end probability / mask at token start + k: windows x tokens x k scores,
    # never the tokens x tokens matrix (a 400-window context would make that a few hundred MB).
    tail = max_answer_tokens - 1
    end_ahead = torch.cat([end_p, end_p.new_zeros(windows, tail)], dim=1).unfold(1, max_answer_tokens, 1)
    end_ok = torch.cat([context_mask, context_mask.new_zeros(windows, tail)], dim=1).unfold(1, max_answer_tokens, 1)
    scores = start_p.unsqueeze(-1) * end_ahead
    scores = scores.masked_fill(~(context_mask.unsqueeze(-1) & end_ok), -1.0)
    best, where = scores.reshape(windows, length * max_answer_tokens).max(dim=1)
    starts = torch.div(where, max_answer_tokens, rounding_mode="floor")
    return best, starts, starts + where % max_answer_tokens


def _pick(item: SpanItem, scores: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> dict[str, Any]:
    """The best of an input's windows, its tokens mapped back to characters of the context."""
    window = int(scores.argmax())
    score = float(scores[window])
    if score < 0:  # no window held a context token (a context the tokenizer reads as nothing)
        return _answer(item.context, 0, 0, 0.0)
    offsets = item.offsets[window]
    return _answer(item.context, offsets[int(starts[window])][0], offsets[int(ends[window])][1], score)


def _pad(rows: list[list[int]], value: int, length: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def choose_answer(item: SpanItem, start_logits: torch.Tensor, end_logits: torch.Tensor) -> dict[str, Any]:
    """The answer for one input from its windows' logits (windows x tokens, padded to the longest)."""
    mask = _pad([[int(t) for t in row] for row in item.context_tokens], 0, start_logits.shape[1]).bool()
    return _pick(item, *best_spans(start_logits, end_logits, mask))


class SpanQAHandler(Handler):
    """Extractive QA: the best span of the context by the head's start and end logits."""

    kind = "question-answering"

    def __init__(self, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module) -> None:
        if not tokenizer.is_fast:
            raise ValueError(f"{spec.name}: span question-answering needs a fast tokenizer (for character offsets)")
        super().__init__(spec, tokenizer, model)
        self.doc_stride = doc_stride(spec.doc_stride, spec.max_seq_length)
        # BERT-like models tell question from context by token type; others (RoBERTa) have none.
        self.uses_token_types = "token_type_ids" in tokenizer.model_input_names
        self.special_tokens = tokenizer.num_special_tokens_to_add(pair=True)

    def context_room(self, question: str) -> int:
        """Context tokens one window holds beside this question; ValueError if too few."""
        question_tokens = len(self.tokenizer(question, add_special_tokens=False)["input_ids"])
        room = self.spec.max_seq_length - question_tokens - self.special_tokens
        if room < MIN_CONTEXT_TOKENS_PER_WINDOW:
            raise ValueError(
                f"the question is {question_tokens} tokens: with {self.special_tokens} special tokens that leaves "
                f"{max(room, 0)} of the model's max_seq_length {self.spec.max_seq_length} for the context, and "
                f"a window needs at least {MIN_CONTEXT_TOKENS_PER_WINDOW}; shorten the question"
            )
        return room

    def tokenize(self, inputs: list[dict[str, str]]) -> list[SpanItem]:
        return [self._windows(item["question"], item["context"]) for item in inputs]

    def _windows(self, question: str, context: str) -> SpanItem:
        room = self.context_room(question)
        # Consecutive windows share `stride` tokens, at most half a window's context: the tokenizer panics
        # unless stride < room (a Rust panic, a BaseException that serving.py's `except Exception` would not
        # turn into one request's 422), and a larger overlap would multiply windows. So a long question gets
        # a smaller overlap than doc_stride.
        stride = window_stride(self.doc_stride, room)
        encoded = self.tokenizer(
            question,
            context,
            truncation="only_second",
            max_length=self.spec.max_seq_length,
            stride=stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding=False,
        )
        windows = encoded["input_ids"]
        return SpanItem(
            context=context,
            windows=windows,
            token_types=encoded["token_type_ids"] if self.uses_token_types else [[0] * len(w) for w in windows],
            context_tokens=[[s == 1 for s in encoded.sequence_ids(i)] for i in range(len(windows))],
            offsets=[[tuple(o) for o in row] for row in encoded["offset_mapping"]],
        )

    def cost(self, item: SpanItem) -> tuple[int, int]:
        return len(item.windows), max(len(row) for row in item.windows)

    def forward(self, items: list[SpanItem]) -> list[dict[str, Any]]:
        """Every window of the batch scored (in passes within the model's budget), then each input's best
        span."""
        rows = [row for item in items for row in item.windows]
        types = [row for item in items for row in item.token_types]
        context = [row for item in items for row in item.context_tokens]
        scores, starts, ends = _in_passes(
            self.spec,
            [len(row) for row in rows],
            lambda at: self._best_spans([rows[i] for i in at], [types[i] for i in at], [context[i] for i in at]),
        )
        outputs, at = [], 0
        for item in items:
            count = len(item.windows)
            outputs.append(_pick(item, scores[at : at + count], starts[at : at + count], ends[at : at + count]))
            at += count
        return outputs

    def _best_spans(
        self, rows: list[list[int]], token_types: list[list[int]], context_tokens: list[list[bool]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass: each window's best span, as `best_spans` (on the CPU)."""
        input_ids, attention_mask = self.to_device(rows)
        longest = input_ids.shape[1]
        # Token types and the context mask travel to the device together, in one copy.
        extra = torch.stack(
            [_pad(token_types, 0, longest), _pad([[int(t) for t in row] for row in context_tokens], 0, longest)]
        ).to(self.device, non_blocking=True)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.uses_token_types:
            inputs["token_type_ids"] = extra[0]
        with torch.inference_mode():
            output = self.model(**inputs)
            scores, starts, ends = best_spans(output.start_logits, output.end_logits, extra[1].bool())
        return scores.cpu(), starts.cpu(), ends.cpu()

    def warm_up(self) -> None:
        rows, length = self.largest_pass_rows(), self.spec.max_seq_length
        filler = self.tokenizer.convert_tokens_to_ids(["the"])[0]
        cls_id, sep_id = self.tokenizer.cls_token_id or filler, self.tokenizer.sep_token_id or filler
        # [CLS] the [SEP] the ... the [SEP]: a one-token question over a full window of context.
        window = [cls_id, filler, sep_id] + [filler] * (length - 4) + [sep_id]
        is_context = [False] * 3 + [True] * (length - 4) + [False]
        item = SpanItem(
            context="the",
            windows=[window] * rows,
            token_types=[[0] * 3 + [1] * (length - 3)] * rows,
            context_tokens=[is_context] * rows,
            offsets=[[(0, 3)] * length] * rows,
        )
        self.forward([item])
