"""Who this process is in its job: rank, world, node and versions (``identity``), and what
Slurm tells a task about itself (``slurm``)."""
