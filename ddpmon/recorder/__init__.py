"""What runs inside training and writes a run dir: the event log and progress file,
evidence bundles, crash capture and the live step, the stall watchdog, the numerics history
writer (with the format it reads back on resume), the manifest and annotations, the clock
offset and RNG fingerprints. The readers that run after training live in ``forensics/``."""
