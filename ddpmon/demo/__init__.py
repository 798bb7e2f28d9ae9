"""The demo: ``ddpmon demo``'s training rank, its faults and checkpoints (torch is imported by
the modules, not here, so the CLI can read the constants below without it)."""

AUTOCAST_DTYPES = ("none", "float16", "bfloat16")
"""``--autocast`` choices: the demo's compute dtype under torch.autocast (none: fp32)."""

OPTIONAL_STATES = ("optimizer", "scaler", "rng")
"""``--resume-without`` choices: checkpoint state a resume may leave out."""
