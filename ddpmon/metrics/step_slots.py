"""The per-step device vector's slots: the ``Slot`` declaration and the names of the common
slots (``agent.stepvector.STEP_SLOTS``).

Writers (the step pipeline, a source's extra slots) and readers (records, a source's record
finishing) name slots through these constants, never a string of their own. A leaf module, so
the strategies can declare their own slots (``GradientSource.extra_slots``) without importing
the agent.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Slot:
    name: str
    width: int | None
    """Fixed width, or None for a variable-length vector (its width is recorded per step)."""
    doc: str


REDUCED_NORMS = "reduced_norms"
LOCAL_NORMS = "local_norms"
LOSS = "loss"
GRAD_SCALE = "grad_scale"
LOSS_SCALE = "loss_scale"
FOUND_INF = "found_inf"
IDENTICAL_RANKS = "identical_ranks"
TRAINER_NORM = "trainer_norm"
UPDATE_SQUARES = "update_squares"
LOGIT_MAX = "logit_max"
ENTRY_BLOCKS = "entry_blocks"
