"""What `make run` prints and links (issue 24): every URL from the ports it chose, Jobs and Dashboard
listed, and the banner printed once the start-up logs go quiet, so it is the last thing on screen."""

from __future__ import annotations

from scripts.run import BANNER_MAX_WAIT_S, BANNER_QUIET_S, banner, banner_due

CREDS = {"first_time": "", "token": "t" * 40, "password": "p", "flower": "admin:x"}


def test_the_banner_lists_the_pages_at_the_chosen_ports():
    text = banner("http://127.0.0.1:8003", "http://127.0.0.1:5557/", CREDS)
    for line in ("Jobs       http://127.0.0.1:8003/jobs/", "Dashboard  http://127.0.0.1:8003/dashboard/"):
        assert line in text
    assert "Flower     http://127.0.0.1:5557/" in text and "5555" not in text and ":8000" not in text


def test_the_banner_waits_for_ready_and_for_the_logs_to_go_quiet():
    assert not banner_due(now=100.0, ready_at=None, last_output_at=0.0), "not before the platform is ready"
    assert not banner_due(now=100.0, ready_at=99.0, last_output_at=99.5), "logs still coming"
    quiet = 100.0 + BANNER_QUIET_S
    assert not banner_due(quiet, 99.0, 100.0, roles_ready={b"online"}), "the offline worker is still loading"
    assert banner_due(quiet, ready_at=99.0, last_output_at=100.0, roles_ready={b"online", b"offline"})
    # Logs that never stop (a chatty worker), or a worker that never comes, do not hold it back for ever.
    assert banner_due(99.0 + BANNER_MAX_WAIT_S, 99.0, 99.0 + BANNER_MAX_WAIT_S, roles_ready=set())


def test_a_child_ready_line_is_recognised():
    from scripts.run import CHILD_READY

    line = b"05:05:07 offline.1 | [..: INFO/ForkPoolWorker-1] worker child vm:6885 ready on offline with ['router']"
    assert CHILD_READY.search(line)[1] == b"offline"
