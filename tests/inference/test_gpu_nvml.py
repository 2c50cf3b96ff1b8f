"""GPU figures in the heartbeat: NVML's arithmetic on a fake handle, and the visible reason when there is
no GPU (for real on a CPU host: pynvml.nvmlInit raises), down to the diagnosis and the dashboard's data."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pynvml
import pytest

from inference.core import gpu
from inference.core.workers import WorkerState
from inference.web.diagnosis import gpu_status
from observability.diagnosis import Snapshot, diagnose, not_evaluated, report


def _nvml_answers() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


NO_NVML = pytest.mark.skipif(_nvml_answers(), reason="NVML answers on this host (it has an NVIDIA driver)")


class FakeNvml:
    """The two pynvml calls read_handle makes, answering for one handle (pure-function test double)."""

    def __init__(self, util_pct=None, used=None, total=None) -> None:
        self.util_pct, self.used, self.total = util_pct, used, total

    def nvmlDeviceGetUtilizationRates(self, handle):  # noqa: N802 (pynvml's names)
        assert handle == "h0"
        if self.util_pct is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=self.util_pct, memory=5)

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        assert handle == "h0"
        return SimpleNamespace(used=self.used, total=self.total, free=self.total - self.used)


def test_a_reading_is_percent_and_megabytes_of_the_device():
    reading = gpu.read_handle(FakeNvml(util_pct=37, used=3 * 2**30 + 2**19, total=141 * 2**30), "h0")
    assert reading == {"gpu_util_pct": 37.0, "gpu_mem_mb": 3072.5, "gpu_mem_total_mb": 144384.0}


def test_a_reading_the_device_does_not_support_stays_none_and_the_rest_is_read():
    """A MIG slice answers memory but not utilisation (NVML_ERROR_NOT_SUPPORTED)."""
    reading = gpu.read_handle(FakeNvml(util_pct=None, used=2**30, total=10 * 2**30), "h0")
    assert reading == {"gpu_util_pct": None, "gpu_mem_mb": 1024.0, "gpu_mem_total_mb": 10240.0}


def test_torch_uuids_become_nvml_names():
    assert gpu.nvml_uuids("58a2e1c9-7f0b-4a3e-9b1d-000000000001") == [
        b"GPU-58a2e1c9-7f0b-4a3e-9b1d-000000000001",
        b"MIG-58a2e1c9-7f0b-4a3e-9b1d-000000000001",
    ]
    assert gpu.nvml_uuids("GPU-abc") == [b"GPU-abc"]


def test_nvml_errors_become_reasons_in_words():
    assert gpu.unavailable_reason(pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)) == (
        "no NVIDIA driver: NVML library not found"
    )
    assert gpu.unavailable_reason(pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)) == "no NVIDIA driver loaded"
    assert gpu.unavailable_reason(ImportError("No module named 'pynvml'")) == "nvidia-ml-py is not installed"
    assert gpu.unavailable_reason(pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)).startswith("NVML error: ")


@NO_NVML
def test_without_a_driver_nvml_says_why_for_real():
    """No mock: on this host pynvml.nvmlInit() raises (no libnvidia-ml.so.1), and that reason is shown."""
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()
    assert gpu.nvml_status() == "no NVIDIA driver: NVML library not found"
    fields = gpu.heartbeat_fields("cuda:0")
    assert fields == {
        "gpu": "none (no NVIDIA driver: NVML library not found)",
        "gpu_util_pct": None,
        "gpu_mem_mb": None,
        "gpu_mem_total_mb": None,
    }


def test_a_cpu_child_says_cpu_device_in_its_heartbeat():
    """The JSON a child publishes (WorkerState.as_json, the real one): device and gpu say why no GPU figures."""
    gpu.set_loaded(["cpu"])
    try:
        beat = json.loads(WorkerState(queue="online", models=["router"]).as_json())
    finally:
        gpu.set_loaded([])
    assert beat["device"] == "cpu"
    assert beat["gpu"] == "cpu device"
    assert beat["gpu_util_pct"] is None and beat["gpu_mem_mb"] is None and beat["gpu_mem_total_mb"] is None
    assert beat["cpu_pct"] >= 0 and beat["rss_mb"] > 0


@NO_NVML
def test_a_cuda_child_without_nvml_says_so_in_its_heartbeat():
    gpu.set_loaded(["cuda:1"])
    try:
        beat = json.loads(WorkerState(queue="online", models=["router"]).as_json())
    finally:
        gpu.set_loaded([])
    assert beat["device"] == "cuda:1"
    assert beat["gpu"] == "none (no NVIDIA driver: NVML library not found)"


def _figures(**changes) -> Snapshot:
    base = dict(
        window_s=60, requests_per_s=40, ok_per_s=40, p50_s=0.05, p99_s=0.09, mean_batch_size=2.0,
        online_backlog=[1.0] * 60, online_workers_now=2, online_workers_min=2, busy_fraction=0.7, worker_cpu_pct=97,
    )  # fmt: skip
    base.update(changes)
    return Snapshot(**base)


def test_the_diagnosis_says_the_gpu_rule_was_not_evaluated_and_why():
    workers = [{"gpu": "cpu device"}, {"gpu": "cpu device"}, {"gpu": "none (no NVIDIA driver loaded)"}]
    status = gpu_status(workers)
    assert status == "2 online child(ren): cpu device; 1 online child(ren): none (no NVIDIA driver loaded)"
    figures = _figures(gpu_status=status)
    assert diagnose(figures) == []  # not a jam ...
    assert [u.rule for u in not_evaluated(figures)] == ["cpu_bound_gpu_idle"]  # ... and not silently passed
    text = report(figures)
    assert text.startswith("no jam: ")
    assert text.splitlines()[-1] == (
        "not evaluated: CPU saturated while the accelerator idles [cpu_bound_gpu_idle]: no GPU figures: " + status
    )
    assert gpu_status([]) == "no online child alive"
    assert "a worker from before GPU reporting" in gpu_status([{}])


def test_with_gpu_figures_the_rule_is_evaluated():
    assert not_evaluated(_figures(gpu_util_pct=12.0)) == []
    assert [f.rule for f in diagnose(_figures(gpu_util_pct=12.0))] == ["cpu_bound_gpu_idle"]
    assert "not evaluated" not in report(_figures(gpu_util_pct=12.0))
    assert diagnose(_figures(gpu_util_pct=80.0)) == []


@pytest.mark.integration
def test_a_live_cpu_worker_reports_its_device_and_no_gpu(stack):
    """The stack's real worker children on this CPU host: device cpu, gpu "cpu device", and the
    diagnosis read from the live Redis says the GPU rule was not evaluated, with that reason."""
    from observability.diagnosis import snapshot
    from tests.conftest import wait_until

    wait_until(lambda: stack.online_children(), 30, "an online child")
    for child in stack.online_children() + stack.children("offline"):
        assert child["device"] == "cpu", child
        assert child["gpu"] == "cpu device", child
        assert child["gpu_util_pct"] is None
    text = report(snapshot(stack.redis, window_s=6))
    assert "not evaluated: CPU saturated while the accelerator idles [cpu_bound_gpu_idle]" in text, text
    assert "online child(ren): cpu device" in text, text
