"""Gradient sources per parallelism strategy (plain, DDP, FSDP2/HSDP, tensor parallel)."""
