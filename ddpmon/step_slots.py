"""The names of the per-step device vector's slots (``agent.stepvector.STEP_SLOTS``).

Writers (the step pipeline, a source's extra slots) and readers (records, a source's record
finishing) name slots through these constants, never a string of their own. A leaf module, so
the strategies can name their slots without importing the agent.
"""

REDUCED_NORMS = "reduced_norms"
LOCAL_NORMS = "local_norms"
LOSS = "loss"
GRAD_SCALE = "grad_scale"
LOSS_SCALE = "loss_scale"
FOUND_INF = "found_inf"
IDENTICAL_RANKS = "identical_ranks"
TRAINER_NORM = "trainer_norm"
PP_NORM = "pp_norm"
PP_FLAGS = "pp_flags"
