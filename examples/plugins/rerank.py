"""A `rerank` task as a plugin: a cross-encoder scores how well each document answers a query.

This file is the whole task. Nothing in the platform names it: put its folder on PYTHONPATH of the web
process and the workers, and register a model in the models file:

    models:
      reranker:
        task: rerank:RerankTask            # module:Class of the TaskType below
        path: /models/ms-marco-MiniLM-L-6-v2
        max_seq_length: 256
        options: {max_documents: 32}       # optional; checked by RerankTask.check_options

Online, one input is {"query": "...", "documents": ["...", ...]} (1 to `max_documents` non-empty strings)
and one output is

    {"scores": [one per document, in input order], "ranking": [document indices, best first],
     "label": "<index of the best document>", "score": <its score>}

so a jobs row's label is the best document's index and its score the best score (a review lists them as
for a classifier). In a job (CSV or JSON lines), a row has a `query` column and a `documents` column whose
cell is a JSON array of strings: `["first passage", "second passage"]`. The upload names them with
`query_column` and `documents_column` (default: query, documents).

The handler runs only in a worker child: torch and transformers are imported inside `_handler_class`,
never when the web tier imports this module to validate and price requests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from typing import TYPE_CHECKING, Any

from inference.core.task_types import (
    ExportColumn,
    TaskType,
    TaskTypeError,
    cell_error,
    check_string,
    invalid,
    type_name,
)
from platform_.errors import ApiError

if TYPE_CHECKING:
    from inference.core.registry import ModelSpec

# The most documents one input may have unless the models file's `options: {max_documents: n}` says:
# each document is a sequence of its own, so one input of 32 documents of 256 tokens is 8,192 tokens.
DEFAULT_MAX_DOCUMENTS = 32
MAX_DOCUMENTS_LIMIT = 256


def _documents_of(inputs: Mapping[str, Any]) -> list:
    try:
        documents = json.loads(inputs.get("documents") or "[]")
    except (ValueError, RecursionError):
        return []
    return documents if isinstance(documents, list) else []


def _best_document(inputs: Mapping[str, Any], output: Mapping[str, Any] | None) -> str:
    ranking = (output or {}).get("ranking") or []
    documents = _documents_of(inputs)
    best = ranking[0] if ranking else None
    return str(documents[best]) if isinstance(best, int) and 0 <= best < len(documents) else ""


def _json_cell(key: str):
    def value(inputs: Mapping[str, Any], output: Mapping[str, Any] | None) -> str:
        found = (output or {}).get(key)
        return "" if found is None else json.dumps(found, separators=(",", ":"))

    return value


class RerankTask(TaskType):
    """Scores each of a query's documents with a cross-encoder, and ranks them."""

    name = "rerank"
    input_fields = ("query", "documents")
    handler = f"{__name__}:load_handler"
    input_schema = "QueryDocuments"
    output_schema = "Rerank"
    option_defaults = {"max_documents": DEFAULT_MAX_DOCUMENTS}
    sequences_note = "one sequence per document, the query beside it"
    input_noun = "the query and documents"
    split_hint = "send fewer or shorter documents"
    export_columns = (
        ExportColumn("query", lambda inputs, output: str(inputs.get("query", ""))),
        ExportColumn("documents", lambda inputs, output: str(inputs.get("documents", ""))),
        "status",
        "label",
        ExportColumn("best_document", _best_document),
        "score",
        ExportColumn("ranking", _json_cell("ranking")),
        ExportColumn("scores", _json_cell("scores")),
        "corrected_label",
        "low_confidence",
    )
    score_heading = "Relevance"
    score_help = "the cross-encoder's relevance score of the best document (higher is more relevant; not a probability)"
    input_heading = "Query"
    answer_heading = "Best document (its index)"

    def schemas(self, max_chars: int) -> dict[str, dict[str, Any]]:
        text = {"type": "string", "minLength": 1, "maxLength": max_chars}
        return {
            "QueryDocuments": {
                "type": "object",
                "properties": {
                    "query": text,
                    "documents": {"type": "array", "minItems": 1, "maxItems": MAX_DOCUMENTS_LIMIT, "items": text},
                },
                "required": ["query", "documents"],
                "additionalProperties": False,
                "example": self.input_example(),
            },
            "Rerank": {
                "type": "object",
                "properties": {
                    "scores": {
                        "type": "array",
                        "items": {"type": "number"},
                        "description": "each document's relevance, in input order",
                    },
                    "ranking": {
                        "type": "array",
                        "items": {"type": "integer"},
                        "description": "document indices, most relevant first",
                    },
                    "label": {"type": "string", "description": "the best document's index"},
                    "score": {"type": "number", "description": "its relevance"},
                },
                "required": ["scores", "ranking", "label", "score"],
                "example": {"scores": [-2.1, 4.3], "ranking": [1, 0], "label": "1", "score": 4.3},
            },
        }

    def input_example(self) -> Any:
        return {
            "query": "How long does delivery take?",
            "documents": ["Refunds go to the original card.", "Delivery takes 5 to 7 working days."],
        }

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        checked = super().check_options(options)
        count = checked["max_documents"]
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DOCUMENTS_LIMIT:
            raise TaskTypeError(f"options.max_documents must be a whole number from 1 to {MAX_DOCUMENTS_LIMIT}")
        return checked

    # Online ----------------------------------------------------------------------------------------------

    def check_input(self, item: Any, index: int, max_chars: int, model: str = "", options: Mapping = {}) -> None:
        where = f"inputs[{index}]"
        self.check_fields(item, where, model)
        check_string(item["query"], f"{where}.query", max_chars)
        documents = item["documents"]
        limit = options.get("max_documents", DEFAULT_MAX_DOCUMENTS)
        if not isinstance(documents, list):
            raise invalid(f"{where}.documents must be a list of strings, got {type_name(documents)}")
        if not documents:
            raise invalid(f"{where}.documents is empty: send 1 to {limit} documents")
        if len(documents) > limit:
            raise invalid(f"{where}.documents has {len(documents)} documents; the limit is {limit} for model {model!r}")
        for at, document in enumerate(documents):
            check_string(document, f"{where}.documents[{at}]", max_chars)

    def input_tokens(self, spec: ModelSpec, index: int, item: Any) -> int:
        """Every (query, document) pair as the handler tokenizes it: specials included, truncated to
        max_seq_length (the query and the document cut alike, longest first)."""
        from inference.core.tokens import CHARS_PER_TOKEN_BOUND, encode_batch, tokenizer_for

        # A prefix of this many characters holds at least max_seq_length tokens, so the pair truncates to
        # the same count: the web tier never tokenizes a 10,000-character query 32 times over.
        cut = CHARS_PER_TOKEN_BOUND * spec.max_seq_length
        query = item["query"][:cut]
        pairs = [(query, document[:cut]) for document in item["documents"]]
        try:
            encodings = encode_batch(tokenizer_for(spec), pairs)
        except Exception as exc:  # say which input the tokenizer refuses
            raise invalid(f"inputs[{index}] cannot be tokenized by model {spec.name!r}: {exc}") from None
        return sum(len(encoding.ids) for encoding in encodings)

    # Jobs ------------------------------------------------------------------------------------------------

    def cells_error(self, cells: Mapping[str, Any], max_chars: int) -> str:
        error = cell_error("query", cells.get("query"), max_chars) or cell_error(
            "documents", cells.get("documents"), max_chars
        )
        if error:
            return error
        try:
            documents = json.loads(cells["documents"])
        except RecursionError:  # "[[[[...": nested past Python's stack, not a list of strings either
            return 'documents is nested too deeply: send a flat JSON array of strings (["first", "second"])'
        except ValueError as exc:
            return f'documents is not a JSON array of strings (["first", "second"]): {exc}'
        if not isinstance(documents, list) or not documents:
            return 'documents must be a non-empty JSON array of strings (["first", "second"])'
        for at, document in enumerate(documents):
            if not isinstance(document, str) or not document.strip():
                return f"documents[{at}] is empty or not a string"
        return ""

    def input_from_cells(self, cells: Mapping[str, str]) -> Any:
        return {"query": cells["query"], "documents": json.loads(cells["documents"])}

    def input_problem(self, spec: ModelSpec, item: Any) -> str:
        limit = spec.option("max_documents")
        if len(item["documents"]) > limit:
            return f"{len(item['documents'])} documents; the limit is {limit} for model {spec.name!r}"
        try:
            self.check_input(item, 0, 10**9, spec.name, dict(spec.options))
        except ApiError as error:
            return error.detail.removeprefix("inputs[0].")[:500]
        return super().input_problem(spec, item)


# The handler: runs in a worker child only ---------------------------------------------------------------


def load_handler(spec: ModelSpec) -> Any:
    """The handler of a rerank model (what `RerankTask.handler` names): a worker child calls it."""
    return _handler_class().load(spec)


@cache
def _handler_class() -> type:
    """The handler class, defined on first use so that importing this module never imports torch."""
    import torch

    from inference.child.handlers.base import Handler

    class RerankHandler(Handler):
        """A cross-encoder: AutoModelForSequenceClassification with one output over (query, document)."""

        kind = "classifier"

        def tokenize(self, inputs: list[dict[str, Any]]) -> list[list[tuple[list[int], list[int]]]]:
            """Per input, each (query, document) pair's token ids and token types, truncated, not padded."""
            items = []
            for item in inputs:
                documents = item["documents"]
                encoded = self.tokenizer(
                    [item["query"]] * len(documents),
                    documents,
                    truncation=True,
                    max_length=self.spec.max_seq_length,
                    padding=False,
                    return_attention_mask=False,
                    return_token_type_ids=True,
                )
                items.append(list(zip(encoded["input_ids"], encoded["token_type_ids"], strict=True)))
            return items

        def cost(self, item: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
            """Each document is a sequence of its own, as a QA context's windows are."""
            return len(item), max(len(ids) for ids, _ in item)

        def forward(self, items: list[list[tuple[list[int], list[int]]]]) -> list[dict[str, Any]]:
            """Every pair of the batch scored, in passes within the model's budget, then ranked per input."""
            pairs = [pair for item in items for pair in item]
            order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]))
            scores = [0.0] * len(pairs)
            for part in self._passes([len(pairs[i][0]) for i in order]):
                chosen = [order[i] for i in part]
                for at, value in zip(chosen, self._scores([pairs[i] for i in chosen]), strict=True):
                    scores[at] = value
            outputs, at = [], 0
            for item in items:
                own = [round(value, 6) for value in scores[at : at + len(item)]]
                at += len(item)
                ranking = sorted(range(len(own)), key=lambda i: (-own[i], i))
                outputs.append({"scores": own, "ranking": ranking, "label": str(ranking[0]), "score": own[ranking[0]]})
            return outputs

        def _passes(self, lengths: list[int]) -> list[list[int]]:
            """Positions of length-sorted sequences cut into passes of at most max_batch_size sequences
            and max_batch_tokens padded tokens."""
            passes: list[list[int]] = []
            for position, length in enumerate(lengths):
                current = passes[-1] if passes else None
                fits = (
                    current is not None
                    and len(current) < self.spec.max_batch_size
                    and (len(current) + 1) * length <= self.spec.max_batch_tokens
                )
                if fits:
                    current.append(position)
                else:
                    passes.append([position])
            return passes

        def _scores(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
            longest = max(len(ids) for ids, _ in pairs)
            host = torch.zeros((3, len(pairs), longest), dtype=torch.long)
            host[0].fill_(self.pad_id)
            for row, (ids, types) in enumerate(pairs):
                host[0, row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                host[1, row, : len(ids)] = 1
                host[2, row, : len(types)] = torch.tensor(types, dtype=torch.long)
            on_device = host.to(self.device, non_blocking=True)
            with torch.inference_mode():
                logits = self.model(
                    input_ids=on_device[0], attention_mask=on_device[1], token_type_ids=on_device[2]
                ).logits
            return logits[:, 0].float().cpu().tolist()

        def warm_up(self) -> None:
            """The largest pass once: a query and as many full-length documents as one pass holds."""
            filler = self.tokenizer.convert_tokens_to_ids(["the"])[0]
            pair = ([filler] * self.spec.max_seq_length, [0] * self.spec.max_seq_length)
            self.forward([[pair] * self.largest_pass_rows()])

    return RerankHandler
