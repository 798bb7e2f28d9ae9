"""Pipeline parallel (``torch.distributed.pipelining``): set-up, stage probes, origin, source."""
