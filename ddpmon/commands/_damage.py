"""One way every reader command names damaged files: one line each on stderr, so ``--json`` on
stdout stays one document (it carries the same lines under ``warnings``)."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from ddpmon.terminal import clean_line


def print_damage(command: str, lines: Iterable[str]) -> None:
    for line in lines:  # names and problems come from the run dir: never raw control codes
        print(f"ddpmon {command}: warning: {clean_line(line)}", file=sys.stderr)
