"""FSDP2 (``fully_shard``), HSDP and their mixes with tensor parallel: source and collectives."""
