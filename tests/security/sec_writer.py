"""An entry point's script, written as real scripts are (argparse): one positional name, and an
``-o/--out`` option that writes a file wherever it points. The gateway's declaration allows the
positional only, so ``-o`` must never reach it from a request."""

import argparse
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("name")
parser.add_argument("-o", "--out", default=None)
args = parser.parse_args()
if args.out:
    Path(args.out).write_text(f"written by {args.name}\n")
print(f"hello {args.name}", flush=True)
