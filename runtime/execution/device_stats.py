"""What a worker can say about its device: NVML on CUDA, process CPU time everywhere."""
from __future__ import annotations

import os
import time


class DeviceStats:
    def __init__(self, device: str):
        self.device = device
        self._nvml = None
        if device.startswith("cuda"):
            self._nvml = _open_nvml(int(device.split(":")[1]) if ":" in device else 0)

    def snapshot(self) -> dict:
        times = os.times()
        stats = {"cpu_seconds": times.user + times.system, "wall": time.time()}
        if self._nvml is not None:
            stats.update(self._nvml())
        return stats


def _open_nvml(index: int):
    try:
        import pynvml  # from nvidia-ml-py, installed only on CUDA machines
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no NVML: CPU-side figures only
        return None

    def read() -> dict:
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {"gpu_utilisation": util.gpu / 100.0, "memory_used_bytes": mem.used,
                "memory_total_bytes": mem.total}
    return read
