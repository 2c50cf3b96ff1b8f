"""Running a benchmark command against the test stack, as its user would from a shell."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def run_benchmark(module: str, stack, redis_url: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` pointed at the test stack, its Redis, and `out` for its report."""
    return subprocess.run(
        [sys.executable, "-m", module, "--url", stack.url, "--redis-url", redis_url, "--out", str(out), *args],
        cwd=ROOT,
        env={**stack.env, "API_TOKEN": stack.token},
        capture_output=True,
        text=True,
        timeout=600,
    )
