"""ddpmon's version, in a leaf module: the run identity and the daemon report it without
importing the package root (which sits above them)."""

__version__ = "0.2.0"
