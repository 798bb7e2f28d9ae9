"""Which steps take the local (pre-reduction) norm pass, shared by the DDP and FSDP2 sources.

Where a host read is not free (an accelerator, or ``DDPMON_SYNC_AUDIT``: ``host_reads``) it
runs every step: the pass costs microseconds there, and deciding to skip it would have to read
a device value. On CPU, where a pass over the gradients costs
milliseconds, it runs every ``local_norm_every`` steps; on the others a source examines its
local gradients only when the reduced ones (or a cheap host check) say something is
non-finite, so the NaN origin stays exact either way.
"""

from __future__ import annotations

import torch

from ..host_reads import host_read_free


class LocalNormSampler:
    """Counts the source's steps and says whether this one takes the local pass."""

    def __init__(self, every: int) -> None:
        self.every = max(1, int(every))
        self.steps = 0
        """Steps completed so far (the data check's schedule reads it too)."""

    def due(self, device: torch.device) -> bool:
        """Take the local pass on ``device`` for the step in progress?"""
        return not host_read_free(device) or self.steps % self.every == 0

    def step_done(self) -> None:
        self.steps += 1


__all__ = ["LocalNormSampler"]
