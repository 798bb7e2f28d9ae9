"""Process and host readings through psutil."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil


@dataclass(slots=True)
class ProcessReading:
    resident_memory_bytes: float
    cpu_seconds_total: float


class ProcessSource:
    """This process's RSS and CPU time; ``process`` may be injected (a fake psutil.Process)."""

    def __init__(self, process: Any | None = None) -> None:
        if process is None:
            process = psutil.Process()
        self._process = process

    def read(self) -> ProcessReading:
        with self._process.oneshot():
            mem = self._process.memory_info()
            cpu = self._process.cpu_times()
        return ProcessReading(float(mem.rss), float(cpu.user + cpu.system))
