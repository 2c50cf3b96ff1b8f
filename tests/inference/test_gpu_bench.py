"""benchmarks/gpu.sh, as far as a host without a GPU can check it: it parses, its dry run prints the
whole plan without running anything, and the sweep options it passes exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.sh"
OUT = ROOT / "benchmarks" / "out" / "gpu"


def _bash(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path or os.environ["PATH"]}
    return subprocess.run(["bash", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _path_without_nvidia_smi(tmp_path: Path) -> str:
    """PATH with only the tools the dry run needs, so it behaves as on this GPU-less host wherever it runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "grep", "sed", "dirname", "cat"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_the_script_parses():
    assert _bash("-n", str(SCRIPT)).returncode == 0


def test_the_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    before = sorted(OUT.rglob("*")) if OUT.exists() else None
    done = _bash(
        str(SCRIPT), "--dry-run", "--seconds", "5", "--dtype", "float16", path=_path_without_nvidia_smi(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    assert "no nvidia-smi here; a real run stops at this point" in plan
    assert "online worker children: 1" in plan
    # torch for CUDA when the installed one is a CPU build, from the pin in requirements.txt
    assert "+ env PIP_CONFIG_FILE=/dev/null .venv/bin/python -m pip install torch==2.13.0 --index-url " in plan
    assert "+ nvidia-smi\n    > benchmarks/out/gpu/nvidia-smi.txt" in plan
    assert "+ nvidia-smi -q\n    > benchmarks/out/gpu/nvidia-smi-q.txt" in plan
    assert "nvidia-smi --query-gpu=" in plan and "benchmarks/out/gpu/nvidia-smi-during.csv" in plan
    assert "float16 benchmarks/out/gpu/models.yaml" in plan
    assert "+ export INFERENCE_DEVICE=cuda ONLINE_CONCURRENCY=1 ONLINE_BATCH_WAIT_MS=2" in plan
    assert "scripts/run.py" in plan
    sweep = re.search(r"^\+ \S+ -m benchmarks\.sweep (.*)$", plan, re.M)
    assert sweep, plan
    assert "--seconds 5" in sweep.group(1) and "--out benchmarks/out/gpu" in sweep.group(1)
    assert plan.rstrip().endswith("(dry run: nothing was run)")
    assert (sorted(OUT.rglob("*")) if OUT.exists() else None) == before  # nothing written

    # Every option the plan passes to the sweep is one the sweep takes.
    help_text = subprocess.run(
        [sys.executable, "-m", "benchmarks.sweep", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout
    for option in re.findall(r"(--[a-z-]+)", sweep.group(1)):
        assert option in help_text, option


def test_bad_options_are_refused():
    assert _bash(str(SCRIPT), "--dry-run", "--dtype", "int8").returncode == 2
    assert _bash(str(SCRIPT), "--frobnicate").returncode == 2
