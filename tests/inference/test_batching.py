"""plan_batches: how a dispatched batch is cut into forward passes."""

from inference.core.planning import plan_batches


def flatten(passes):
    return sorted(i for p in passes for i in p)


def test_every_text_is_planned_exactly_once():
    lengths = [5, 90, 12, 7, 64, 3, 33, 33, 120, 1]
    assert flatten(plan_batches(lengths, max_batch_size=4, max_batch_tokens=256)) == list(range(len(lengths)))


def test_passes_group_similar_lengths_and_respect_the_padded_token_budget():
    lengths = [100, 4, 98, 5, 101, 6]
    passes = plan_batches(lengths, max_batch_size=8, max_batch_tokens=320)
    assert [sorted(lengths[i] for i in p) for p in passes] == [[4, 5, 6], [98, 100, 101]]
    for p in passes:
        assert len(p) * max(lengths[i] for i in p) <= 320


def test_batch_size_cap():
    passes = plan_batches([10] * 10, max_batch_size=4, max_batch_tokens=10_000)
    assert [len(p) for p in passes] == [4, 4, 2]


def test_a_text_longer_than_the_budget_still_runs_alone():
    passes = plan_batches([3, 500, 4], max_batch_size=8, max_batch_tokens=256)
    assert [1] in passes
    assert flatten(passes) == [0, 1, 2]


def test_empty_input_plans_nothing():
    assert plan_batches([], max_batch_size=4, max_batch_tokens=100) == []


def test_an_item_of_several_windows_counts_each_window_against_the_pass_limits():
    # Three texts of 100 tokens and one question over a long context: 4 windows of 100 tokens.
    passes = plan_batches([100, 100, 100, 100], max_batch_size=4, max_batch_tokens=10_000, rows=[1, 1, 1, 4])
    assert sorted(map(sorted, passes)) == [[0, 1, 2], [3]]
    # Too many windows for any pass: the item runs alone rather than never.
    assert plan_batches([50, 50], max_batch_size=4, max_batch_tokens=100, rows=[1, 9]) == [[0], [1]]
