"""The run manifest: what a person needs to reproduce or compare a run (docs/forensics/timeline.md).

One file per run: rank 0 writes ``run_dir/<run_id>/manifest.json``, once
(:func:`write_run_manifest` builds and writes it in one call). Other ranks write nothing: what
differs per rank (node, local rank, pid, device, GPU UUID) reaches rank 0 as ``hosts``, gathered
by the agent at attach. Runs from older versions may also hold per-rank copies
(``manifest.rank<R>.json``); nothing reads them. ``check_manifest`` reads ``manifest.json`` and
names every checklist item that is missing; an item that cannot exist on this machine (CUDA
version on a CPU build) counts as recorded when ``not_applicable`` says why.

Secrets: environment variables are kept only for the prefixes in :data:`ENV_PREFIXES` (plus a
few torchrun names), and any name containing one of :data:`SECRET_MARKERS` has its value
replaced by ``"<redacted>"``; a ``user:password@`` in a URL value is redacted too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..rundir.atomic import write_json_atomic
from ..rundir.damage import parse_json_object
from ..rundir.layout import RunDir
from ..rundir.safe_read import MAX_DOCUMENT_BYTES, open_regular
from ..sources.nvml import NvmlSource
from .rng import rng_fingerprints

ENV_PREFIXES = ("MASTER_", "NCCL_", "TORCH_", "TORCHELASTIC_", "DDPMON_", "PYTORCH_", "CUDA_",
                "OMP_", "GLOO_", "SLURM_")
ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "ROLE_NAME", "ROLE_WORLD_SIZE", "NODE_RANK")
SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH",
                  "PRIVATE", "COOKIE", "SESSION", "SIGNATURE", "CERT")
REDACTED = "<redacted>"
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]+):[^@/\s]+@")

CHECKLIST = (
    "versions.torch",
    "versions.cuda",
    "versions.nccl",
    "versions.driver",
    "versions.python",
    "versions.ddpmon",
    "topology.hosts",
    "topology.world_size",
    "topology.gpus",
    "launch.argv",
    "environment",
    "seeds",
    "batch_shapes",
    "precision",
    "data_version",
)
"""Dotted paths ``check_manifest`` requires (present and non-empty, or in not_applicable)."""


def redact_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The relevant variables of ``environ`` with secrets redacted (see module doc)."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name in sorted(environ):
        upper = name.upper()
        if not (upper.startswith(ENV_PREFIXES) or upper in ENV_NAMES):
            continue
        value = environ[name]
        if any(marker in upper for marker in SECRET_MARKERS):
            out[name] = REDACTED
        else:
            out[name] = _URL_USERINFO.sub(rf"\g<scheme>\g<user>:{REDACTED}@", value)
    return out


def build_manifest(
    *,
    identity: Any,
    config: Any,
    versions: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    nvml: Any | None = None,
) -> dict[str, Any]:
    """Assemble the manifest of this rank.

    ``identity``: a ``RankIdentity`` (or dict); ``config``: the agent ``Config`` (or dict);
    ``versions``: ``identity.build_versions()``; ``extra``: what only the agent knows
    (``run_id``, ``batch_shapes``, ``precision``, ``data_version``, ``seeds`` to add to the RNG
    fingerprints, ``hosts`` gathered from all ranks, anything else is kept under ``extra``).
    ``nvml`` (an ``NvmlSource``) is injectable for tests."""
    ident = _as_dict(identity)
    cfg = _as_dict(config)
    if cfg.get("step_metrics"):  # a per-step metric object is written by its name
        cfg["step_metrics"] = [getattr(v, "name", v) for v in cfg["step_metrics"]]
    extra = dict(extra or {})
    versions = dict(versions or {})
    not_applicable: dict[str, str] = {}

    if nvml is None:
        nvml = NvmlSource()
    gpus, driver, nvml_error = _gpus(nvml)

    torch_version = versions.get("torch_version")
    cuda = versions.get("cuda_version") or None
    nccl = versions.get("nccl_version") or None
    if not cuda and torch_version and "+cpu" in str(torch_version):
        not_applicable["versions.cuda"] = "torch CPU build"
    if not nccl:
        reason = "torch CPU build" if not cuda else "no CUDA device visible"
        not_applicable["versions.nccl"] = reason
    if driver is None:
        not_applicable["versions.driver"] = f"no NVIDIA driver ({nvml_error or 'NVML unavailable'})"
    if not gpus:
        not_applicable["topology.gpus"] = f"no GPU visible ({nvml_error or 'none found'})"

    host = {
        "rank": ident.get("rank"),
        "node": ident.get("node") or socket.gethostname(),
        "local_rank": ident.get("local_rank"),
        "pid": ident.get("pid", os.getpid()),
        "device": ident.get("device"),
        "gpu_uuid": ident.get("gpu_uuid") or None,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    hosts = extra.pop("hosts", None) or [host]

    seeds = rng_fingerprints()
    seeds.update(extra.pop("seeds", None) or {})

    manifest: dict[str, Any] = {
        "schema": 1,
        "created": time.time(),
        "run_id": extra.pop("run_id", None),
        "rank": ident.get("rank", 0),
        "versions": {
            "ddpmon": versions.get("version"),
            "torch": torch_version,
            "cuda": cuda,
            "nccl": nccl,
            "driver": driver,
            "python": versions.get("python_version") or platform.python_version(),
        },
        "topology": {
            "world_size": ident.get("world_size"),
            "backend": ident.get("backend"),
            "hosts": hosts,
            "gpus": gpus,
        },
        "launch": _launch(environ),
        "environment": redact_env(environ),
        "seeds": seeds,
        "batch_shapes": extra.pop("batch_shapes", None),
        "precision": extra.pop("precision", None),
        "precision_detail": extra.pop("precision_detail", None),
        "data_version": extra.pop("data_version", None) or cfg.get("data_version"),
        "config": {
            k: _URL_USERINFO.sub(rf"\g<scheme>\g<user>:{REDACTED}@", v) if isinstance(v, str) else v
            for k, v in cfg.items()
            if k not in ("extra",)
        },
        "not_applicable": not_applicable,
        "attempt": int(extra.pop("attempt", 0) or 0),
        "recovery": extra.pop("recovery", None),
        "data_check": extra.pop("data_check", None),
        "replica_check": extra.pop("replica_check", None),
        "slurm": extra.pop("slurm", None),
        "extra": extra,
    }
    return manifest


def manifest_path(run_path: Path | str, rank: int = 0) -> Path:
    """``manifest.json``; for ``rank > 0`` the per-rank name older versions wrote."""
    run = RunDir(run_path)
    return run.manifest() if int(rank) == 0 else run.legacy_manifest(rank)


def write_manifest(run_path: Path | str, manifest: Mapping[str, Any]) -> Path | None:
    """Atomically write ``manifest.json`` when ``manifest`` is rank 0's; return its path.

    Another rank's manifest is not written (None): one file per run, see the module doc."""
    if int(manifest.get("rank") or 0) != 0:
        return None
    return write_json_atomic(RunDir(run_path).manifest(), dict(manifest))


def write_run_manifest(
    run_path: Path | str,
    *,
    identity: Any,
    config: Any,
    versions: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    nvml: Any | None = None,
) -> Path | None:
    """Build and write the run's manifest in one call, on rank 0 only; None on other ranks
    (nothing is built there, so they pay nothing). Arguments as :func:`build_manifest`.

    The agent calls it at attach and again after the first step, when ``batch_shapes`` and a
    resume's ``recovery`` are known: the file is written atomically, so a reader sees one whole
    version or the other, and the rewrite keeps ``previous_attempts``."""
    if int(_as_dict(identity).get("rank") or 0) != 0:
        return None
    manifest = build_manifest(
        identity=identity, config=config, versions=versions, extra=extra, environ=environ,
        nvml=nvml,
    )
    manifest["previous_attempts"] = previous_attempts(run_path, manifest["attempt"])
    return write_manifest(run_path, manifest)


def previous_attempts(run_path: Path | str, attempt: int) -> list[dict[str, Any]]:
    """What the manifest of earlier attempts said about each attempt (created, launch, recovery),
    read from the manifest this attempt replaces: a restart reuses the run dir, and the file
    keeps one entry per earlier attempt rather than losing it."""
    try:
        old = json.loads(RunDir(run_path).manifest().read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(old, dict):
        return []
    kept = [a for a in old.get("previous_attempts") or [] if isinstance(a, dict)]
    old_attempt = int(old.get("attempt") or 0)
    if old_attempt < attempt:
        kept.append({
            "attempt": old_attempt,
            "created": old.get("created"),
            "recovery": old.get("recovery"),
            "launch": {"argv": (old.get("launch") or {}).get("argv"),
                       "torchelastic": (old.get("launch") or {}).get("torchelastic")},
        })
    return [a for a in kept if int(a.get("attempt") or 0) < attempt]


def recovery_gaps(manifest: Mapping[str, Any]) -> list[str]:
    """States a resume did not restore (or did not say it restored), from ``recovery``: why a
    resumed run can differ from an uninterrupted one. Empty for a run that did not resume."""
    recovery = manifest.get("recovery")
    if not isinstance(recovery, Mapping):
        return []
    return [*recovery.get("not_restored", []), *recovery.get("not_stated", [])]


def check_manifest(run_path: Path | str) -> list[str]:
    """Checklist items missing from rank 0's manifest (``["manifest.json"]`` when absent)."""

    path = manifest_path(run_path, 0)
    try:
        with open_regular(path) as fh:  # a FIFO or a huge file in its place: not a hang
            raw = fh.read(MAX_DOCUMENT_BYTES + 1)
        data, problem = (None, f"over {MAX_DOCUMENT_BYTES} bytes") if len(
            raw) > MAX_DOCUMENT_BYTES else parse_json_object(raw)
    except FileNotFoundError:
        return ["manifest.json"]
    except OSError as exc:
        return [f"manifest.json (unreadable: {exc.strerror or exc})"]
    if data is None:
        return [f"manifest.json (unreadable: {problem})"]
    not_applicable = data.get("not_applicable")
    not_applicable = not_applicable if isinstance(not_applicable, dict) else {}
    missing = []
    for item in CHECKLIST:
        if item in not_applicable:
            continue
        value: Any = data
        for part in item.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if item == "environment":
            if not isinstance(value, dict):
                missing.append(item)
            continue
        if value is None or value == "" or value == [] or value == {}:
            missing.append(item)
    return missing


def _as_dict(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return dict(vars(obj))


def _launch(environ: Mapping[str, str] | None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    argv = [_URL_USERINFO.sub(rf"\g<scheme>\g<user>:{REDACTED}@", a) for a in sys.argv]
    out: dict[str, Any] = {
        "argv": argv,
        "executable": sys.executable,
        "cwd": os.getcwd(),
        "launcher": "torchrun" if environ.get("TORCHELASTIC_RUN_ID") else None,
    }
    if out["launcher"]:
        out["torchelastic"] = {
            k: environ.get(k)
            for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS", "LOCAL_WORLD_SIZE", "GROUP_RANK")
            if environ.get(k) is not None
        }
    try:  # the launcher's own command line (torchrun ...), when it is our parent
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            parent = [p.decode(errors="replace") for p in fh.read().split(b"\0") if p]
        if any("torch.distributed.run" in p or p.endswith("torchrun") for p in parent):
            out["launcher_argv"] = parent
    except OSError:
        pass
    return out


def _gpus(nvml: Any) -> tuple[list[dict[str, Any]], str | None, str | None]:
    try:
        if not nvml.available:
            return [], None, getattr(nvml, "error", None)
        readings = nvml.read()
        driver = nvml.driver_version()
    except Exception as exc:
        return [], None, f"{type(exc).__name__}: {exc}"
    gpus = []
    module = getattr(nvml, "_nvml", None)
    for r in readings:
        gpu = {
            "index": r.index,
            "uuid": r.uuid,
            "name": r.name,
            "pci_bus_id": r.pci_bus_id,
            "memory_total_bytes": r.memory_total_bytes,
        }
        links = _nvlinks(module, r.index)
        if links is not None:
            gpu["nvlink"] = links
        gpus.append(gpu)
    return gpus, driver, None


def _nvlinks(nvml: Any, index: int) -> list[dict[str, Any]] | None:
    """Active NVLinks and the PCI bus id at their far end; None when NVML cannot tell."""
    if nvml is None or not hasattr(nvml, "nvmlDeviceGetNvLinkState"):
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None
    links = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            if not nvml.nvmlDeviceGetNvLinkState(handle, link):
                continue
        except Exception:
            continue  # NVLink unsupported on this link/board
        entry: dict[str, Any] = {"link": link}
        try:
            remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId
            entry["remote_pci_bus_id"] = remote.decode() if isinstance(remote, bytes) else remote
        except Exception:
            pass
        links.append(entry)
    return links
