"""DeepSpeed (ZeRO 0-3): its gradient source, its engine's steps, its collectives and its rerun."""
