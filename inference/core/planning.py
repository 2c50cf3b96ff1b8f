"""Pure batch arithmetic shared by the dispatcher, the children and the offline runner: cutting inputs
into forward passes of similar length, and grouping requests by model. No Celery, no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def plan_batches(
    lengths: list[int],
    max_batch_size: int,
    max_batch_tokens: int,
    max_padding_fraction: float = 1.0,
    rows: list[int] | None = None,
) -> list[list[int]]:
    """Indices grouped into passes: sorted by length, each pass within size, token and padding limits.

    An item is `rows[i]` sequences (1 when `rows` is None) of up to `lengths[i]` tokens: a text is one
    sequence, a question over a long context several overlapping windows that must run in one pass.
    A pass of n sequences padded to its longest sequence of L tokens costs n * L. A pass closes when
    the next item would take it past `max_batch_size` sequences, or `max_batch_tokens` padded tokens,
    or make more than `max_padding_fraction` of the pass padding. An item larger than the whole budget
    runs alone.
    """
    weights = rows or [1] * len(lengths)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    passes: list[list[int]] = []
    current: list[int] = []
    current_rows = 0
    real_tokens = 0
    for index in order:
        length, count = lengths[index], weights[index]
        # Sorted ascending, so the newcomer is the longest: the pass would cost its rows * its length.
        padded = (current_rows + count) * length
        if current and (
            current_rows + count > max_batch_size
            or padded > max_batch_tokens
            or padded - (real_tokens + count * length) > max_padding_fraction * padded
        ):
            passes.append(current)
            current, current_rows, real_tokens = [], 0, 0
        current.append(index)
        current_rows += count
        # A multi-window item's windows are all full but its last: counted as full, a slight overestimate.
        real_tokens += count * length
    if current:
        passes.append(current)
    return passes


def group_by(items: Iterable[Any], key: Callable[[Any], str]) -> dict[str, list[Any]]:
    groups: dict[str, list[Any]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups
