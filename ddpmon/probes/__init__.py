"""Device-side probes: they produce small tensors and never read them back on the hot path."""
