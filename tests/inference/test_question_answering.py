"""Question answering as the worker runs it: handlers loaded in this process, inputs through runtime.run.

The sentence method runs the packaged all-MiniLM-L6-v2 over real paragraphs; the span method runs the
tiny random BERT QA head (tests/conftest.py::tiny_qa), whose answers mean nothing but whose windows,
offsets and batching must be right all the same. The last two tests ask the live stack (web process
and worker, tests/conftest.py) for the models file's "qa" and "qa-span".
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from benchmarks.tiny_bert import MINILM
from inference.child import runtime
from inference.child.handlers import build_handler
from inference.child.handlers.question_answering import (
    MAX_ANSWER_TOKENS,
    SentenceQAHandler,
    SpanQAHandler,
    best_spans,
    choose_answer,
)
from inference.core.registry import ModelSpec
from inference.core.task_io import split_sentences

EIFFEL = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. "
    "The tower is 330 metres tall, about the same height as an 81-storey building. "
    "Tickets can be bought online or at the ticket offices at the foot of the tower."
)
INVOICES = (
    "Invoices are issued on the first business day of each month. "
    "Payment is due within 30 days of the invoice date. "
    "A late fee of 2% per month is charged on balances that remain unpaid after the due date. "
    "Refunds are issued to the original payment method within 10 business days. "
    "To dispute a charge, email billing@example.com with the invoice number."
)
# About 2,000 characters of prose, with a marker sentence near its end, so that it lies in a later window.
LONG_CONTEXT = (
    " ".join(
        f"Paragraph {n} of the maintenance log says the north lift was inspected and found in working order."
        for n in range(20)
    )
    + " The final inspection certificate was signed by Marta Kowalska on 3 March."
)
SPAN_LIMITS = {"max_batch_size": 32, "max_batch_tokens": 4096, "max_seq_length": 128}


@pytest.fixture(scope="module")
def sentence_qa() -> str:
    spec = ModelSpec(
        name="test-qa-sentence", task="question-answering", path=MINILM, qa_method="sentence", **SPAN_LIMITS
    )
    runtime.load([spec])
    return spec.name


@pytest.fixture(scope="module")
def span_qa(tiny_qa) -> str:
    spec = ModelSpec(name="test-qa-span", task="question-answering", path=str(tiny_qa), doc_stride=32, **SPAN_LIMITS)
    runtime.load([spec])
    return spec.name


def span_handler(name: str) -> SpanQAHandler:
    handler = runtime._handlers[name]
    assert isinstance(handler, SpanQAHandler)
    return handler


def answers(model: str, pairs: list[tuple[str, str]]) -> list[dict]:
    outputs, _ = runtime.run(model, [{"question": q, "context": c} for q, c in pairs])
    return outputs


def assert_offsets_match(output: dict, context: str) -> None:
    assert set(output) == {"answer", "start", "end", "score"}
    assert 0 <= output["start"] <= output["end"] <= len(context)
    assert context[output["start"] : output["end"]] == output["answer"]


def sentence_of(context: str, starts_with: str) -> str:
    (sentence,) = [context[s:e] for s, e in split_sentences(context) if context[s:e].startswith(starts_with)]
    return sentence


# Sentence selection ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("context", "question", "expected"),
    [
        (EIFFEL, "In which city is the Eiffel Tower?", "The Eiffel Tower is"),
        (EIFFEL, "Who designed the tower?", "It is named after"),
        (EIFFEL, "How tall is the Eiffel Tower?", "The tower is 330"),
        (EIFFEL, "Where can I buy tickets?", "Tickets can be bought"),
        (INVOICES, "When is payment due?", "Payment is due"),
        (INVOICES, "What happens if I pay late?", "A late fee"),
        (INVOICES, "How do I dispute a charge?", "To dispute"),
    ],
)
def test_sentence_qa_answers_with_the_sentence_that_answers(sentence_qa, context, question, expected):
    (output,) = answers(sentence_qa, [(question, context)])
    assert output["answer"] == sentence_of(context, expected)
    assert_offsets_match(output, context)
    assert 0.3 < output["score"] <= 1.0  # cosine similarity of a good match for MiniLM


def test_sentence_qa_answers_a_one_sentence_context_with_it(sentence_qa):
    context = "  Our office is closed on public holidays  "
    (output,) = answers(sentence_qa, [("What is the weather like?", context)])
    assert output["answer"] == "Our office is closed on public holidays"
    assert_offsets_match(output, context)


def test_sentence_qa_costs_the_question_and_each_sentence(sentence_qa):
    handler = runtime._handlers[sentence_qa]
    (item,) = handler.tokenize([{"question": "Who designed the tower?", "context": EIFFEL}])
    rows, longest = handler.cost(item)
    assert rows == 1 + len(split_sentences(EIFFEL)) == 5
    assert longest == max(len(handler.tokenizer(s)["input_ids"]) for s in (EIFFEL[s:e] for s, e in item.spans))


# Span extraction ---------------------------------------------------------------------------------------


def test_span_answers_are_slices_of_their_context(span_qa):
    pairs = [
        ("Who built it?", EIFFEL),
        ("When is payment due?", INVOICES),
        ("Who signed?", LONG_CONTEXT),
        ("Où est-il ?", "Le café « Chez Zoë » se trouve   rue de l'Église, à Genève.\n\nIl ouvre à 7 h."),
    ]
    for output, (_, context) in zip(answers(span_qa, pairs), pairs, strict=True):
        assert_offsets_match(output, context)
        assert output["answer"] and output["answer"] == output["answer"].strip()
        assert 0.0 < output["score"] <= 1.0


def test_a_long_context_becomes_overlapping_windows_that_cover_all_of_it(span_qa):
    assert len(LONG_CONTEXT) > 2000
    handler = span_handler(span_qa)
    (item,) = handler.tokenize([{"question": "Who signed the certificate?", "context": LONG_CONTEXT}])
    windows, longest = handler.cost(item)
    assert windows == len(item.windows) > 3
    assert longest == 128
    covered = set()
    spans_per_window = []
    for offsets, is_context in zip(item.offsets, item.context_tokens, strict=True):
        spans = [span for span, inside in zip(offsets, is_context, strict=True) if inside]
        spans_per_window.append(spans)
        for start, end in spans:
            covered.update(range(start, end))
    uncovered = [i for i, ch in enumerate(LONG_CONTEXT) if not ch.isspace() and i not in covered]
    assert uncovered == []
    # Consecutive windows share doc_stride (32) tokens, so an answer cut by one window's edge is whole in the next.
    for before, after in zip(spans_per_window, spans_per_window[1:], strict=False):
        assert before[-32:] == after[:32]


def test_an_answer_can_come_from_a_later_window(span_qa):
    handler = span_handler(span_qa)
    (item,) = handler.tokenize([{"question": "Who signed the certificate?", "context": LONG_CONTEXT}])
    last = len(item.windows) - 1
    # The head is sure the answer is "Marta Kowalska", which only the last window holds.
    name_start = LONG_CONTEXT.index("Marta")
    name_end = name_start + len("Marta Kowalska")
    tokens = [
        i
        for i, (s, e) in enumerate(item.offsets[last])
        if item.context_tokens[last][i] and s < name_end and e > name_start
    ]
    first_window_end = max(e for (_, e), inside in zip(item.offsets[0], item.context_tokens[0], strict=True) if inside)
    assert first_window_end < name_start
    length = max(len(w) for w in item.windows)
    start_logits, end_logits = torch.zeros(len(item.windows), length), torch.zeros(len(item.windows), length)
    start_logits[last, tokens[0]] = 20.0
    end_logits[last, tokens[-1]] = 20.0
    output = choose_answer(item, start_logits, end_logits)
    assert output["answer"] == "Marta Kowalska"
    assert (output["start"], output["end"]) == (name_start, name_end)
    assert output["score"] > 0.99


def test_best_span_ends_after_it_starts_and_is_bounded():
    length = 80
    mask = torch.zeros(1, length, dtype=torch.bool)
    mask[0, 5:75] = True
    start_logits, end_logits = torch.zeros(1, length), torch.zeros(1, length)
    start_logits[0, 40] = 10.0
    end_logits[0, 10] = 10.0  # the likeliest end lies before the likeliest start
    end_logits[0, 40 + MAX_ANSWER_TOKENS + 5] = 9.0  # and the next likeliest too far after it
    end_logits[0, 3] = 50.0  # a question token: never part of an answer
    _, starts, ends = best_spans(start_logits, end_logits, mask)
    start, end = int(starts[0]), int(ends[0])
    assert 5 <= start <= end < 75
    assert end - start < MAX_ANSWER_TOKENS


def test_a_long_question_shrinks_the_overlap_instead_of_failing(span_qa):
    # This question leaves 32 context tokens per window, no more than doc_stride (32): the tokenizer panics
    # on such a stride (a Rust panic, which `except Exception` misses), so the handler overlaps windows by
    # half a window at most.
    question = "Considering the whole maintenance history described in the log, " * 9 + "who signed?"
    handler = span_handler(span_qa)
    (item,) = handler.tokenize([{"question": question, "context": LONG_CONTEXT}])
    assert handler.cost(item)[0] > 10
    (output,) = answers(span_qa, [(question, LONG_CONTEXT)])
    assert_offsets_match(output, LONG_CONTEXT)


def test_a_question_that_leaves_no_room_for_the_context_is_refused(span_qa):
    question = "why " * 200
    with pytest.raises(ValueError) as refused:
        answers(span_qa, [(question, EIFFEL)])
    message = str(refused.value)
    tokens = int(re.search(r"question is (\d+) tokens", message).group(1))
    assert tokens == 200
    assert "max_seq_length 128" in message


# Batching ----------------------------------------------------------------------------------------------


BATCH = [
    ("How tall is the tower?", EIFFEL),
    ("When is payment due?", INVOICES),
    ("Who signed the certificate?", LONG_CONTEXT),
    ("Where?", "Geneva."),
    ("What time does it open?", "The café opens at 7 am. It closes at 6 pm on weekdays and at noon on Saturdays."),
]


@pytest.mark.parametrize("model", ["sentence_qa", "span_qa"])
def test_batching_does_not_change_answers(model, request):
    name = request.getfixturevalue(model)
    handler = runtime._handlers[name]
    inputs = [{"question": q, "context": c} for q, c in BATCH]
    together = handler.forward(handler.tokenize(inputs))  # one padded pass holding every input's sequences
    alone = [answers(name, [pair])[0] for pair in BATCH]
    for one, other in zip(together, alone, strict=True):
        assert (one["answer"], one["start"], one["end"]) == (other["answer"], other["start"], other["end"])
        assert one["score"] == pytest.approx(other["score"], rel=1e-3, abs=1e-5)


def test_warm_up_runs_the_largest_pass_and_answers_stay_the_same(sentence_qa, span_qa):
    for name in (sentence_qa, span_qa):
        before = answers(name, BATCH[:2])
        runtime._handlers[name].warm_up()
        assert answers(name, BATCH[:2]) == before


def test_build_handler_loads_each_method(tiny_qa):
    sentence = build_handler(
        ModelSpec(name="s", task="question-answering", path=MINILM, qa_method="sentence", **SPAN_LIMITS)
    )
    span = build_handler(ModelSpec(name="x", task="question-answering", path=str(tiny_qa), **SPAN_LIMITS))
    assert isinstance(sentence, SentenceQAHandler)
    assert isinstance(span, SpanQAHandler) and span.doc_stride == 128 // 4


# Served by the live stack (tests/conftest.py::models_file: "qa" and "qa-span") ---------------------------


@pytest.mark.integration
def test_the_qa_model_answers_over_the_api(stack):
    reply = stack.predict("qa", [{"question": "How tall is the Eiffel Tower?", "context": EIFFEL}])
    assert reply.status_code == 200, reply.text
    (output,) = reply.json()["outputs"]
    assert output["answer"] == sentence_of(EIFFEL, "The tower is 330")
    assert_offsets_match(output, EIFFEL)


@pytest.mark.integration
def test_a_too_long_question_is_refused_alone_and_its_neighbour_answered(stack):
    # Sent at once, so they may share a batch; either way each gets its own answer. The web tier refuses
    # the question before it is queued (400), the worker would otherwise (422 input_rejected).
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(stack.predict, "qa-span", [{"question": "why " * 200, "context": EIFFEL}])
        good = pool.submit(stack.predict, "qa-span", [{"question": "Who built it?", "context": LONG_CONTEXT}])
        bad, good = bad.result(), good.result()
    assert bad.status_code in (400, 422), bad.text
    assert "200 tokens" in bad.json()["detail"]
    assert good.status_code == 200, good.text
    assert_offsets_match(good.json()["outputs"][0], LONG_CONTEXT)


# Inputs of many sequences run in passes within the model's budget ---------------------------------------


def pass_shapes(monkeypatch, handler, attribute: str) -> list[tuple[int, int]]:
    """(sequences, padded length) of each model call `handler` makes through `attribute` from now on."""
    shapes: list[tuple[int, int]] = []
    original = getattr(handler, attribute)

    def recorded(*args, **kwargs):
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        shapes.append(tuple(input_ids.shape))
        return original(*args, **kwargs)

    monkeypatch.setattr(handler, attribute, recorded)
    return shapes


def assert_same_answers(split: list[dict], whole: list[dict]) -> None:
    for one, other in zip(split, whole, strict=True):
        assert (one["answer"], one["start"], one["end"]) == (other["answer"], other["start"], other["end"])
        assert one["score"] == pytest.approx(other["score"], rel=1e-4, abs=1e-5)


def unbounded(budget: dict) -> dict:
    """The same model with a pass budget no input reaches: every sequence in one pass."""
    return {**budget, "max_batch_size": 1 << 20, "max_batch_tokens": 1 << 30}


def test_a_context_of_a_thousand_sentences_runs_in_passes_within_the_budget(monkeypatch):
    # One sentence longer than max_seq_length (truncated to 32 tokens), then 1,000 tiny ones with the answer
    # among them. In one pass these would be 1,002 sequences padded to 32 tokens (with max_seq_length 256,
    # to 256 each); a short max_seq_length keeps that one-pass reference cheap on a CPU.
    long_sentence = "The maintenance log lists " + ", ".join(f"valve {n} checked" for n in range(80)) + "."
    tiny = [f"Item {n}." for n in range(1000)]
    tiny[700] = "Tickets cost 20 euros."
    context = " ".join([long_sentence, *tiny])
    inputs = [
        {"question": "How much do tickets cost?", "context": context},
        {"question": "Who designed the tower?", "context": EIFFEL},
    ]
    budget = {"max_batch_size": 32, "max_batch_tokens": 256, "max_seq_length": 32}
    spec = ModelSpec(name="s-small", task="question-answering", path=MINILM, qa_method="sentence", **budget)
    small = build_handler(spec)
    big = build_handler(
        ModelSpec(name="s-big", task="question-answering", path=MINILM, qa_method="sentence", **unbounded(budget))
    )
    items = small.tokenize(inputs)
    rows, longest = small.cost(items[0])
    assert rows > 1000 and longest == 32

    shapes = pass_shapes(monkeypatch, small, "run_model")
    split = small.forward(items)
    whole = big.forward(big.tokenize(inputs))

    assert_same_answers(split, whole)
    assert split[0]["answer"] == "Tickets cost 20 euros."
    assert split[1]["answer"] == sentence_of(EIFFEL, "It is named after")
    assert sum(n for n, _ in shapes) == rows + 1 + len(split_sentences(EIFFEL))  # every sequence once
    assert len(shapes) > 1000 // 32
    assert all(
        sequences <= 32 and sequences * length <= 256 for sequences, length in shapes
    )  # the long sentence, alone


def test_a_long_context_runs_its_windows_in_passes_within_the_budget(monkeypatch, tiny_qa):
    context = " ".join([LONG_CONTEXT, INVOICES, EIFFEL, LONG_CONTEXT, LONG_CONTEXT])
    inputs = [
        {"question": "Who signed the certificate?", "context": context},
        {"question": "When is payment due?", "context": INVOICES},
    ]
    # Less than one window of 128 tokens: each full window runs alone, short ones in twos or threes.
    budget = {"max_batch_size": 32, "max_batch_tokens": 100, "max_seq_length": 128}
    small = build_handler(
        ModelSpec(name="x-small", task="question-answering", path=str(tiny_qa), doc_stride=32, **budget)
    )
    big = build_handler(
        ModelSpec(name="x-big", task="question-answering", path=str(tiny_qa), doc_stride=32, **unbounded(budget))
    )
    items = small.tokenize(inputs)
    windows = sum(small.cost(item)[0] for item in items)
    assert small.cost(items[0])[0] > 10

    shapes = pass_shapes(monkeypatch, small, "model")
    split = small.forward(items)
    whole = big.forward(big.tokenize(inputs))

    assert_same_answers(split, whole)
    for output, item in zip(split, inputs, strict=True):
        assert_offsets_match(output, item["context"])
    assert sum(n for n, _ in shapes) == windows
    for sequences, length in shapes:
        assert sequences * length <= 100 or sequences == 1
    assert (1, 128) in shapes
