"""DeepSpeed's two CPU ops for the tests, built at install (the Makefile's OPS_STAMP).

    python scripts/deepspeed_ops.py pins OUT   # what the build imports, as pip constraints
    python scripts/deepspeed_ops.py build      # the shared-memory comm op and CPU Adam

``make test`` builds the ops while pip installs the frameworks into the same venv. ``pins``
writes ``name==version`` for every distribution the build's process imports (torch, DeepSpeed,
numpy, pydantic, setuptools...), and that pip run takes them as constraints: it can add
packages beside the build but never swap one the build has loaded. Should the frameworks ever
need another version of one, pip stops with a resolution error instead of racing the build.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _import_what_the_build_imports() -> None:
    import torch.utils.cpp_extension  # noqa: F401  (the JIT build; imports setuptools)
    from deepspeed.comm.torch import build_shm_op  # noqa: F401
    from deepspeed.ops.op_builder import CPUAdamBuilder  # noqa: F401


def pins() -> list[str]:
    _import_what_the_build_imports()
    owners = metadata.packages_distributions()
    names: set[str] = {"ninja"}  # the build runs its binary, not its module
    for module in list(sys.modules):
        names.update(owners.get(module.partition(".")[0], ()))
    lines = []
    for name in sorted(names, key=str.lower):
        try:
            lines.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return lines


def build() -> None:
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder import CPUAdamBuilder

    build_shm_op()
    CPUAdamBuilder().load()


def main(argv: list[str]) -> int:
    if argv[:1] == ["pins"] and len(argv) == 2:
        Path(argv[1]).write_text("\n".join(pins()) + "\n")
        return 0
    if argv == ["build"]:
        build()
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
