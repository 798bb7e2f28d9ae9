"""A cheap rank for daemon tests: prints, optionally ignores SIGTERM, sleeps, exits with a code.

Usage (under torchrun): sleeper.py SECONDS [EXIT_CODE] [--ignore-term]
"""

import os
import signal
import sys
import time

if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
print(f"rank {os.environ.get('RANK')} pid {os.getpid()} up", flush=True)
time.sleep(float(args[0]) if args else 1.0)
sys.exit(int(args[1]) if len(args) > 1 else 0)
