"""NVML readings through ``pynvml`` (package ``nvidia-ml-py``), imported lazily.

A machine without a driver is normal (CPU runs, CI): ``available`` is then False and the
collector reports ``ddpmon_collector_success{collector="nvml"} 0`` instead of failing.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ddpmon.nvml")


@dataclass(slots=True)
class GpuReading:
    index: int
    uuid: str
    name: str
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    utilization_ratio: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    ecc_uncorrected_total: float | None = None
    pci_bus_id: str | None = None


class NvmlSource:
    """Reads one, several or all GPUs. ``nvml`` may be injected (a fake module) for tests."""

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()
        self._initialised = False
        self.error: str | None = None

    def _ensure(self) -> Any | None:
        with self._lock:
            if self._initialised:
                return self._nvml
            if self.error is not None:
                return None
            try:
                if self._nvml is None:
                    import pynvml  # lazy: optional at run time

                    self._nvml = pynvml
                self._nvml.nvmlInit()
                self._initialised = True
                return self._nvml
            except Exception as exc:  # no driver, no library, no permission
                self.error = f"{type(exc).__name__}: {exc}"
                log.debug("NVML unavailable: %s", self.error)
                return None

    @property
    def available(self) -> bool:
        return self._ensure() is not None


    def read(self, indices: list[int] | None = None) -> list[GpuReading]:
        """Readings for ``indices`` (all GPUs when None). Raises if NVML is unavailable."""
        nvml = self._ensure()
        if nvml is None:
            raise RuntimeError(f"NVML unavailable: {self.error}")
        if indices is None:
            indices = list(range(int(nvml.nvmlDeviceGetCount())))
        return [self._read_one(nvml, i) for i in indices]

    @staticmethod
    def _read_one(nvml: Any, index: int) -> GpuReading:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        reading = GpuReading(
            index=index,
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            name=_text(nvml.nvmlDeviceGetName(handle)),
        )
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        reading.memory_used_bytes = float(mem.used)
        reading.memory_total_bytes = float(mem.total)
        for attr, fn in (
            ("utilization_ratio", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0),
            ("temperature_celsius", lambda: float(nvml.nvmlDeviceGetTemperature(handle, 0))),
            ("power_watts", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            ("pci_bus_id", lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId)),
            (
                "ecc_uncorrected_total",
                lambda: float(nvml.nvmlDeviceGetTotalEccErrors(handle, 1, 1)),
            ),
        ):
            try:
                setattr(reading, attr, fn())
            except Exception:  # unsupported on this board: leave the field empty
                pass
        return reading

    def driver_version(self) -> str | None:
        nvml = self._ensure()
        if nvml is None:
            return None
        try:
            return _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:
            return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
