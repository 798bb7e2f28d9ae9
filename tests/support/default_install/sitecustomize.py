"""Makes a full test venv look like a default ``pip install ddpmon`` to the process it runs in.

On ``PYTHONPATH`` (inherited by torchrun and every rank), this module runs at start-up and marks
each top-level module named in ``DDPMON_TEST_UNINSTALLED`` (comma-separated) as absent:
``sys.modules[name] = None`` makes ``import name`` raise ``ModuleNotFoundError`` and
``importlib.util.find_spec(name)`` return None, exactly as when the package is not installed.
"""

import os
import sys

for _name in filter(None, os.environ.get("DDPMON_TEST_UNINSTALLED", "").split(",")):
    sys.modules.setdefault(_name, None)
