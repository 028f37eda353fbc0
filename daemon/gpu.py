"""GPU memory as NVML sees it, per process. Without an NVIDIA driver (or
without nvidia-ml-py) every call answers "nothing", so the daemon runs the
same on CPU-only machines."""

from __future__ import annotations

import asyncio
import os
import time


class Nvml:
    def __init__(self) -> None:
        self.available = False
        self._handles = []
        if not os.path.exists("/dev/nvidiactl"):
            return  # no NVIDIA driver: skip importing pynvml (3 MiB the daemon would carry while asleep)
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = bool(self._handles)
        except Exception:  # noqa: BLE001 - no library, no driver, no device: all mean "no NVML"
            self._handles = []

    def total_memory(self) -> list[int]:
        """Each GPU's total memory in bytes (empty without NVML)."""
        totals = []
        for handle in self._handles:
            try:
                totals.append(int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total))
            except Exception:  # noqa: BLE001
                continue
        return totals

    def used_by(self, pid: int) -> dict[int, int]:
        """GPU index -> bytes that process `pid` holds (only GPUs where it holds some)."""
        out: dict[int, int] = {}
        for index, handle in enumerate(self._handles):
            try:
                procs = list(self._nvml.nvmlDeviceGetComputeRunningProcesses(handle))
                procs += list(self._nvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
            except Exception:  # noqa: BLE001
                continue
            used = sum((p.usedGpuMemory or 0) for p in procs if p.pid == pid)
            if any(p.pid == pid for p in procs):
                out[index] = used
        return out

    async def wait_released(self, pid: int, timeout: float = 10.0) -> tuple[bool, float]:
        """Poll until NVML lists no memory for `pid` (drivers report late).
        Returns (released, seconds waited)."""
        start = time.monotonic()
        while self.available and self.used_by(pid):
            if time.monotonic() - start > timeout:
                return False, time.monotonic() - start
            await asyncio.sleep(0.05)
        return True, time.monotonic() - start
