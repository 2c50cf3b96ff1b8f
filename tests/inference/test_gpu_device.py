"""Which device a worker child loads on: the pure choice, the pool index billiard gives each child, and
what a CPU host answers when a model asks for CUDA."""

from __future__ import annotations

import billiard
import pytest
import torch

from inference.core import gpu
from inference.core.gpu import DeviceError, pick_device


@pytest.mark.parametrize(
    ("device", "index", "visible", "expected"),
    [
        ("cuda", 0, 4, "cuda:0"),
        ("cuda", 3, 4, "cuda:3"),
        ("cuda", 5, 4, "cuda:1"),  # more children than GPUs: they wrap around
        ("cuda", 1, 1, "cuda:0"),  # two children share the only GPU
        ("cuda", None, 2, "cuda:0"),  # outside a pool (the naive server, the ceiling)
        ("cuda:1", 0, 2, "cuda:1"),  # an explicit index is kept, whatever the child
        ("cuda:1", 7, 2, "cuda:1"),
        ("cpu", 3, 0, "cpu"),
        ("cpu", 3, 8, "cpu"),
    ],
)
def test_each_child_takes_its_gpu_from_its_pool_index(device, index, visible, expected):
    assert pick_device(device, index, visible) == expected


def test_a_device_the_host_does_not_have_is_refused_with_what_it_has():
    with pytest.raises(DeviceError, match="no CUDA GPU is visible"):
        pick_device("cuda", 0, 0)
    with pytest.raises(DeviceError, match=r"sees 2 GPU\(s\), cuda:0 to cuda:1"):
        pick_device("cuda:2", 0, 2)
    with pytest.raises(DeviceError, match="sees 2 GPU"):
        pick_device("cuda:x", 0, 2)


def _report_index(queue) -> None:
    queue.put(gpu.child_index())


def _noop(_: int) -> None:
    return None


def test_billiard_pool_children_know_their_index():
    """The mechanism Celery's prefork pool uses (billiard.Pool), for real: children 0 and 1 of a
    two-process pool read indices 0 and 1; this process, outside any pool, reads None."""
    queue = billiard.get_context("fork").SimpleQueue()
    pool = billiard.Pool(2, initializer=_report_index, initargs=(queue,))
    try:
        pool.map(_noop, range(4))
        indices = sorted(queue.get() for _ in range(2))
    finally:
        pool.terminate()
        pool.join()
    assert indices == [0, 1]
    assert gpu.child_index() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA GPU")
def test_cuda_on_a_cpu_host_is_refused_at_load_with_the_reason():
    with pytest.raises(DeviceError) as refused:
        gpu.resolve_device("cuda")
    if torch.version.cuda is None:
        assert "is a CPU build: install the CUDA build (docs/operations.md, 'GPU hosts')" in str(refused.value)
    else:
        assert "sees no GPU" in str(refused.value)
    assert gpu.resolve_device("cpu") == "cpu"


def test_the_loaded_device_is_what_the_heartbeat_reports():
    from inference.core.workers import WorkerState

    try:
        gpu.set_loaded(["cuda:1", "cpu", "cuda:1"])
        assert gpu.loaded_device() == "cpu, cuda:1"
        assert WorkerState(queue="online", models=["router"]).device == "cpu, cuda:1"
        gpu.set_loaded([])
        assert WorkerState(queue="online", models=["identity"]).device == "cpu"
    finally:
        gpu.set_loaded([])
