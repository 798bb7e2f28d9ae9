"""Checkpoints for the demo rank: ``--checkpoint-every K`` and ``--resume``.

Rank 0 saves model, optimizer, GradScaler and RNG state after every K-th step into
``step-<S>.pt`` (written to a temporary name, fsynced, renamed: a rank killed mid-save leaves
the previous checkpoint intact); ``S`` is the number of steps done, the step a resume starts at.
The demo's data is a pure function of the step, so resuming at ``S`` also restores the data
position. With ``--resume`` every rank loads the newest checkpoint, if there is one, and tells
ddpmon what it restored; ``--resume-without optimizer`` (etc.) leaves a state out on purpose, so
ddpmon's record of the missing state can be seen.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import OPTIONAL_STATES

_NAME = re.compile(r"^step-(\d+)\.pt$")


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="rank 0 saves a checkpoint after every K-th step (0: never)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where checkpoints go (default RUN_DIR/RUN_ID/checkpoints)")
    p.add_argument("--resume", action="store_true",
                   help="resume from the newest checkpoint when there is one")
    p.add_argument("--resume-without", action="append", default=[], choices=OPTIONAL_STATES,
                   help="leave this state out when resuming (repeatable)")


def init_process_group(timeout: datetime.timedelta) -> None:
    """gloo process group whose rendezvous keys are private to this attempt.

    Why: torchrun keeps its store across a restart, and gloo's address keys from the attempt
    before are still there; a restarted rank can read the dead peer's address and fail with
    "connectFullMesh ... Connection refused" (or hang). A prefix per restart count avoids it."""

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=rank == 0 and not agent_store, timeout=timeout,
    )
    store = dist.PrefixStore(f"ddpmon-demo/attempt{attempt}", base)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def first_attempt() -> bool:
    """False in a process torchelastic restarted: injected faults fire on the first attempt only
    (a restart would otherwise meet the same fault at the same step again)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")


class CheckpointRefused(RuntimeError):
    """A checkpoint file that is not a plain weights-only checkpoint (tensors, numbers,
    strings, lists and dicts): loading it would run code chosen by whoever wrote it."""


def load_checkpoint(path: Path) -> dict:
    """``torch.load(weights_only=True)``: a checkpoint holds tensors and plain containers only,
    so nothing in it is ever unpickled as an arbitrary object. The directory is whatever
    ``--checkpoint-dir`` names, which a job submitter may choose (docs/security.md)."""

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointRefused(
            f"refusing to load {str(path)!r}: not a weights-only checkpoint ({first[:200]!r})"
        ) from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointRefused(f"refusing to load {str(path)!r}: not a ddpmon demo checkpoint")
    return state


class DemoCheckpoints:
    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        if args.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every {args.checkpoint_every}: expected >= 0")
        self.every = args.checkpoint_every
        self.resume_enabled = args.resume
        self.without = set(args.resume_without)
        self.rank = rank
        base = args.checkpoint_dir or Path(args.run_dir or "ddpmon-runs") / (
            args.run_id or "demo") / "checkpoints"
        self.dir = Path(base)

    def latest(self) -> tuple[int, Path] | None:
        try:
            found = [(int(m.group(1)), p) for p in self.dir.iterdir()
                     if (m := _NAME.match(p.name))]
        except OSError:
            return None
        return max(found) if found else None

    def resume(self, model: torch.nn.Module, optimizer: Any, scaler: Any, amp: bool,
               mon: Any) -> int:
        """Load the newest checkpoint (with ``--resume``); the step to start at."""
        found = self.latest() if self.resume_enabled else None
        if found is None:
            return 0
        step, path = found
        flags = {k: k not in self.without for k in OPTIONAL_STATES}
        with mon.observe_checkpoint(
            step, path, kind="load", model=True, optimizer=flags["optimizer"],
            scaler=flags["scaler"] if amp else None, rng=flags["rng"], data_loader=True,
        ):
            state = load_checkpoint(path)
            model.load_state_dict(state["model"])
            if flags["optimizer"]:
                optimizer.load_state_dict(state["optimizer"])
            if flags["scaler"] and amp:
                scaler.load_state_dict(state["scaler"])
            if flags["rng"]:
                torch.set_rng_state(state["rng"])
        print(f"[rank {self.rank}] resumed from {path} at step {step}", flush=True)
        return int(state["step"])

    def after_step(self, step: int, model: torch.nn.Module, optimizer: Any, scaler: Any,
                   mon: Any) -> None:
        """Save after step index ``step`` when ``step + 1`` is a multiple of K (rank 0)."""
        done = step + 1
        if not self.every or done % self.every or self.rank != 0:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step-{done:06d}.pt"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with mon.observe_checkpoint(done, path, model=True, optimizer=True, scaler=True,
                                    rng=True, data_loader=True):
            state = {"step": done, "model": model.state_dict(),
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                     "rng": torch.get_rng_state()}
            with open(tmp, "wb") as fh:
                torch.save(state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
