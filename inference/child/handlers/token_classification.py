"""`token-classification`: entities (persons, places, ...) found in a text by a token-classification head.

Each input is a plain string; each output is
`{"entities": [{"label", "text", "start", "end", "score"}, ...], "truncated": bool}`, where `start` and
`end` are character offsets into the input (`text == input[start:end]`) and `truncated` says the text was
cut at `max_seq_length` tokens, so entities past that point were not looked for.

Sub-word pieces are merged as the transformers pipeline's "first" aggregation does: a word takes its first
piece's label. Words tagged B-X then I-X (or I-X, I-X) form one entity of label X; "O" is no entity. The
merging is `merge_entities`, a pure function over per-token labels, scores, offsets and word ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from inference.child.handlers.base import Handler
from inference.core.registry import ModelSpec

OUTSIDE = "O"
# Six decimals, as the other handlers answer: enough to rank, small in JSON.
SCORE_DECIMALS = 6


@dataclass(frozen=True)
class EncodedText:
    """One tokenized input: what `forward` needs to map token predictions back onto the text."""

    text: str
    input_ids: list[int]
    offsets: list[tuple[int, int]]  # character (start, end) per token; (0, 0) for special tokens
    word_ids: list[int | None]  # the word each token belongs to; None for special tokens
    truncated: bool  # tokens past max_seq_length were dropped


@dataclass
class _Word:
    """A word's span in the text and its first piece's label and probability."""

    label: str
    score: float
    start: int
    end: int


def split_label(label: str) -> tuple[str | None, str]:
    """("B" | "I" | None, entity label): "B-PER" -> ("B", "PER"); "MISC" -> (None, "MISC")."""
    prefix, dash, rest = label.partition("-")
    if dash and prefix in ("B", "I") and rest:
        return prefix, rest
    return None, label


def _words(
    token_labels: Sequence[str],
    token_scores: Sequence[float],
    offsets: Sequence[tuple[int, int]],
    word_ids: Sequence[int | None],
) -> list[_Word]:
    """Tokens grouped into words: the word spans its pieces, its label and score are its first piece's."""
    words: list[_Word] = []
    previous: int | None = None
    for label, score, (start, end), word_id in zip(token_labels, token_scores, offsets, word_ids, strict=True):
        if word_id is None:  # [CLS], [SEP], padding: never part of a word
            previous = None
            continue
        if word_id == previous:
            words[-1].end = max(words[-1].end, end)
        else:
            words.append(_Word(label=label, score=score, start=start, end=end))
        previous = word_id
    return words


def _entity(text: str, label: str, members: list[_Word]) -> dict[str, Any] | None:
    start, end = members[0].start, members[-1].end
    # Some tokenizers' offsets include the space before a word; the answer's span never does.
    piece = text[start:end]
    start += len(piece) - len(piece.lstrip())
    end -= len(piece) - len(piece.rstrip())
    if start >= end:
        return None
    score = sum(word.score for word in members) / len(members)
    return {"label": label, "text": text[start:end], "start": start, "end": end, "score": round(score, SCORE_DECIMALS)}


def merge_entities(
    text: str,
    token_labels: Sequence[str],
    token_scores: Sequence[float],
    offsets: Sequence[tuple[int, int]],
    word_ids: Sequence[int | None],
) -> list[dict[str, Any]]:
    """Entities in `text` from per-token predictions, in text order.

    `token_labels[i]` is token i's predicted label (e.g. "B-PER"), `token_scores[i]` its probability,
    `offsets[i]` its character span in `text` and `word_ids[i]` the word it belongs to (None for special
    tokens). A word takes its first piece's label. A B- label starts an entity; an I- label continues the
    entity before it when that entity has the same label, and otherwise starts one (a model may skip the
    B-). A label without a prefix behaves like I- (consecutive words with it form one entity, as in the
    transformers pipeline). "O" ends an entity. An entity's score is the mean of its words' scores.
    """
    entities: list[dict[str, Any]] = []
    current_label: str | None = None
    members: list[_Word] = []

    def close() -> None:
        if members and current_label is not None:
            entity = _entity(text, current_label, members)
            if entity is not None:
                entities.append(entity)

    for word in _words(token_labels, token_scores, offsets, word_ids):
        prefix, label = split_label(word.label)
        if word.label == OUTSIDE:
            close()
            current_label, members = None, []
        elif prefix == "B" or label != current_label:
            close()
            current_label, members = label, [word]
        else:
            members.append(word)
    close()
    return entities


class TokenClassificationHandler(Handler):
    """Entities per text: sub-word pieces merged into words, B-/I- tagged words into entities."""

    kind = "token-classifier"

    def __init__(self, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module) -> None:
        if not tokenizer.is_fast:
            # Only fast (Rust) tokenizers give character offsets and word ids.
            raise ValueError(f"{spec.name}: token-classification needs a fast tokenizer (tokenizer.json)")
        super().__init__(spec, tokenizer, model)
        id2label = model.config.id2label
        self.labels = [str(id2label.get(i, i)) for i in range(model.config.num_labels)]

    def tokenize(self, texts: list[Any]) -> list[EncodedText]:
        """Ids, offsets and word ids per text, truncated to max_seq_length tokens but not padded."""
        encoded = self.tokenizer(
            texts,
            truncation=True,
            max_length=self.spec.max_seq_length,
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=False,
            return_offsets_mapping=True,
        )
        return [
            EncodedText(
                text=text,
                input_ids=encoded["input_ids"][i],
                offsets=[tuple(pair) for pair in encoded["offset_mapping"][i]],
                word_ids=encoded.word_ids(i),
                # The fast tokenizer keeps what truncation cut off here: non-empty means tokens were lost.
                truncated=bool(encoded.encodings[i].overflowing),
            )
            for i, text in enumerate(texts)
        ]

    def cost(self, item: Any) -> tuple[int, int]:
        return 1, len(item.input_ids)

    def forward(self, items: list[Any]) -> list[dict[str, Any]]:
        """One forward pass over the batch (EncodedText items) padded to its longest text; entities per text."""
        input_ids, attention_mask = self.to_device([item.input_ids for item in items])
        with torch.inference_mode():
            logits = self.run_model(input_ids, attention_mask).logits
            probs = torch.softmax(logits.float(), dim=-1)
            best_scores, best_ids = probs.max(dim=-1)
        best_scores, best_ids = best_scores.cpu(), best_ids.cpu()
        outputs = []
        for row, item in enumerate(items):
            length = len(item.input_ids)  # padding's predictions are dropped here
            labels = [self.labels[i] for i in best_ids[row, :length].tolist()]
            entities = merge_entities(
                item.text, labels, best_scores[row, :length].tolist(), item.offsets, item.word_ids
            )
            outputs.append({"entities": entities, "truncated": item.truncated})
        return outputs

    def warm_up(self) -> None:
        """Run the largest batch shape once through the whole path (tokenize, pass, merge)."""
        self.forward(self.tokenize(["the " * self.spec.max_seq_length] * self.largest_pass_rows()))
