"""Where an online request's time went in the worker (inference/child/serving.py `_timing`): pure arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inference.child.runtime import Pass
from inference.child.serving import _timing

ENQUEUED, RECEIVED, DISPATCH = 100.000, 100.002, 100.006  # epoch seconds


def request() -> SimpleNamespace:
    return SimpleNamespace(received_at=RECEIVED, kwargs={"enqueued_at": ENQUEUED})


def test_a_text_in_the_dispatchs_third_pass_waited_for_two_passes_as_pass_wait_not_batch_wait():
    # A dispatch of mixed lengths cut into three passes of 20 ms: this request's text ran in the third.
    own = [Pass(DISPATCH + 0.040, DISPATCH + 0.060, 1)]
    timing = _timing(request(), own, group_size=3, dispatch_start=DISPATCH)
    assert timing["queue_wait_ms"] == pytest.approx(2.0, abs=0.01)
    assert timing["batch_wait_ms"] == pytest.approx(4.0, abs=0.01)  # in the buffer, until its dispatch ran
    assert timing["pass_wait_ms"] == pytest.approx(40.0, abs=0.01)  # behind its dispatch's first two passes
    assert timing["inference_ms"] == pytest.approx(20.0, abs=0.01)
    # The stages add up to what the old batch_wait alone said: nothing is lost, only split.
    assert timing["batch_wait_ms"] + timing["pass_wait_ms"] == pytest.approx((own[0].start - RECEIVED) * 1000)


def test_a_request_in_the_first_pass_has_no_pass_wait():
    own = [Pass(DISPATCH, DISPATCH + 0.020, 4), Pass(DISPATCH + 0.020, DISPATCH + 0.045, 2)]
    timing = _timing(request(), own, group_size=2, dispatch_start=DISPATCH)
    assert timing["pass_wait_ms"] == 0.0
    assert timing["inference_ms"] == pytest.approx(45.0, abs=0.01) and timing["batch_size"] == 4
