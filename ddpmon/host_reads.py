"""One decision: is reading a tensor's value on the host free on its device?

On the CPU a tensor *is* host memory, so the agent may read a value there to skip work (a
non-finite check before a rare pass, a failure flag, the step vector queued as it is). On an
accelerator the same read would stall the host until the device catches up, so the agent takes
other branches there: compute on the device, read back lazily. Every such branch asks
``host_read_free`` and nothing else, so the branches cannot drift apart.

``DDPMON_SYNC_AUDIT=1`` answers "no" on the CPU too: the agent then runs, on CPU tensors, the
code it runs on a GPU, which is what the sync audit (docs/sync-audit.md) must see. The numbers
are the same either way; only the host cost differs (the CPU shortcuts are skipped). Read once
per process, at import: the variable is a test and check switch, not a runtime option.
"""

from __future__ import annotations

import os

import torch

SYNC_AUDIT_ENV = "DDPMON_SYNC_AUDIT"



def _from_env() -> bool:
    return os.environ.get(SYNC_AUDIT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


_AUDIT = _from_env()


def reread_env() -> bool:
    """Read ``DDPMON_SYNC_AUDIT`` again (a process forked after ddpmon was imported, as the
    test suite's zygote forks its ranks, gets its environment only then); returns the value."""
    global _AUDIT
    _AUDIT = _from_env()
    return _AUDIT


def sync_audit() -> bool:
    """True when ``DDPMON_SYNC_AUDIT`` makes the CPU take the accelerator's branches."""
    return _AUDIT


def host_read_free(device: torch.device) -> bool:
    """Reading a value of a tensor on ``device`` costs no device sync (CPU, outside an audit)."""
    return device.type == "cpu" and not _AUDIT


def host_read_free_all(tensors) -> bool:
    """``host_read_free`` for every tensor (``None`` entries ignored)."""
    return not _AUDIT and all(t is None or t.is_cpu for t in tensors)


__all__ = ["SYNC_AUDIT_ENV", "host_read_free", "host_read_free_all", "reread_env", "sync_audit"]
