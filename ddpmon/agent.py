"""The per-rank agent: installs the probes, turns each completed step into a record, serves it.

Hot path (per step): one fused norm pass, a handful of tiny device ops and one non-blocking copy.
Nothing on it reads a device value, except ``on_nonfinite='skip'|'raise'``, which must decide
before the optimizer step and therefore reads one flag (documented).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .clip import clip_grad_norm_, set_active_monitor
from .config import Config, ConfigError
from .export.collector import DdpmonCollector, Exposition, LiveSources
from .identity import RankIdentity, build_versions, detect_identity
from .probes.amp import ScalerProbe
from .probes.comm import BucketParts, CommProbe
from .probes.grads import (
    SUMMARY_ANY_BAD,
    GradSummary,
    ParamIndex,
    full_pass,
    summarize,
    summary_width,
)
from .readback import Readback
from .state import MetricState, StepRecord

log = logging.getLogger("ddpmon")

__all__ = ["Monitor", "NonFiniteGradientError", "attach", "clip_grad_norm_"]


class NonFiniteGradientError(FloatingPointError):
    """Raised by ``on_nonfinite='raise'``; names the rank, step and parameter."""


@dataclass(slots=True)
class _StepMeta:
    """Host-side facts about a pending step vector: which slots it holds and their widths."""

    step: int
    wall_time: float
    duration: float | None
    data_wait: float | None
    reduced: bool
    local: bool
    local_is_reduced: bool
    loss_slot: bool
    loss_host: float | None
    scale: bool
    found: bool
    identical: bool = False
    local_norm_valid: bool = True
    seconds: list[float] = field(default_factory=list)
    events: list[tuple[Any, Any]] = field(default_factory=list)
    bytes: int = 0
    local_positions: list[int] = field(default_factory=list)


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any = None,
    *,
    comm_hook: Callable | None = None,
    comm_state: Any = None,
    **options: Any,
) -> Monitor:
    """Monitor this rank. Options as in ``ddpmon.Config`` (also ``DDPMON_*`` variables).

    A bad option never stops training: the error is logged precisely and a disabled monitor is
    returned (``mon.enabled`` is False, ``mon.error`` says why).
    ``comm_hook``/``comm_state``: your own DDP communication hook (e.g. PowerSGD); ddpmon wraps it.
    """
    try:
        config = Config.from_sources(options)
    except ConfigError as exc:
        log.error("ddpmon disabled: invalid configuration: %s", exc)
        return Monitor._disabled(str(exc))
    if not config.enabled:
        return Monitor._disabled(None)
    monitor = Monitor(model, optimizer, scaler, config, comm_hook=comm_hook, comm_state=comm_state)
    monitor._start()
    return monitor


class Monitor:
    """One rank's agent. Create it with ``ddpmon.attach``."""

    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        scaler: Any,
        config: Config | None,
        *,
        comm_hook: Callable | None = None,
        comm_state: Any = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.config = config
        self.enabled = config is not None
        self.error: str | None = None
        self.identity: RankIdentity | None = None
        self.run_id: str | None = None
        self.run_path: Path | None = None
        self.port: int | None = None
        self.state = MetricState(loss_scale_floor=config.loss_scale_floor if config else 1.0)
        self.exposition: Exposition | None = None
        self.events: Any = None
        self._comm_hook = comm_hook
        self._comm_state = comm_state
        self._closed = False
        self._handles: list[Any] = []
        self._logged_errors: set[str] = set()
        self._step = 0
        self._step_start: float | None = None
        self._last_end: float | None = None
        self._loss: Any = None
        self._pre_summaries: tuple[Any, Any, BucketParts | None] | None = None
        self._offered: tuple[torch.Tensor, list[int], torch.Tensor] | None = None
        self._readback = Readback()
        self._recent: deque[dict] = deque(maxlen=64)
        self._allreduce_recent: deque[float] = deque(maxlen=4096)
        self._comm: CommProbe | None = None
        self._amp: ScalerProbe | None = None
        self._server: Any = None
        self._sd: Any = None
        self._daemon_info: dict | None = None
        self._watchdog: Any = None
        self._crash: Any = None
        self._evidence: Any = None
        self._progress: Any = None
        self._hosts: list[dict] | None = None
        self._below_floor = False
        self._batch_shapes: list | None = None
        self._lock = threading.Lock()

    @classmethod
    def _disabled(cls, error: str | None) -> Monitor:
        mon = cls(None, None, None, None)
        mon.error = error
        return mon

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        cfg = self.config
        assert cfg is not None and self.model is not None and self.optimizer is not None
        self.identity = detect_identity(self.model, cfg.node)
        self.identity = self._with_gpu_uuid(self.identity)
        self.run_id = self._agree_run_id(cfg.run_id)
        self.run_path = Path(cfg.run_dir) / self.run_id
        self.state.started_at = time.time()
        self._index = ParamIndex(self.model, cfg.group_depth, cfg.max_groups)
        self._install_forensics()
        self._install_hooks()
        self._install_exporter()
        self._publish_discovery()
        atexit.register(self.close)
        set_active_monitor(self)
        self._emit(
            "start",
            None,
            world_size=self.identity.world_size,
            local_rank=self.identity.local_rank,
            node=self.identity.node,
            pid=self.identity.pid,
            device=self.identity.device,
            port=self.port,
            run_id=self.run_id,
            clock_offset_seconds=self._clock.get("offset_seconds", 0.0),
            clock_rtt_seconds=self._clock.get("rtt_seconds"),
        )

    def close(self) -> None:
        """Flush pending readbacks, write the summary, stop the server. Idempotent."""
        with self._lock:
            if self._closed or not self.enabled:
                self._closed = True
                return
            self._closed = True
        try:
            self._drain(wait=True)
        except Exception as exc:
            self._probe_error("readback", exc)
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()
        if self._amp is not None:
            self._amp.detach()
        if self._watchdog is not None:
            self._watchdog.stop()
        self._write_summary()
        if self._progress is not None:
            self._progress.close()
        self._unpublish_discovery()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._crash is not None:
            try:
                self._crash.uninstall()
            except Exception:
                pass
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ public API
    def observe_loss(self, loss: Any) -> None:
        """Record this step's loss; a tensor is kept on its device, never read here."""
        if not self.enabled or self._closed:
            return
        try:
            if isinstance(loss, torch.Tensor):
                self._loss = loss.detach()
            else:
                self._loss = float(loss)
        except Exception as exc:
            self._probe_error("loss", exc)

    @property
    def step(self) -> int:
        """Number of steps completed so far (host counter, no sync)."""
        return self._step

    # ------------------------------------------------------------------ set-up pieces
    def _with_gpu_uuid(self, identity: RankIdentity) -> RankIdentity:
        if not identity.device.startswith("cuda"):
            return identity
        try:
            index = torch.device(identity.device).index or 0
            uuid_value = str(torch.cuda.get_device_properties(index).uuid)
            if uuid_value and not uuid_value.startswith("GPU-"):
                uuid_value = "GPU-" + uuid_value
            from dataclasses import replace

            return replace(identity, gpu_uuid=uuid_value)
        except Exception:
            return identity

    def _agree_run_id(self, explicit: str | None) -> str:
        """All ranks must share one run id: explicit > torchrun's > one broadcast from rank 0."""
        self._clock: dict = {}
        if explicit:
            candidate = explicit
        else:
            elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
            candidate = elastic if elastic and elastic != "none" else None
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            if candidate is None:
                box = [time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]]
                dist.broadcast_object_list(box, src=0)
                candidate = box[0]
            try:
                from .forensics.clock import measure_clock_offset

                self._clock = measure_clock_offset()
            except Exception as exc:
                self._probe_error("clock", exc)
            try:  # every rank's host and device, for rank 0's manifest (once, at attach)
                ident = self.identity
                mine = (
                    {
                        "rank": ident.rank,
                        "node": ident.node,
                        "local_rank": ident.local_rank,
                        "pid": ident.pid,
                        "device": ident.device,
                        "gpu_uuid": ident.gpu_uuid or None,
                    }
                    if ident is not None
                    else {}
                )
                hosts: list = [None] * dist.get_world_size()
                dist.all_gather_object(hosts, mine)
                self._hosts = hosts
            except Exception as exc:
                self._probe_error("forensics", exc)
        return candidate or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]

    def _install_hooks(self) -> None:
        model, optimizer = self.model, self.optimizer
        assert model is not None and optimizer is not None
        self._handles.append(model.register_forward_pre_hook(self._on_forward))
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            probe = CommProbe(
                self._index,
                inner_hook=self._comm_hook,
                inner_state=self._comm_state,
                on_error=self._probe_error,
                data_check_interval=self.config.data_check_interval if self.config else 10,
                local_norm_every=self.config.local_norm_every if self.config else 1,
                grads_are_bucket_views=bool(getattr(model, "gradient_as_bucket_view", False)),
            )
            try:
                model.register_comm_hook(None, probe.hook)
                self._comm = probe
            except Exception as exc:
                log.warning(
                    "ddpmon: could not register its DDP comm hook (%s). If you use your own "
                    "comm hook, pass it as ddpmon.attach(..., comm_hook=hook, comm_state=state) "
                    "instead of registering it. Local pre-all-reduce norms and all-reduce "
                    "timings are off; reduced norms still work.",
                    exc,
                )
                self.state.count_error("comm")
        if self.scaler is not None:
            self._amp = ScalerProbe(
                self.scaler, optimizer, on_update=self._on_scaler_update, on_error=self._probe_error
            )
            self.state.amp_enabled = self._amp.enabled()
        if self._amp is None:
            # With a GradScaler the step boundary is scaler.update(): it also sees skipped steps.
            self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_pre))
            self._handles.append(optimizer.register_step_post_hook(self._on_optimizer_post))

    def _install_exporter(self) -> None:
        cfg, ident = self.config, self.identity
        assert cfg is not None and ident is not None and self.run_id is not None
        from .sources.host import ProcessSource
        from .sources.nvml import NvmlSource

        allocator = None
        gpu_indices = None
        if ident.device.startswith("cuda"):
            from .sources.allocator import AllocatorSource

            allocator = AllocatorSource(torch.device(ident.device))
            gpu_indices = [torch.device(ident.device).index or 0]
        try:
            process = ProcessSource()
        except Exception as exc:
            self._probe_error("process", exc)
            process = None
        live = LiveSources(
            process=process,
            allocator=allocator,
            nvml=NvmlSource(),
            gpu_indices=gpu_indices,
            min_interval=cfg.live_refresh_seconds,
            on_error=self._probe_error,
        )
        collector = DdpmonCollector(self.state, ident, self.run_id, build_versions(), live)
        self.exposition = Exposition(collector)
        if cfg.port == 0:
            return
        from .export.server import MetricsServer, PortInUseError

        port = cfg.port + ident.local_rank
        server = MetricsServer(
            self.exposition.render, bind=cfg.bind, port=port, web_config=cfg.web_config
        )
        try:
            server.start()
        except PortInUseError as exc:
            log.warning("ddpmon: rank %d serves no metrics: %s", ident.rank, exc.strerror or exc)
            self.state.count_error("server")
            return
        except Exception as exc:  # bad web_config and the like: serve nothing, never insecurely
            log.error("ddpmon: rank %d serves no metrics: %s", ident.rank, exc)
            self.state.count_error("server")
            return
        self._server = server
        self.port = server.port

    def _publish_discovery(self) -> None:
        cfg, ident = self.config, self.identity
        assert cfg is not None and ident is not None
        if self.port is None:
            return
        host = socket.gethostname() if cfg.bind in ("0.0.0.0", "::", "") else cfg.bind
        target = f"{host}:{self.port}"
        labels = {
            "run": self.run_id or "",
            "rank": str(ident.rank),
            "node": ident.node,
            "local_rank": str(ident.local_rank),
        }
        sd_dir = cfg.sd_dir or os.environ.get("DDPMON_SD_DIR")
        if sd_dir:
            try:
                from .export.discovery import FileSDPublisher

                self._sd = FileSDPublisher(
                    sd_dir,
                    target=target,
                    labels=labels,
                    filename=f"ddpmon-{self.run_id}-rank{ident.rank}.json",
                )
                self._sd.publish()
            except Exception as exc:
                self._probe_error("discovery", exc)
        if cfg.daemon_url:
            try:
                from .daemon.client import register_rank

                self._daemon_info = {
                    **labels,
                    "pid": ident.pid,
                    "port": self.port,
                    "target": target,
                    "job_id": os.environ.get("DDPMON_JOB_ID", ""),
                }
                register_rank(cfg.daemon_url, self._daemon_info)
            except Exception as exc:
                self._probe_error("discovery", exc)

    def _unpublish_discovery(self) -> None:
        if self._sd is not None:
            try:
                self._sd.remove()
            except Exception:
                pass
        if self._daemon_info is not None and self.config and self.config.daemon_url:
            try:
                from .daemon.client import deregister_rank

                deregister_rank(self.config.daemon_url, self._daemon_info)
            except Exception:
                pass

    def _install_forensics(self) -> None:
        cfg, ident = self.config, self.identity
        assert cfg is not None and ident is not None and self.run_path is not None
        try:
            self.run_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.error(
                "ddpmon: run dir %s is not writable (%s); event log and evidence are off, "
                "metrics still served",
                self.run_path,
                exc,
            )
            self.state.count_error("forensics")
            return
        try:
            from .forensics.eventlog import EventLog

            self.events = EventLog(self.run_path, ident.rank)
        except Exception as exc:
            self._probe_error("forensics", exc)
        try:
            from .forensics.eventlog import ProgressFile

            self._progress = ProgressFile(self.run_path, ident.rank)
        except Exception as exc:
            self._probe_error("forensics", exc)
        try:
            from .forensics.evidence import EvidenceWriter

            self._evidence = EvidenceWriter(
                self.run_path,
                ident.rank,
                max_per_kind=cfg.evidence_max_per_kind,
                tensor_max_elements=cfg.evidence_tensor_max_elements,
                include_tensors=cfg.evidence_include_tensors,
                include_inputs=cfg.evidence_include_inputs,
            )
        except Exception as exc:
            self._probe_error("forensics", exc)
        try:
            from .forensics.crash import CrashCapture

            self._crash = CrashCapture(self.run_path, ident.rank, self.events)
            self._crash.install()
        except Exception as exc:
            self._probe_error("forensics", exc)
        try:
            from .forensics.watchdog import StallWatchdog

            self._watchdog = StallWatchdog(
                cfg.stall_seconds,
                heartbeat=lambda: self.state.last_step_timestamp or self.state.started_at,
                on_stall=self._on_stall,
            )
            self._watchdog.start()
        except Exception as exc:
            self._probe_error("forensics", exc)
        self._write_manifest()

    def _write_manifest(self) -> None:
        if self.run_path is None or self.identity is None or self.config is None:
            return
        try:
            from .forensics.manifest import build_manifest, write_manifest

            scaler = self.scaler
            precision = "fp32"
            if scaler is not None and getattr(scaler, "_enabled", True):
                precision = "amp+gradscaler"
            manifest = build_manifest(
                identity=self.identity,
                config=self.config,
                versions=build_versions(),
                extra={
                    "run_id": self.run_id,
                    "batch_shapes": self._batch_shapes,
                    "precision": precision,
                    "data_version": self.config.data_version,
                    "param_count": sum(p.numel() for p in self._index.params),
                    "hosts": self._hosts,
                    "group_names": self._index.group_names,
                },
            )
            write_manifest(self.run_path, manifest)
        except Exception as exc:
            self._probe_error("manifest", exc)

    # ------------------------------------------------------------------ hooks
    def _on_forward(self, module: Any, args: Any) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()
        if self._batch_shapes is None:
            try:
                self._batch_shapes = [
                    list(a.shape) for a in args if isinstance(a, torch.Tensor)
                ] or [repr(type(a).__name__) for a in args]
                self._write_manifest()
            except Exception as exc:
                self._probe_error("data", exc)

    def _on_optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._closed:
            return
        try:
            inv = None
            self._pre_summaries = self._summaries(inv, grads_unscaled=True)
        except Exception as exc:
            self._pre_summaries = None
            self._probe_error("grads", exc)
            return
        self._enforce_policy(self._pre_summaries[0], skip_allowed=self._amp is None)

    def _on_optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._closed:
            return
        summaries, self._pre_summaries = self._pre_summaries, None
        self._finish_step(summaries, found=None, scale=None)

    def _on_scaler_update(self, found: Any, scale_before: Any, scale_after: Any) -> None:
        if self._closed:
            return
        self._pre_summaries = None
        summaries = None
        try:
            inv = None
            if self._comm is not None and scale_before is not None:
                inv = 1.0 / scale_before  # bucket norms were taken on scaled gradients
            summaries = self._summaries(inv, grads_unscaled=True)
        except Exception as exc:
            self._probe_error("grads", exc)
        if summaries is not None:
            self._enforce_policy(summaries[0], skip_allowed=False)
        self._finish_step(summaries, found=found, scale=scale_after)

    # ------------------------------------------------------------------ step machinery
    def _summaries(self, inv_scale: Any, grads_unscaled: bool) -> tuple[Any, Any, Any]:
        """(reduced summary, local summary, bucket parts) as device vectors, no host reads."""
        index = self._index
        parts = self._comm.take() if self._comm is not None else None
        reduced = local = None
        if parts is not None and parts.buckets:
            if parts.local_norms:
                norms = torch.cat(parts.local_norms)
                pos, grp = index.layout(parts.local_positions, norms.device)
                local = summarize(norms, pos, grp, len(index), index.n_groups, inv_scale)
            if parts.reduced_complete and parts.reduced_norms:
                norms = torch.cat(parts.reduced_norms)
                pos, grp = index.layout(parts.reduced_positions, norms.device)
                reduced = summarize(norms, pos, grp, len(index), index.n_groups, inv_scale)
        offered, self._offered = self._offered, None
        if reduced is None and offered is not None:
            # clip_grad_norm_ already measured these gradients (before clipping): reuse.
            norms, positions, total = offered
            pos, grp = index.layout(positions, norms.device)
            reduced = summarize(norms, pos, grp, len(index), index.n_groups)
            reduced = torch.cat([total.reshape(1).to(reduced.dtype), reduced[1:]])
        if reduced is None:
            # Not DDP (or the hook is off): one pass over the final .grad tensors. With a
            # GradScaler they were unscaled in place by scaler.step() by now.
            reduced = full_pass(index)
        if parts is None or not parts.buckets:
            return reduced, None, parts
        return reduced, local, parts

    def _offer_norms(self, params: list, norms: torch.Tensor, total: torch.Tensor) -> None:
        """Per-parameter norms measured by ``clip_grad_norm_`` for this step (pre-clip)."""
        try:
            positions = [self._index.position[id(p)] for p in params]
            self._offered = (norms, positions, total)
        except KeyError:
            self._offered = None  # clipping parameters this monitor does not track

    def _reduced_norm_for(self, params: list) -> torch.Tensor | None:
        """Global norm of the current reduced gradients from the comm hook's per-bucket norms
        (no pass over the gradients), or None if the hook did not see all of ``params``."""
        if self._comm is None:
            return None
        parts = self._comm._parts
        if not parts.reduced_complete or not parts.reduced_norms:
            return None
        wanted = {self._index.position.get(id(p), -1) for p in params}
        if wanted != set(parts.reduced_positions):
            return None
        norms = torch.cat(parts.reduced_norms)
        if self._amp is not None and self._amp.grads_unscaled():
            scale = self._amp.current_scale()
            if scale is not None:
                norms = norms / scale.to(norms.dtype)
        return (norms * norms).sum().sqrt()

    def _enforce_policy(self, reduced: Any, *, skip_allowed: bool) -> None:
        cfg = self.config
        if cfg is None or cfg.on_nonfinite == "record" or reduced is None:
            return
        try:
            bad = bool(reduced[SUMMARY_ANY_BAD] > 0.5)  # the one documented host read
        except Exception as exc:
            self._probe_error("grads", exc)
            return
        if not bad:
            return
        summary = GradSummary.from_values(reduced.tolist())
        param = self._param_name(summary.first_position)
        rank = self.identity.rank if self.identity else 0
        if cfg.on_nonfinite == "raise":
            self._emit("nonfinite", self._step, param=param, nonfinite=summary.kind, action="raise")
            raise NonFiniteGradientError(
                f"ddpmon: non-finite gradient ({summary.kind}) on rank {rank} at step "
                f"{self._step} in parameter {param}"
            )
        if cfg.on_nonfinite == "skip" and skip_allowed:
            # Reduced gradients are identical on every rank, so every rank decides the same.
            for p in self._index.params:
                p.grad = None
            self._emit("nonfinite", self._step, param=param, nonfinite=summary.kind, action="skip")

    def _finish_step(self, summaries: Any, *, found: Any, scale: Any) -> None:
        try:
            end_perf, end_wall = time.perf_counter(), time.time()
            start = self._step_start if self._step_start is not None else self._last_end
            duration = end_perf - start if start is not None else None
            data_wait = None
            if self._step_start is not None and self._last_end is not None:
                data_wait = max(0.0, self._step_start - self._last_end)
            vector, meta = self._pack(summaries, found, scale)
            meta.step, meta.wall_time = self._step, end_wall
            meta.duration, meta.data_wait = duration, data_wait
            self._readback.push(vector, meta)
        except Exception as exc:
            self._probe_error("step", exc)
        finally:
            self._step += 1
            self._step_start = None
            self._last_end = time.perf_counter()
        try:
            self._drain(wait=False)
        except Exception as exc:
            self._probe_error("readback", exc)

    def _pack(self, summaries: Any, found: Any, scale: Any) -> tuple[torch.Tensor, _StepMeta]:
        reduced, local, parts = summaries if summaries is not None else (None, None, None)
        pieces: list[torch.Tensor] = []
        device = None
        for t in (reduced, local):
            if t is not None:
                device = t.device
                break
        meta = _StepMeta(
            step=0,
            wall_time=0.0,
            duration=None,
            data_wait=None,
            reduced=reduced is not None,
            local=local is not None,
            local_is_reduced=local is None and self._comm is None,
            loss_slot=False,
            loss_host=None,
            scale=False,
            found=False,
        )
        if reduced is not None:
            pieces.append(reduced)
        if local is not None:
            pieces.append(local)
        loss, self._loss = self._loss, None
        if isinstance(loss, torch.Tensor):
            device = device or loss.device
            pieces.append(loss.reshape(-1)[:1].to(device, torch.float64, non_blocking=True))
            meta.loss_slot = True
        elif loss is not None:
            meta.loss_host = float(loss)
        for name, t in (("scale", scale), ("found", found)):
            if isinstance(t, torch.Tensor):
                device = device or t.device
                pieces.append(t.reshape(1).to(device, torch.float64, non_blocking=True))
                setattr(meta, name, True)
        if parts is not None:
            meta.seconds, meta.events, meta.bytes = parts.seconds, parts.events, parts.bytes
            meta.local_positions = parts.local_positions
            meta.local_norm_valid = parts.local_buckets == parts.buckets
            identical = self._identical_ranks(parts)
            if identical is not None:
                device = device or identical.device
                pieces.append(identical.reshape(1).to(device, torch.float64, non_blocking=True))
                meta.identical = True
        vector = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
        return vector, meta

    def _identical_ranks(self, parts: BucketParts) -> torch.Tensor | None:
        """Device count of other ranks whose sampled local-gradient fingerprint equals ours."""
        if parts.fingerprint is None:
            return None
        try:
            work, gathered, mine = parts.fingerprint
            work.wait()  # done by now (it preceded the step's all-reduces); on NCCL a stream wait
            same = (gathered == mine) & (mine > 0) & torch.isfinite(mine)
            return torch.clamp(same.sum() - 1, min=0)  # ourselves are in `same` unless zero
        except Exception as exc:
            self._probe_error("data", exc)
            return None

    def _drain(self, wait: bool) -> None:
        for values, meta in self._readback.poll(wait=wait):
            record = self._unpack(values, meta)
            self._apply(record, meta)

    def _unpack(self, values: list[float], meta: _StepMeta) -> StepRecord:
        width = summary_width(self._index.n_groups)
        pos = 0
        record = StepRecord(
            step=meta.step,
            wall_time=meta.wall_time,
            duration_seconds=meta.duration,
            data_wait_seconds=meta.data_wait,
        )
        reduced = local = None
        if meta.reduced:
            reduced = GradSummary.from_values(values[pos : pos + width])
            pos += width
        if meta.local:
            local = GradSummary.from_values(values[pos : pos + width])
            pos += width
        elif meta.local_is_reduced:
            local = reduced
        if meta.loss_slot:
            record.loss = values[pos]
            pos += 1
        elif meta.loss_host is not None:
            record.loss = meta.loss_host
        if meta.scale:
            record.loss_scale = values[pos]
            pos += 1
        if meta.found:
            record.amp_skipped = values[pos] > 0
            pos += 1
        if meta.identical:
            record.data_identical_ranks = int(values[pos])
            pos += 1
        if reduced is not None:
            record.grad_norm = reduced.norm
            record.group_norms = dict(
                zip(self._index.group_names, reduced.group_norms, strict=True)
            )
            record.grad_nonfinite = reduced.nonfinite
            if reduced.nonfinite:
                record.grad_nonfinite_param = self._param_name(reduced.first_position)
                record.grad_nonfinite_kind = reduced.kind
        if local is not None:
            if meta.local_norm_valid:  # else only some buckets were measured (rare path)
                record.grad_local_norm = local.norm
            record.local_nonfinite = local.nonfinite
            if local.nonfinite:
                record.local_nonfinite_param = self._param_name(local.first_position)
                record.local_nonfinite_kind = local.kind
        record.allreduce_seconds = list(meta.seconds)
        for start, end in meta.events:
            try:
                record.allreduce_seconds.append(start.elapsed_time(end) / 1000.0)
            except Exception as exc:
                self._probe_error("comm", exc)
        return record

    def _apply(self, record: StepRecord, meta: _StepMeta) -> None:
        state = self.state
        state.allreduce_bytes_total += meta.bytes
        state.apply(record)
        if self._progress is not None:
            self._progress.update(record.step, record.wall_time)
        self._allreduce_recent.extend(record.allreduce_seconds)
        as_dict = record.as_dict()
        self._recent.append(as_dict)
        if record.local_nonfinite:
            self._emit(
                "nonfinite",
                record.step,
                param=record.local_nonfinite_param,
                nonfinite=record.local_nonfinite_kind,
                origin=True,
                grad_local_norm=record.grad_local_norm,
            )
            self._write_evidence("nonfinite", record, record.local_nonfinite_param)
        elif record.grad_nonfinite:
            self._emit(
                "nonfinite",
                record.step,
                param=record.grad_nonfinite_param,
                nonfinite=record.grad_nonfinite_kind,
                origin=False,
            )
        if record.loss is not None and not math.isfinite(record.loss):
            self._emit("nonfinite", record.step, tensor="loss", nonfinite=str(record.loss))
        if record.amp_skipped:
            self._emit("overflow", record.step, loss_scale=record.loss_scale)
        if record.data_identical_ranks and state.data_identical_batches_total == 1:
            self._emit("identical_data", record.step, other_ranks=record.data_identical_ranks)
        if record.loss_scale is not None and self.config is not None:
            below = record.loss_scale <= self.config.loss_scale_floor
            if below and not self._below_floor:
                self._emit(
                    "scale_floor",
                    record.step,
                    loss_scale=record.loss_scale,
                    floor=self.config.loss_scale_floor,
                )
                self._write_evidence("scale_floor", record, None)
            self._below_floor = below

    # ------------------------------------------------------------------ forensics glue
    def _param_name(self, position: int) -> str:
        names = self._index.names
        return names[position] if 0 <= position < len(names) else "unknown"

    def _emit(self, kind: str, step: int | None, **fields: Any) -> None:
        if self.events is None:
            return
        try:
            self.events.emit(kind, step, **fields)
        except Exception as exc:
            self._probe_error("eventlog", exc)

    def _write_evidence(self, kind: str, record: StepRecord, param: str | None) -> None:
        if self._evidence is None:
            return
        try:
            tensors = {}
            if param is not None and param in self._index.names:
                grad = self._index.params[self._index.names.index(param)].grad
                if grad is not None:
                    # The local gradient is gone after the all-reduce; this is the reduced one.
                    tensors[f"{param}.grad(reduced)"] = grad.detach()
            info = {
                "kind": kind,
                "rank": self.identity.rank if self.identity else None,
                "step": record.step,
                "param": param,
                "record": record.as_dict(),
            }
            extra = {"scaler": self._scaler_state()}
            self._evidence.write(
                kind, record.step, info, tensors=tensors, records=list(self._recent), extra=extra
            )
        except Exception as exc:
            self._probe_error("evidence", exc)

    def _scaler_state(self) -> dict | None:
        if self.scaler is None:
            return None
        try:
            return {
                k: (v.tolist() if isinstance(v, torch.Tensor) else v)
                for k, v in self.scaler.state_dict().items()
            }
        except Exception:
            return None

    def _on_stall(self, idle_seconds: float) -> None:
        self._emit(
            "stall",
            self._step,
            idle_seconds=round(idle_seconds, 3),
            stall_seconds=self.config.stall_seconds if self.config else None,
        )
        if self._evidence is not None:
            try:
                self._evidence.write(
                    "stall",
                    self._step,
                    {"kind": "stall", "idle_seconds": idle_seconds, "last_step": self.state.step},
                    records=list(self._recent),
                )
            except Exception as exc:
                self._probe_error("evidence", exc)
        try:
            from .forensics.watchdog import request_flight_recorder_dump

            if self.run_path is not None:
                request_flight_recorder_dump(
                    self.run_path
                    / f"flight_recorder.rank{self.identity.rank if self.identity else 0}"
                )
        except Exception as exc:
            self._probe_error("watchdog", exc)

    def _write_summary(self) -> None:
        if self.run_path is None or self.identity is None:
            return
        s = self.state
        recent = sorted(self._allreduce_recent)

        def quantile(q: float) -> float | None:
            return recent[min(len(recent) - 1, int(q * len(recent)))] if recent else None

        summary = {
            "run_id": self.run_id,
            "rank": self.identity.rank,
            "steps": s.steps_total,
            "last_step": s.step,
            "loss": s.loss,
            "grad_norm": s.grad_norm,
            "grad_local_norm": s.grad_local_norm,
            "grad_nonfinite_steps": s.grad_nonfinite_steps_total,
            "grad_nonfinite_origin_steps": s.grad_nonfinite_origin_steps_total,
            "first_nonfinite": (
                {
                    "step": s.first_nonfinite.step,
                    "param": s.first_nonfinite.param,
                    "kind": s.first_nonfinite.kind,
                }
                if s.first_nonfinite
                else None
            ),
            "loss_scale": s.loss_scale,
            "amp_skipped_steps": s.amp_skipped_steps_total,
            "allreduce_p50_seconds": quantile(0.5),
            "allreduce_p99_seconds": quantile(0.99),
            "allreduce_count": s.allreduce_duration.count,
            "agent_errors": dict(s.agent_errors),
            "port": self.port,
        }
        self._emit("exit", s.step, reason="close", steps=s.steps_total)
        try:
            from .atomic import write_json_atomic

            write_json_atomic(self.run_path / f"summary.rank{self.identity.rank}.json", summary)
        except Exception as exc:
            self._probe_error("summary", exc)

    # ------------------------------------------------------------------ errors
    def _probe_error(self, probe: str, exc: BaseException) -> None:
        """Count and log (once per probe) a failure; never re-raise into training."""
        self.state.count_error(probe)
        if probe not in self._logged_errors:
            self._logged_errors.add(probe)
            log.warning(
                "ddpmon: probe %r failed (%s: %s); training continues. Further "
                "failures of this probe are only counted in "
                "ddpmon_agent_errors_total.",
                probe,
                type(exc).__name__,
                exc,
            )
