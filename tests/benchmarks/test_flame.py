"""The py-spy summary counts a function once per stack, however deep it recurses."""

from benchmarks.flame import inclusive_shares


def test_inclusive_shares_count_each_function_once_per_stack():
    lines = [
        "main (app.py:1);handle (app.py:5);handle (app.py:5);parse (json.py:9) 3\n",
        "main (app.py:1);wait (loop.py:2) 1\n",
        "garbage line\n",
    ]
    total, shares = inclusive_shares(lines)
    assert total == 4
    assert shares["main (app.py)"] == 4
    assert shares["handle (app.py)"] == 3  # recursion is not double-counted
    assert shares["parse (json.py)"] == 3 and shares["wait (loop.py)"] == 1
