"""Every dashboard query against a 1024-rank x 1 h TSDB in a real Prometheus.

1. Synthesises OpenMetrics for N ranks over D with the agent's real series set: every sample of
   ``tests/golden/exposition.txt`` (names, label names, histogram buckets exactly as the agent
   exposes them), repeated per rank with that rank's labels, plus the ``job``/``instance``
   target labels and ``up`` that Prometheus adds when it scrapes. ``ddpmon_grad_group_norm`` is
   widened to the agent's default cardinality bound (32 groups), the worst case.
2. ``promtool tsdb create-blocks-from openmetrics`` turns it into TSDB blocks.
3. A real Prometheus (loopback, temp dir) serves them; every panel query of both dashboards,
   variables resolved (run = the run, rank = All / one rank), runs as Grafana would run it:
   range queries over the last hour with step = scrape interval, instant queries at the end.
4. Prints and optionally writes (``--write-results``) a table of latency and series per query.

Usage: ``python benchmarks/dashboards_scale.py [--ranks 1024] [--hours 1] [--interval 60]``;
``--ranks 4096`` is the 4,096-rank mode (its own section in RESULTS.md, next to the 1,024-rank
one; the series target scales with the ranks, the latency target does not).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddpmon.config import DEFAULT_PORT, SERIES_PROFILES, Config  # noqa: E402
from ddpmon.export.collector import exports_group_norms  # noqa: E402
from ddpmon.metrics import step_metrics  # noqa: E402
from ddpmon.mixin import dashboards  # noqa: E402
from ddpmon.mixin.render import ALERTS_FILE, RULES_FILE  # noqa: E402
from ddpmon.mixin.render import generate as generate_rules  # noqa: E402
from ddpmon.mixin.rules import dependent  # noqa: E402
from ddpmon.services import ManagedProcess, Prometheus, find_binary  # noqa: E402
from tests.support import grafana  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "exposition.txt"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTION = "## Dashboards at 1024 ranks"


STORES = ("prometheus", "victoria-metrics")


def section(ranks: int, store: str = "prometheus", profile: str = "full") -> str:
    """RESULTS.md heading of a run at ``ranks`` (1024 and 4096 sit side by side); runs on
    VictoriaMetrics or under another series profile get their own."""
    head = SECTION.replace("1024", str(ranks))
    if store != "prometheus":
        head += " on VictoriaMetrics"
    if profile != "full":
        head += f" (series_profile={profile})"
    return head


def target_series(ranks: int) -> int:
    """The agents' series budget: 200,000 per 1,024 ranks (never less than that)."""
    return TARGET_SERIES * max(1, math.ceil(ranks / 1024))


RUN = "bench-1024"
RANKS_PER_NODE = 8
TARGET_LATENCY_S = 1.0
TARGET_SERIES = 200_000


@dataclass(frozen=True, slots=True)
class Template:
    family: str
    kind: str  # gauge | counter | histogram | unknown
    sample: str
    labels: tuple[tuple[str, str], ...]  # agent labels other than run/rank


def golden_templates(groups: int) -> list[Template]:
    """One template per sample of the golden exposition, in exposition order."""
    out: list[Template] = []
    for fam in text_string_to_metric_families(GOLDEN.read_text()):
        group_done = False
        for s in fam.samples:
            labels = tuple((k, v) for k, v in s.labels.items() if k not in ("run", "rank"))
            if fam.name == "ddpmon_grad_group_norm":
                if group_done:
                    continue
                group_done = True
                for g in range(groups):
                    out.append(Template(fam.name, fam.type, s.name, (("group", f"group{g}"),)))
                continue
            out.append(Template(fam.name, fam.type, s.name, labels))
    return out


def _lognormal_cdf(x: float, median: float, sigma: float) -> float:
    if x <= 0:
        return 0.0
    return 0.5 * (1 + math.erf(math.log(x / median) / (sigma * math.sqrt(2))))


class RankModel:
    """Deterministic, plausible values of one rank over time (stragglers, one NaN origin)."""

    def __init__(self, rank: int, world: int, rng: random.Random) -> None:
        self.rank = rank
        self.node = rank // RANKS_PER_NODE
        self.local = rank % RANKS_PER_NODE
        self.slow = 1.6 if rank % 97 == 13 else 1.0 + rng.random() * 0.1
        self.step_median = 0.8 * self.slow
        self.wait_median = 0.02 * (5 if rank % 211 == 7 else 1) * (0.8 + rng.random() * 0.4)
        self.ar_median = 0.004 * (3 if self.node == 17 else 1) * (0.9 + rng.random() * 0.2)
        self.steps_per_s = 1.0 / (self.step_median * 1.05 + self.wait_median)
        self.local_norm = 1.0 + rng.random()
        self.mem = 40e9 + rng.random() * 20e9
        self.origin = rank == world // 7  # first non-finite gradients come from this rank
        # A duplicated data shard: these two ranks read the same batches from the NaN on.
        self.duplicate = rank in (world // 3, world // 3 + 1)


def target_labels(m: RankModel) -> dict[str, str]:
    """What Prometheus attaches to every series of a rank's target: ``instance`` and the file_sd
    labels the agent publishes (``run``, ``rank``, ``node``, ``local_rank``), ``up`` included."""
    return {
        "instance": f"node-{m.node:04d}:{DEFAULT_PORT + m.local}",
        "run": RUN,
        "rank": str(m.rank),
        "node": f"node-{m.node:04d}",
        "local_rank": str(m.local),
    }


def series_labels(t: Template, m: RankModel, world: int) -> str:
    labels = {"job": "ddpmon", **target_labels(m)}
    for k, v in t.labels:
        if t.family == "ddpmon_rank_info":
            v = {
                "local_rank": str(m.local),
                "world_size": str(world),
                "node": f"node-{m.node:04d}",
                "device": f"cuda:{m.local}",
                "gpu_uuid": f"GPU-{m.rank:08x}-bench",
                "pid": str(10_000 + m.rank),
            }.get(k, v)
        elif k == "gpu":
            v = str(m.local)
        labels[k] = v
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def value(t: Template, m: RankModel, i: int, seconds: float, nonfinite_at: int) -> float:
    """The sample's value at time index ``i`` (``seconds`` since the start)."""
    name = t.sample
    steps = math.floor(seconds * m.steps_per_s)
    broken = i >= nonfinite_at
    le = dict(t.labels).get("le")
    if le is not None or name.endswith(("_count", "_sum")):
        if "step_duration" in name:
            n, median, sigma = steps, m.step_median, 0.15
        elif "data_wait" in name:
            n, median, sigma = steps, m.wait_median, 0.5
        elif "checkpoint_duration" in name:
            n, median, sigma = 1 + i // 30, 20.0, 0.3
        else:
            n, median, sigma = steps * 24, m.ar_median, 0.4
        if name.endswith("_count"):
            return n
        if name.endswith("_sum"):
            return n * median * math.exp(sigma**2 / 2)
        return n if le == "+Inf" else math.floor(n * _lognormal_cdf(float(le), median, sigma))
    if name == "ddpmon_step_part_seconds_total":  # the straggler computes more, waits less
        own = 0.7 * m.slow
        return steps * (own if dict(t.labels).get("part") == "compute" else 1.15 - own)
    wave = math.sin(seconds / 300 + m.rank)
    table = {
        "ddpmon_world_size": None,
        "ddpmon_step": steps - 1,
        "ddpmon_steps_total": steps,
        "ddpmon_last_step_timestamp_seconds": None,
        "ddpmon_stall_threshold_seconds": 300.0,
        "ddpmon_attempt": 0,
        "ddpmon_checkpoint_last_step": max(steps - 500, 0),
        "ddpmon_checkpoint_last_timestamp_seconds": 1.7e9,
        "ddpmon_checkpoint_size_bytes": 5e9,
        "ddpmon_loss": 2.5 * math.exp(-seconds / 1800) + 0.05 * wave,
        "ddpmon_loss_nonfinite_total": 0,
        "ddpmon_grad_norm": 1.0 + 0.3 * math.sin(seconds / 300),
        "ddpmon_grad_local_norm": m.local_norm * (1 + 0.1 * wave),
        "ddpmon_grad_group_norm": 0.1 + 0.05 * wave,
        "ddpmon_grad_nonfinite_steps_total": 1 if broken else 0,
        "ddpmon_grad_nonfinite_origin_steps_total": 1 if (broken and m.origin) else 0,
        "ddpmon_grad_nonfinite_poisoned_steps_total": 0,
        "ddpmon_grad_norm_mismatch_total": 0,
        "ddpmon_replica_mismatch_total": 0,
        "ddpmon_grad_first_nonfinite_info": 1,
        "ddpmon_amp_loss_scale": 65536.0 / (2 if broken else 1),
        "ddpmon_amp_loss_scale_floor": 1.0,
        "ddpmon_steps_skipped_total": 3 + (1 if broken else 0),  # each `by` alike
        "ddpmon_collective_bytes_total": steps * 1.4e9,
        # One check every 10 steps (the agent's data_check_interval), from the NaN onwards.
        "ddpmon_data_identical_batches_total": (
            (i - nonfinite_at + 1) * steps // max(i, 1) // 10 if broken and m.duplicate else 0
        ),
        "ddpmon_cuda_memory_allocated_bytes": m.mem * (0.9 + 0.05 * wave),
        "ddpmon_cuda_memory_reserved_bytes": m.mem,
        "ddpmon_cuda_memory_peak_allocated_bytes": m.mem * 0.97,
        "ddpmon_cuda_alloc_retries_total": 0,
        "ddpmon_cuda_ooms_total": 0,
        "ddpmon_gpu_memory_used_bytes": m.mem + 1.5e9,
        "ddpmon_gpu_memory_total_bytes": 85_899_345_920.0,
        "ddpmon_gpu_utilization_ratio": 0.85 + 0.1 * wave,
        "ddpmon_gpu_temperature_celsius": 60 + 5 * wave,
        "ddpmon_gpu_power_watts": 400 + 50 * wave,
        "ddpmon_process_resident_memory_bytes": 12e9 + 1e6 * i,
        "ddpmon_process_cpu_seconds_total": seconds * 1.3,
        "ddpmon_agent_errors_total": 1,
        "ddpmon_collector_success": 1,
        "ddpmon_rank_info": 1,
        "ddpmon_build_info": 1,
        # Live hang naming: from the NaN on, every rank waits in collective #1000+i, stuck 40 s;
        # the origin rank last issued one less: DdpmonHangHolder names it.
        "ddpmon_phase_since_timestamp_seconds": 1.7e9 + seconds,
        "ddpmon_collective_sequence": 1000 + i - (1 if broken and m.origin else 0),
        "ddpmon_collective_inflight_since_timestamp_seconds": 1.7e9 + seconds - 40,
        "ddpmon_collective_inflight_sequence": 1000 + i,
        "ddpmon_stuck_seconds": 40.0,
    }
    if name not in table:
        raise KeyError(f"no synthetic value for {name}: add it to the benchmark's table")
    return table[name]


OPT_IN = frozenset(
    {entry.metric.name for entry in step_metrics.AVAILABLE.values()}
    | {"ddpmon_step_reruns"}  # a counter's family, as the exposition parser names it
    | {"ddpmon_update_ratio", "ddpmon_logit_max", "ddpmon_loss_spike_unrecovered_step"}
)
"""What an agent exports only when asked: the per-step metrics (``Config.step_metrics``), the
reruns' counter (``on_nonfinite='rerun'``), the per-group update ratios (``update_series``) and
max logits (``logit_modules``); and what exists only while it lasts (an unrecovered spike)."""


def exports(family: str, m: RankModel, profile: str) -> bool:
    """Whether rank ``m`` exports ``family`` at all: the synthetic NaN origin alone has a
    first-non-finite info series; under ``series_profile=large`` only rank 0 exports the group
    norms (``ddpmon.export.collector.exports_group_norms`` for a DDP run); the opt-in
    series (``step_metrics``, the reruns' counter) are off, as by default."""
    if family in OPT_IN:
        return False
    if family == "ddpmon_grad_first_nonfinite_info":
        return m.origin
    if family == "ddpmon_grad_group_norm":
        return exports_group_norms(profile, m.rank, "ddp")
    return True


class Sink:
    """Where the synthetic samples go: an OpenMetrics file (promtool) or, in batches, a
    VictoriaMetrics import endpoint (timestamps in milliseconds there)."""

    def __init__(self, path: Path | None = None, import_url: str | None = None) -> None:
        self.path, self.import_url = path, import_url
        self.millis = import_url is not None
        self._file = open(path, "w", buffering=1 << 22) if path is not None else None  # noqa: SIM115
        self._batch: list[str] = []
        self._size = 0
        self.post_s = 0.0
        """Seconds spent in the store's import calls (its ingestion time)."""

    def family(self, name: str, kind: str) -> None:
        if self._file is not None:
            self._file.write(f"# TYPE {name} {kind}\n")

    def write(self, lines: list[str]) -> None:
        if self._file is not None:
            self._file.writelines(lines)
            return
        self._batch.extend(lines)
        self._size += len(lines)
        if self._size >= 400_000:
            self.flush()

    def flush(self) -> None:
        if not self._batch:
            return
        body = "".join(self._batch).encode()
        self._batch, self._size = [], 0
        t0 = time.perf_counter()
        req = urllib.request.Request(self.import_url, data=body, method="POST")
        with urllib.request.urlopen(req, timeout=600) as resp:
            resp.read()
        self.post_s += time.perf_counter() - t0

    def close(self) -> None:
        if self._file is not None:
            self._file.write("# EOF\n")
            self._file.close()
        else:
            self.flush()


def write_openmetrics(
    path: Path | Sink, *, ranks: int, hours: float, interval: int, groups: int, end: int,
    profile: str = "full",
) -> tuple[int, int]:
    """Write the samples (to a file at ``path``, or into a ``Sink``); return
    ``(series, samples)``."""
    sink = path if isinstance(path, Sink) else Sink(path)
    scale = 1000 if sink.millis else 1
    rng = random.Random(1024)
    models = [RankModel(r, ranks, rng) for r in range(ranks)]
    templates = golden_templates(groups)
    points = int(hours * 3600 // interval) + 1
    start = end - (points - 1) * interval
    nonfinite_at = int(points * 0.66)
    series = samples = 0
    families: dict[str, list[Template]] = {}
    for t in templates:
        families.setdefault(t.family, []).append(t)
    try:
        for family, temps in families.items():
            kind = {"unknown": "gauge"}.get(temps[0].kind, temps[0].kind)
            sink.family(family, kind)
            chosen = [m for m in models if exports(family, m, profile)]
            per_rank = [
                [(t, f"{t.sample}{series_labels(t, m, ranks)} ") for t in temps] for m in chosen
            ]
            series += sum(len(x) for x in per_rank)
            for i in range(points):
                if family == "ddpmon_grad_first_nonfinite_info" and i < nonfinite_at:
                    continue
                ts = start + i * interval
                seconds = i * interval
                lines = []
                for m, rows in zip(chosen, per_rank, strict=True):
                    for t, prefix in rows:
                        if t.sample == "ddpmon_world_size":
                            v: float = ranks
                        elif t.sample == "ddpmon_last_step_timestamp_seconds":
                            v = ts - 0.5
                        else:
                            v = value(t, m, i, seconds, nonfinite_at)
                        # Unix timestamps need more digits than .6g (1000 s steps).
                        text = f"{v:.6g}" if abs(v) < 1e6 else f"{v:.13g}"
                        lines.append(f"{prefix}{text} {ts * scale}\n")
                sink.write(lines)
                samples += len(lines)
        # `up`, one per target, as Prometheus records it for every scrape.
        sink.family("up", "gauge")

        def up_labels(m: RankModel) -> str:
            labels = sorted({"job": "ddpmon", **target_labels(m)}.items())
            return ",".join(f'{k}="{v}"' for k, v in labels)

        ups = [f"up{{{up_labels(m)}}} 1 " for m in models]
        series += len(ups)
        for i in range(points):
            ts = start + i * interval
            sink.write([f"{u}{ts * scale}\n" for u in ups])
            samples += len(ups)
    finally:
        sink.close()
    return series, samples


def _get(url: str, path: str, params: dict[str, str]) -> tuple[float, dict]:
    full = f"{url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    t0 = time.perf_counter()
    with urllib.request.urlopen(full, timeout=120) as resp:
        body = json.load(resp)
    return time.perf_counter() - t0, body


def run_queries(
    url: str, *, end: int, hours: float, interval: int, repeats: int, detail_rank: str
) -> Iterator[dict]:
    rate_interval = f"{4 * interval}s"
    for doc in dashboards.render_all().values():
        rank: str | list[str] = "All" if doc["uid"] == dashboards.OVERVIEW_UID else detail_rank
        queries = grafana.panel_queries(
            doc,
            {"run": RUN, "rank": rank},
            rate_interval=rate_interval,
            interval=f"{interval}s",
            range_=f"{int(hours * 3600)}s",
        )
        for q in queries:
            if q.instant:
                path, params = "query", {"query": q.expr, "time": str(end)}
            else:
                path = "query_range"
                params = {
                    "query": q.expr,
                    "start": str(end - int(hours * 3600)),
                    "end": str(end),
                    "step": f"{interval}s",
                }
            times, body = [], {}
            for _ in range(repeats):
                seconds, body = _get(url, path, params)
                if body.get("status") != "success":
                    raise RuntimeError(f"{q.title}: {q.expr}: {body}")
                times.append(seconds)
            yield {
                "dashboard": doc["title"],
                "panel": q.title,
                "ref": q.ref_id,
                "coverage": q.coverage,
                "expr": q.expr,
                "median_s": statistics.median(times),
                "max_s": max(times),
                "series": len(body["data"]["result"]),
            }


class VictoriaMetrics:
    """Single-node VictoriaMetrics (Debian's ``victoria-metrics``) on loopback, its query cache
    off so that repeated queries are timed as a first dashboard load."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir, self.port = workdir, port
        self.url = f"http://127.0.0.1:{port}"
        self.data = workdir / "data"
        self._process: ManagedProcess | None = None

    def start(self, timeout: float = 120.0) -> VictoriaMetrics:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            find_binary("victoria-metrics"),
            f"-storageDataPath={self.data}",
            f"-httpListenAddr=127.0.0.1:{self.port}",
            "-retentionPeriod=100y",
            "-search.disableCache",
            "-search.latencyOffset=0s",
            "-search.maxUniqueTimeseries=10000000",
            "-search.maxSamplesPerQuery=2000000000",
            "-search.maxQueryDuration=300s",
            "-memory.allowedPercent=25",
            "-dedup.minScrapeInterval=1ms",  # a rule replayed twice (--reuse) stores once
            "-loggerLevel=WARN",
        ]
        self._process = ManagedProcess("victoria-metrics", cmd, self.workdir / "vm.log")
        self._process.start()
        self._process.wait_ready(f"{self.url}/health", timeout)
        return self

    @property
    def pid(self) -> int | None:
        proc = self._process.proc if self._process else None
        return proc.pid if proc is not None else None

    def flush(self) -> None:
        """Make everything imported searchable now (VictoriaMetrics buffers for ~1 s)."""
        with urllib.request.urlopen(f"{self.url}/internal/force_flush", timeout=120) as resp:
            resp.read()

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop(timeout=60)


class PeakRss:
    """Polls a process tree's resident memory (twice a second) and keeps the peak; with
    ``limit`` bytes, kills the tree past it, so a benchmark cannot take a shared machine down.

    Memory here is anonymous + shared-memory pages (``RssAnon + RssShmem``): the file pages a
    process maps (``promtool`` maps the whole OpenMetrics file, Prometheus its blocks) count in
    its RSS but are page cache the kernel drops under pressure, and at 16,384 ranks they alone
    are 13 GB of a 14 GB RSS."""

    def __init__(self, limit: int | None = None) -> None:
        import threading

        self.limit, self.peak, self.killed = limit, 0, False
        self._pids: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, pid: int | None) -> None:
        if pid is not None:
            self._pids.append(pid)

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.5):
            total = 0
            procs = []
            for pid in list(self._pids):
                try:
                    p = psutil.Process(pid)
                    procs += [p, *p.children(recursive=True)]
                except psutil.Error:
                    continue
            for p in procs:
                total += _resident_bytes(p)
            self.peak = max(self.peak, total)
            if self.limit and total > self.limit:
                self.killed = True
                for p in procs:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def _resident_bytes(proc) -> int:
    """Anonymous + shared-memory resident bytes of ``proc`` (``PeakRss``); RSS where
    ``/proc/PID/status`` cannot say."""
    import psutil

    try:
        fields = {}
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                fields[key] = int(rest.split()[0]) * 1024
        if fields:
            return sum(fields.values())
        return proc.memory_info().rss
    except (OSError, ValueError, psutil.Error):
        return 0


def rule_group_times(url: str, end: int, repeats: int) -> list[dict]:
    """Each shipped rule group's evaluation cost at the end of the hour: its rules' queries
    run one after the other as instant queries, as a ruler runs a group (median of
    ``repeats``). Recording rules first, then alerts."""
    rows = []
    for name, text in generate_rules().items():
        if name not in (RULES_FILE, ALERTS_FILE):
            continue
        for group in yaml.safe_load(text)["groups"]:
            totals = []
            for _ in range(repeats):
                total = 0.0
                for rule in group["rules"]:
                    seconds, body = _get(url, "query", {"query": rule["expr"], "time": str(end)})
                    if body.get("status") != "success":
                        raise RuntimeError(f"{group['name']}: {rule['expr']}: {body}")
                    total += seconds
                totals.append(total)
            rows.append({
                "file": name, "group": group["name"], "rules": len(group["rules"]),
                "median_s": statistics.median(totals), "max_s": max(totals),
            })
    return rows


def rule_passes(base: Path) -> list[Path]:
    """The shipped recording rules split for a backfill: raw-series rules first, then the
    run-wide medians that read them (a backfill sees only what is already in the store)."""
    groups = yaml.safe_load(generate_rules()[RULES_FILE])["groups"]
    paths = []
    for i, keep in enumerate((lambda e: not dependent(e), dependent), start=1):
        chosen = [
            {"name": g["name"], "rules": [r for r in g["rules"] if keep(r["expr"])]}
            for g in groups
        ]
        path = base / f"rules-pass{i}.yml"
        path.write_text(yaml.safe_dump({"groups": [g for g in chosen if g["rules"]]},
                                       sort_keys=False))
        paths.append(path)
    return paths


def total_series(url: str, end: int) -> int:
    _, body = _get(url, "query", {"query": 'count({__name__=~".+"})', "time": str(end)})
    return int(float(body["data"]["result"][0]["value"][1]))


def markdown(rows: list[dict], meta: dict, rule_rows: list[dict] | None = None) -> str:
    slow = [r for r in rows if r["median_s"] > TARGET_LATENCY_S]
    vm = meta.get("store") == "victoria-metrics"
    if vm:
        how = (
            f"Streamed into VictoriaMetrics {meta['store_version']} through "
            f"`/api/v1/import/prometheus` while being generated: {meta['gen_s']:.0f} s in all, "
            f"of which {meta['ingest_s']:.0f} s in the store's import calls (its ingestion "
            "time); the shipped recording rules backfilled over the hour with `vmalert "
            f"-replay` (two passes: the run-wide medians read the per-rank records) in "
            f"{meta['rules_s']:.0f} s. Query cache off (`-search.disableCache`): "
            "every repetition is timed as a first dashboard load."
        )
    else:
        how = (
            f"Written in {meta['gen_s']:.0f} s, `promtool tsdb create-blocks-from openmetrics` "
            f"{meta['promtool_s']:.0f} s; the shipped recording rules (`ddpmon-rules.yml`, which "
            "the dashboards read for per-rank histogram quantiles, means and run-wide medians) "
            "backfilled with `promtool tsdb create-blocks-from rules` (two passes: the medians "
            f"read the per-rank records) in {meta['rules_s']:.0f} s. "
            f"Prometheus {meta['prometheus']}."
        )
    profile = meta.get("profile", "full")
    lines = [
        section(meta["ranks"], meta.get("store", "prometheus"), profile),
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Synthetic TSDB: {meta['ranks']} ranks x {meta['hours']:g} h, one sample every "
        f"{meta['interval']} s per series ({meta['samples']:,} samples; a sparse scrape keeps "
        "the synthetic file and the run short on 2 cores, and with `$__rate_interval` = 4 "
        "scrape intervals every rate window reads the same number of samples as at a 15 s "
        "scrape), the agent's series "
        f"set from `tests/golden/exposition.txt` with {meta['groups']} gradient groups (the "
        "default cap"
        + (", from rank 0 only: `series_profile=large`" if profile == "large" else "")
        + "), target labels `job`/`instance` and the file_sd labels "
        "`run`/`rank`/`node`/`local_rank` on every series and `up`, and `up`. "
        f"{how} Machine: {meta['cpus']} CPUs shared with other "
        f"work (load average {meta['load']} at the start); peak resident memory (anonymous) "
        f"of the store {meta.get('peak_rss', 0) / 2**30:.1f} GiB"
        + (f", of promtool {meta['promtool_rss'] / 2**30:.1f} GiB" if meta.get("promtool_rss")
           else "")
        + ".",
        "",
        f"**Series: {meta['series']:,} from the agents** (target <= "
        f"{target_series(meta['ranks']):,}; "
        f"{meta['series'] / meta['ranks']:.0f} per rank), {meta['tsdb_series']:,} in the store "
        f"with the recorded series; **on disk: {meta['tsdb_bytes'] / 1e6:.0f} MB** (the hour, "
        "recording rules included). "
        f"**Slowest query: {max(r['median_s'] for r in rows):.3f} s** (target <= "
        f"{TARGET_LATENCY_S:g} s); {len(slow)} of {len(rows)} queries over the target.",
        "",
    ]
    if rule_rows:
        interval = meta["interval"]
        lines += [
            "Rule groups at the end of the hour (each rule's query run as an instant query, "
            "one after the other, as a ruler evaluates a group; median of "
            f"{meta['repeats']}), against a {interval} s evaluation interval:",
            "",
            "| file | group | rules | duration s | share of the interval |",
            "|---|---|---:|---:|---:|",
        ]
        for r in rule_rows:
            lines.append(
                f"| {r['file']} | {r['group']} | {r['rules']} | {r['median_s']:.3f} "
                f"({r['max_s']:.3f}) | {r['median_s'] / interval:.1%} |"
            )
        lines.append("")
    lines += [
        "Range queries cover the last hour with step = scrape interval "
        f"({meta['interval']} s) and `$__rate_interval` = {4 * meta['interval']} s (Grafana: "
        "4 x scrape interval); instant queries (tables) run at the end of the hour. Overview: "
        f"run = the run, rank = All; rank detail: rank {meta['ranks'] // 7} (the synthetic "
        "origin of non-finite gradients). Latency is the client-side wall time "
        f"of the HTTP call, median of {meta['repeats']} runs (max in brackets). Series = series "
        "returned, i.e. what Grafana has to draw.",
        "",
        "| dashboard | panel | query | latency s | series |",
        "|---|---|---|---:|---:|",
    ]
    for r in rows:
        board = r["dashboard"].replace("ddpmon / ", "")
        lines.append(
            f"| {board} | {r['panel']} | {r['ref']} | {r['median_s']:.3f} ({r['max_s']:.3f}) "
            f"| {r['series']} |"
        )
    return "\n".join(lines) + "\n"


def write_section(text: str, ranks: int = 1024, store: str = "prometheus",
                  profile: str = "full") -> None:
    """Replace (or append) only this benchmark's section of RESULTS.md (one per rank count,
    store and profile)."""
    current = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    head = section(ranks, store, profile)
    pattern = re.compile(rf"^{re.escape(head)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(current):
        new = pattern.sub(lambda _m: text + "\n", current)
    else:
        new = current.rstrip("\n") + "\n\n" + text
    RESULTS.write_text(new.rstrip("\n") + "\n")


def _queries(url: str, args: argparse.Namespace, end: int) -> list[dict]:
    rows = []
    for row in run_queries(
        url, end=end, hours=args.hours, interval=args.interval,
        repeats=args.repeats, detail_rank=str(args.ranks // 7),
    ):
        rows.append(row)
        print(f"{row['median_s']:7.3f} s {row['series']:6d} series  "
              f"{row['dashboard'][9:]} / {row['panel']} {row['ref']}", flush=True)
    return rows


def _on_prometheus(base: Path, args: argparse.Namespace, end: int, meta: dict,
                   rss: PeakRss) -> tuple[list[dict], list[dict]]:
    prom_dir = base / "prometheus"
    data = prom_dir / "data"
    saved = base / "blocks.json"
    if args.reuse and saved.exists():  # blocks from an earlier run: no file, no promtool
        meta.update(json.loads(saved.read_text()))
        end = meta["end"]
        for old in base.glob("rules-blocks-*"):  # a backfill's output not moved into the data
            shutil.rmtree(old)
        return _prometheus_rules_and_queries(base, args, end, meta, rss)
    shutil.rmtree(data, ignore_errors=True)
    (base / "rules.json").unlink(missing_ok=True)
    om = base / "metrics.om"
    t0 = time.perf_counter()
    meta["series"], meta["samples"] = write_openmetrics(
        om, ranks=args.ranks, hours=args.hours, interval=args.interval,
        groups=args.groups, end=end, profile=args.series_profile,
    )
    meta["gen_s"] = time.perf_counter() - t0
    print(f"wrote {meta['samples']:,} samples of {meta['series']:,} series "
          f"({om.stat().st_size / 1e6:.0f} MB) in {meta['gen_s']:.1f} s", flush=True)
    data.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    promtool = subprocess.Popen(
        [find_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics", "-q",
         str(om), str(data)],
    )
    tool_rss = PeakRss(rss.limit)
    tool_rss.watch(promtool.pid)
    try:
        if promtool.wait(timeout=3600) != 0:
            raise RuntimeError(
                "promtool create-blocks-from openmetrics failed"
                + (f": killed past {rss.limit / 2**30:.0f} GiB" if tool_rss.killed else "")
            )
    finally:
        tool_rss.stop()
    meta["promtool_s"] = time.perf_counter() - t0
    meta["promtool_rss"] = tool_rss.peak
    om.unlink()
    print(f"promtool created blocks in {meta['promtool_s']:.1f} s "
          f"(peak anonymous RSS {tool_rss.peak / 2**30:.1f} GiB)", flush=True)
    meta["end"] = end
    keys = ("series", "samples", "gen_s", "promtool_s", "promtool_rss", "end")
    saved.write_text(json.dumps({k: meta[k] for k in keys}))
    return _prometheus_rules_and_queries(base, args, end, meta, rss)


# A backfill's range queries read a whole hour of every rank at once: at 16,384 ranks past
# Prometheus's 2 min query timeout and 50 M samples per query (which a live ruler, running
# instant queries, never reaches). The dashboards' own queries run with the defaults.
BACKFILL_FLAGS = ["--query.timeout=30m", "--query.max-samples=1000000000"]


def _prometheus_rules_and_queries(base: Path, args: argparse.Namespace, end: int, meta: dict,
                                  rss: PeakRss) -> tuple[list[dict], list[dict]]:
    prom_dir = base / "prometheus"
    data = prom_dir / "data"
    version = subprocess.run(
        [find_binary("prometheus"), "--version"], capture_output=True, text=True, check=True
    )
    meta["prometheus"] = version.stdout.split()[2] if version.stdout else "?"
    sd = base / "sd"
    sd.mkdir(exist_ok=True)
    # The dashboards read per-rank histogram quantiles and run-wide medians from the shipped
    # recording rules: backfill them over the same hour, as a Prometheus running them would
    # have, in two passes (the medians read the first pass's records). Prometheus merges the
    # backfilled blocks into the data on its next start, so a --reuse run keeps them when the
    # rules are unchanged (rules.json) and cannot take them out when they changed.
    passes = rule_passes(base)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in passes)).hexdigest()
    marker = base / "rules.json"
    if marker.exists():
        done = json.loads(marker.read_text())
        if done.get("sha256") != digest:
            raise RuntimeError(f"{data} holds recorded series of other rules: run without --reuse")
        meta["rules_s"] = done["rules_s"]
        passes = []
    t0 = time.perf_counter()
    for i, rules in enumerate(passes, start=1):
        prom = Prometheus(prom_dir, sd_dir=sd, flags=BACKFILL_FLAGS)
        prom.start(timeout=600)
        rss.watch(prom._process.proc.pid if prom._process and prom._process.proc else None)
        backfill = base / f"rules-blocks-{i}"
        try:
            done = subprocess.run(
                [find_binary("promtool"), "tsdb", "create-blocks-from", "rules", "-q",
                 f"--start={end - int(args.hours * 3600)}", f"--end={end}",
                 f"--url={prom.url}", f"--output-dir={backfill}",
                 f"--eval-interval={args.interval}s", str(rules)],
                timeout=3600, capture_output=True, text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"promtool create-blocks-from rules (pass {i}) failed: "
                                   f"{(done.stdout + done.stderr)[-2000:]}")
        finally:
            prom.stop()
        for block in backfill.iterdir():
            if block.is_dir():
                shutil.move(str(block), data / block.name)
    if passes:
        meta["rules_s"] = time.perf_counter() - t0
        marker.write_text(json.dumps({"sha256": digest, "rules_s": meta["rules_s"]}))
    print(f"promtool backfilled the recording rules in {meta['rules_s']:.1f} s", flush=True)
    meta["tsdb_bytes"] = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
    print(f"TSDB on disk: {meta['tsdb_bytes'] / 1e6:.0f} MB", flush=True)
    prom = Prometheus(prom_dir, sd_dir=sd)
    prom.start(timeout=600)
    rss.watch(prom._process.proc.pid if prom._process and prom._process.proc else None)
    try:
        meta["tsdb_series"] = total_series(prom.url, end)
        rows = _queries(prom.url, args, end)
        rule_rows = rule_group_times(prom.url, end, args.repeats) if args.rule_times else []
    finally:
        prom.stop()
    return rows, rule_rows


def _on_victoria_metrics(base: Path, args: argparse.Namespace, end: int, meta: dict,
                         rss: PeakRss) -> tuple[list[dict], list[dict]]:
    from ddpmon.services import free_port

    version = subprocess.run(  # Debian's build prints no -version: ask the package
        ["dpkg-query", "-W", "-f=${Version}", "victoria-metrics"], capture_output=True, text=True
    )
    meta["store_version"] = version.stdout.strip() or "(version unknown)"
    vm = VictoriaMetrics(base / "victoria-metrics", free_port()).start()
    rss.watch(vm.pid)
    try:
        saved = base / "import.json"
        if args.reuse and saved.exists():  # the store's data from an earlier run: no import
            meta.update(json.loads(saved.read_text()))
            end = meta["end"]
        else:
            sink = Sink(import_url=f"{vm.url}/api/v1/import/prometheus")
            t0 = time.perf_counter()
            meta["series"], meta["samples"] = write_openmetrics(
                sink, ranks=args.ranks, hours=args.hours, interval=args.interval,
                groups=args.groups, end=end, profile=args.series_profile,
            )
            vm.flush()
            meta["gen_s"] = time.perf_counter() - t0
            meta["ingest_s"] = sink.post_s
            meta["end"] = end
            keys = ("series", "samples", "gen_s", "ingest_s", "end", "load")
            saved.write_text(json.dumps({k: meta[k] for k in keys}))
        print(f"imported {meta['samples']:,} samples of {meta['series']:,} series in "
              f"{meta['gen_s']:.1f} s ({meta['ingest_s']:.1f} s in import calls)", flush=True)
        start = end - int(args.hours * 3600)
        iso = "%Y-%m-%dT%H:%M:%SZ"
        t0 = time.perf_counter()
        for rules in rule_passes(base):
            replay = subprocess.run(
                [find_binary("vmalert"), f"-rule={rules}", f"-datasource.url={vm.url}",
                 f"-remoteWrite.url={vm.url}", f"-evaluationInterval={args.interval}s",
                 f"-replay.timeFrom={time.strftime(iso, time.gmtime(start))}",
                 f"-replay.timeTo={time.strftime(iso, time.gmtime(end))}",
                 "-replay.disableProgressBar", "-replay.rulesDelay=0s",
                 "-replay.maxDatapointsPerQuery=100000", "-loggerLevel=WARN",
                 f"-httpListenAddr=127.0.0.1:{free_port()}"],
                capture_output=True, text=True, timeout=3600,
            )
            if replay.returncode != 0:
                raise RuntimeError(f"vmalert -replay failed: {replay.stderr[-3000:]}")
            time.sleep(2)  # vmalert's remote write flushes on exit; let the store take it in
            vm.flush()
        meta["rules_s"] = time.perf_counter() - t0
        print(f"vmalert replayed the recording rules in {meta['rules_s']:.1f} s", flush=True)
        meta["tsdb_bytes"] = sum(f.stat().st_size for f in vm.data.rglob("*") if f.is_file())
        print(f"store on disk: {meta['tsdb_bytes'] / 1e6:.0f} MB", flush=True)
        meta["tsdb_series"] = total_series(vm.url, end)
        rows = _queries(vm.url, args, end)
        rule_rows = rule_group_times(vm.url, end, args.repeats) if args.rule_times else []
    finally:
        vm.stop()
    return rows, rule_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--hours", type=float, default=1.0)
    p.add_argument("--interval", type=int, default=60, help="seconds between samples")
    p.add_argument("--groups", type=int, default=Config().max_groups)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--store", choices=STORES, default="prometheus",
                   help="prometheus (promtool blocks) or victoria-metrics (streamed import)")
    p.add_argument("--series-profile", choices=SERIES_PROFILES, default="full",
                   help="the agents' series_profile: large exports group norms from rank 0 only")
    p.add_argument("--rule-times", action="store_true",
                   help="also time every shipped rule group at the end of the hour")
    p.add_argument("--max-rss-gib", type=float, default=16.0,
                   help="kill the store or promtool past this resident memory (shared machine)")
    p.add_argument("--workdir", default=None, help="keep files here instead of a temp dir")
    p.add_argument("--reuse", action="store_true",
                   help="query the store (victoria-metrics) or the blocks (prometheus) kept in "
                   "--workdir by an earlier run: no generation, no import; rules backfilled again")
    p.add_argument("--write-results", action="store_true",
                   help=f"update {SECTION!r} (or the section of --ranks/--store/--series-profile)")
    args = p.parse_args(argv)

    base = Path(args.workdir or tempfile.mkdtemp(prefix="ddpmon-dash-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    end = int(time.time()) // args.interval * args.interval - args.interval
    meta = {
        "command": "python benchmarks/dashboards_scale.py "
        + " ".join(a for a in (argv if argv is not None else sys.argv[1:])),
        "ranks": args.ranks,
        "hours": args.hours,
        "interval": args.interval,
        "groups": args.groups,
        "repeats": args.repeats,
        "store": args.store,
        "profile": args.series_profile,
        "cpus": os.cpu_count(),
        "load": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
    rss = PeakRss(int(args.max_rss_gib * 2**30))
    try:
        run = _on_victoria_metrics if args.store == "victoria-metrics" else _on_prometheus
        rows, rule_rows = run(base, args, end, meta, rss)
    finally:
        rss.stop()
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
    if rss.killed:
        print(f"the store went past {args.max_rss_gib:g} GiB and was stopped", file=sys.stderr)
        return 2
    meta["peak_rss"] = rss.peak
    text = markdown(rows, meta, rule_rows)
    print(text)
    if args.write_results:
        write_section(text, args.ranks, args.store, args.series_profile)
        print(f"updated {RESULTS}")
    slow = [r for r in rows if r["median_s"] > TARGET_LATENCY_S]
    return 1 if slow or meta["series"] > target_series(args.ranks) else 0


if __name__ == "__main__":
    sys.exit(main())
