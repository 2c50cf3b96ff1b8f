"""Which device a worker child runs on, and what its GPU is doing, for the heartbeat.

A child's device comes from its model's `device` (default INFERENCE_DEVICE): "cuda" with no index
spreads a prefork pool over the visible GPUs, child i on cuda:(i mod N), so `-c N` on an N-GPU host
gives each child its own GPU; "cuda:1" is kept as given. GPU figures come from NVML (the
`nvidia-ml-py` package, `import pynvml`) and say why they are missing when they are: a CPU host
reports `gpu: "none (no NVIDIA driver ...)"` or `"cpu device"`, never a silent blank.

Light on import (no torch, no pynvml until called): inference/core/workers.py imports it, and the web
process imports that.
"""

from __future__ import annotations

import os
from typing import Any

CPU_DEVICE = "cpu device"
# The GPU fields every heartbeat carries; None where there is no reading.
EMPTY_READING: dict[str, float | None] = {"gpu_util_pct": None, "gpu_mem_mb": None, "gpu_mem_total_mb": None}


class DeviceError(RuntimeError):
    """A model names a device this process cannot use."""


def child_index() -> int | None:
    """This process's slot in a prefork pool (0 to c-1), or None outside one.

    billiard's Pool sets `index` on each worker process object before forking it
    (`Pool._create_worker_process`), and a child that dies is replaced at the index it freed
    (`Pool._avail_index`), so the replacement lands on the same GPU. Celery's `%i` node-name format
    reads the same attribute (`celery.utils.log.current_process_index`).
    """
    try:
        from billiard.process import current_process
    except ImportError:
        return None
    index = getattr(current_process(), "index", None)
    return index if isinstance(index, int) else None


def pick_device(device: str, index: int | None, visible_gpus: int) -> str:
    """The device a child loads its model on.

    "cuda" (no index) with N visible GPUs: child i gets cuda:(i mod N); a process outside a pool
    (index None: the naive server, the ceiling) gets cuda:0. "cuda:k" is kept, and checked against
    the GPUs visible. Anything else ("cpu", "mps") is kept as given.
    """
    if device != "cuda" and not device.startswith("cuda:"):
        return device
    if visible_gpus <= 0:
        raise DeviceError(f"device {device!r}: no CUDA GPU is visible to this process")
    if device == "cuda":
        return f"cuda:{(index or 0) % visible_gpus}"
    ordinal = device.removeprefix("cuda:")
    if not ordinal.isdigit() or int(ordinal) >= visible_gpus:
        raise DeviceError(
            f"device {device!r}: this process sees {visible_gpus} GPU(s), cuda:0 to cuda:{visible_gpus - 1}"
        )
    return device


def resolve_device(device: str) -> str:
    """`pick_device` for this process: its pool index and torch's count of visible GPUs.

    Imports torch only for a CUDA device; called in worker children (and the benchmark processes),
    never in a worker's parent, whose CUDA context would not survive fork.
    """
    if device != "cuda" and not device.startswith("cuda:"):
        return device
    import torch

    visible = torch.cuda.device_count()
    if visible == 0:
        if torch.version.cuda is None:
            why = f"this torch ({torch.__version__}) is a CPU build: install the CUDA build (docs/operations.md, 'GPU hosts')"
        else:
            why = "torch is a CUDA build but sees no GPU: check the NVIDIA driver and CUDA_VISIBLE_DEVICES"
        raise DeviceError(f"device {device!r}: {why}")
    return pick_device(device, child_index(), visible)


# The devices this process's models are loaded on (runtime.load sets it); the heartbeat reports them.
_loaded: list[str] = []


def set_loaded(devices: list[str]) -> None:
    _loaded[:] = sorted(set(devices))


def loaded_device() -> str:
    """Where this child's models run: "cpu", "cuda:1", or "cpu, cuda:0" for a mix ("cpu" before any load:
    the identity model runs no weights, on the CPU)."""
    return ", ".join(_loaded) or "cpu"


def unavailable_reason(error: BaseException) -> str:
    """Why NVML gave no figures, in words a dashboard can show."""
    if isinstance(error, ImportError):
        return "nvidia-ml-py is not installed"
    name = type(error).__name__
    if name == "NVMLError_LibraryNotFound":
        return "no NVIDIA driver: NVML library not found"
    if name == "NVMLError_DriverNotLoaded":
        return "no NVIDIA driver loaded"
    if name == "NVMLError_NoPermission":
        return "no permission to query NVML"
    return f"NVML error: {error}"


def read_handle(nvml: Any, handle: Any) -> dict[str, float | None]:
    """One device's figures: utilisation (percent of the last sample period in which a kernel ran,
    device-wide: every process on that GPU counts) and memory used and total in MB (device-wide too).

    A reading the device does not support (utilisation on a MIG slice) stays None; the rest are read.
    """
    reading = dict(EMPTY_READING)
    try:
        reading["gpu_util_pct"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # NVMLError_NotSupported on MIG slices, or a transient error: leave it None
        pass
    try:
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        reading["gpu_mem_mb"] = round(memory.used / 2**20, 1)
        reading["gpu_mem_total_mb"] = round(memory.total / 2**20, 1)
    except Exception:
        pass
    return reading


def nvml_uuids(torch_uuid: str) -> list[bytes]:
    """NVML's names for the device torch calls `torch_uuid`: a whole GPU ("GPU-...") or a MIG slice ("MIG-...").

    Matching by UUID, not by index: torch's cuda:k is the k-th GPU after CUDA_VISIBLE_DEVICES and
    CUDA_DEVICE_ORDER (fastest first by default), NVML's index is the PCI order of all GPUs.
    """
    text = str(torch_uuid)
    if text.startswith(("GPU-", "MIG-")):
        return [text.encode()]
    return [f"GPU-{text}".encode(), f"MIG-{text}".encode()]


class _Nvml:
    """pynvml initialised once per process (lazily, in the child that reads it), or why it cannot be."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.module: Any = None
        self.reason = ""
        self.handles: dict[str, tuple[Any, str]] = {}  # device -> (handle, device name)

    def get(self) -> tuple[Any, str]:
        if self.pid != os.getpid():  # never reuse a parent's session after fork
            self.pid, self.module, self.handles = os.getpid(), None, {}
            try:
                import pynvml

                pynvml.nvmlInit()
                self.module, self.reason = pynvml, ""
            except Exception as error:  # ImportError or any NVMLError: the reason is shown, not raised
                self.reason = unavailable_reason(error)
        return self.module, self.reason

    def handle(self, device: str) -> tuple[Any, str]:
        if device not in self.handles:
            import torch

            index = int(device.partition(":")[2] or 0)
            found, last_error = None, None
            for uuid in nvml_uuids(torch.cuda.get_device_properties(index).uuid):
                try:
                    found = self.module.nvmlDeviceGetHandleByUUID(uuid)
                    break
                except Exception as error:
                    last_error = error
            if found is None:
                raise DeviceError(f"NVML does not know {device}: {last_error}")
            name = self.module.nvmlDeviceGetName(found)
            self.handles[device] = (found, name.decode() if isinstance(name, bytes) else str(name))
        return self.handles[device]


_nvml = _Nvml()


def nvml_status() -> str:
    """Why NVML gives no figures in this process (the heartbeat's `gpu` field shows it), or "" when it answers."""
    return _nvml.get()[1]


def heartbeat_fields(device: str | None = None) -> dict[str, Any]:
    """`gpu` (what the figures are, or why there are none) and the figures, for this child's device.

    On a CPU device: `"cpu device"`. On a CUDA device without NVML: `"none (<why>)"`. Otherwise
    `"cuda:0 NVIDIA H200"` with utilisation and memory, read now (a few NVML calls, well under a ms).
    """
    device = device or loaded_device()
    cuda = next((d for d in (part.strip() for part in device.split(",")) if d.startswith("cuda")), None)
    if cuda is None:
        return {"gpu": CPU_DEVICE, **EMPTY_READING}
    module, reason = _nvml.get()
    if module is None:
        return {"gpu": f"none ({reason})", **EMPTY_READING}
    try:
        handle, name = _nvml.handle(cuda)
    except Exception as error:
        return {"gpu": f"none ({error})", **EMPTY_READING}
    return {"gpu": f"{cuda} {name}", **read_handle(module, handle)}
