"""One synthetic hour in two engines: Prometheus and VictoriaMetrics, each with its own ruler's
recorded series, for comparing every rule and panel query (tests/scaleout/test_engines.py).

The data is the dashboard benchmark's (``benchmarks/dashboards_scale.py``: the golden
exposition's series set per rank, stragglers, one NaN origin, a duplicated shard), at a small
size. Prometheus gets it through ``promtool tsdb create-blocks-from openmetrics`` and its
records through ``promtool tsdb create-blocks-from rules`` (Prometheus' own rule evaluation);
VictoriaMetrics through ``/api/v1/import/prometheus`` and its records through ``vmalert``'s
replay mode (vmalert's own evaluation, written back over remote write), both evaluating the
shipped rule file at the same aligned timestamps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

import yaml

from ddpmon.mixin import render
from ddpmon.services import Prometheus, VictoriaMetrics, find_binary
from ddpmon.services.process import StackError
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PREROLL_S = 15 * 60

Series = dict[tuple[tuple[str, str], ...], dict[float, float]]
"""``{sorted labels without __name__: {timestamp: value}}``."""


def bench() -> ModuleType:
    """``benchmarks/dashboards_scale.py`` as a module (it is a script, not a package)."""
    name = "dashboards_scale"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def reads(expr: str, name: str) -> bool:
    """Whether ``expr`` reads the series ``name`` (a whole name, not a prefix of a longer one)."""
    return re.search(rf"(?<![\w:]){re.escape(name)}(?![\w:])", expr) is not None


def derived(groups: list[dict], base: set[str]) -> set[str]:
    """``base`` plus every record that reads one of them, directly or through other records."""
    rules = [(r["record"], r["expr"]) for g in groups for r in g["rules"]]
    found = set(base)
    while more := {rec for rec, e in rules if rec not in found and any(reads(e, n) for n in found)}:
        found |= more
    return found


def _levels(groups: list[dict]) -> list[list[dict]]:
    """Rule groups in evaluation levels: records over raw series only, then records that read
    only those, and so on (a backfill sees only what earlier passes stored)."""
    names = {r["record"] for g in groups for r in g["rules"]}
    done: set[str] = set()
    levels = []
    left = [dict(g, rules=list(g["rules"])) for g in groups]
    while any(g["rules"] for g in left):
        level = []
        for g in left:
            ready = [
                r for r in g["rules"]
                if all(n in done for n in names if reads(r["expr"], n))
            ]
            if ready:
                level.append({**g, "rules": ready})
                g["rules"] = [r for r in g["rules"] if r not in ready]
        if not level:
            raise ValueError("recording rules read each other in a cycle")
        done |= {r["record"] for g in level for r in g["rules"]}
        levels.append(level)
    return levels


def _rules_file(path: Path, groups: list[dict], interval: int) -> Path:
    """The groups with ``interval`` set (vmalert's replay steps by the group's interval)."""
    timed = [{**g, "interval": f"{interval}s"} for g in groups]
    path.write_text(yaml.safe_dump({"groups": timed}, sort_keys=False))
    return path


def _rfc3339(t: int) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Engine:
    """A query API over the synthetic hour; ``name`` is ``prometheus`` or ``victoriametrics``."""

    name: str
    url: str
    extra: dict[str, str]

    def get(self, path: str, **params: str) -> dict:
        """The decoded body, also for errors (``status`` says which)."""
        query = urllib.parse.urlencode({**params, **self.extra})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=60) as r:
                return json.load(r)
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            try:
                return json.loads(body)
            except json.JSONDecodeError:
                return {"status": "error", "error": f"HTTP {exc.code}: {body[:500]}"}


@dataclass
class Hour:
    """Both engines over the same hour: ``start``/``end`` (aligned to ``step``); the data
    begins ``PREROLL_S`` earlier."""

    prometheus: Engine
    victoria: Engine
    start: int
    end: int
    step: int
    ranks: int
    run: str
    rules: list[dict]
    phase: float
    """How long after a sample Prometheus stored the records made from it: its rule groups'
    largest evaluation offset (see :func:`record_phase`); vmalert stores them at the sample."""

    @property
    def engines(self) -> tuple[Engine, Engine]:
        return self.prometheus, self.victoria


def parse(body: dict) -> Series:
    """A query result (matrix or vector) as :data:`Series`; NaN and infinities kept."""
    out: Series = {}
    data = body["data"]
    for row in data["result"]:
        key = tuple(sorted((k, v) for k, v in row["metric"].items() if k != "__name__"))
        points = row["values"] if "values" in row else [row["value"]]
        out[key] = {float(t): float(v) for t, v in points}
    return out


def _to_ms_exposition(om: Path, out: Path) -> None:
    """OpenMetrics (timestamps in seconds) -> Prometheus text with millisecond timestamps."""
    with open(om) as src, open(out, "w", buffering=1 << 22) as dst:
        for line in src:
            if line.startswith("#"):
                if line.startswith("# TYPE"):
                    dst.write(line)
                continue
            head, ts = line.rstrip("\n").rsplit(" ", 1)
            dst.write(f"{head} {int(ts) * 1000}\n")


def _promtool(*args: str) -> None:
    proc = subprocess.run(
        [find_binary("promtool"), "tsdb", *args], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"promtool tsdb {args[0]} {args[1]}: {proc.stderr[-2000:]}")


def _backfill_prometheus(
    workdir: Path, om: Path, groups: list[dict], start: int, end: int, step: int, port: int
) -> None:
    data = workdir / "prometheus" / "data"
    data.mkdir(parents=True)
    _promtool("create-blocks-from", "openmetrics", "-q", str(om), str(data))
    sd = workdir / "sd"
    sd.mkdir(exist_ok=True)
    # promtool evaluates one file against the TSDB as it is: records that read records need
    # the earlier passes' blocks in place.
    for i, part in enumerate(_levels(groups)):
        if not part:
            continue
        rules = _rules_file(workdir / f"rules-pass{i}.yml", part, step)
        out = workdir / f"rule-blocks-{i}"
        prom = _started(lambda p: Prometheus(workdir / "prometheus", sd_dir=sd, port=p), port)
        try:
            _promtool(
                "create-blocks-from", "rules", "-q", f"--start={_rfc3339(start)}",
                f"--end={_rfc3339(end)}",
                f"--url={prom.url}", f"--output-dir={out}", f"--eval-interval={step}s",
                str(rules),
            )
        finally:
            prom.stop()
        for block in out.iterdir():
            if block.is_dir():
                shutil.move(str(block), data / block.name)


def _replay_victoria(
    workdir: Path, vm: VictoriaMetrics, groups: list[dict], start: int, end: int, step: int
) -> None:
    # One pass per level, as for promtool: records that read records need them stored.
    for i, part in enumerate(_levels(groups)):
        if not part:
            continue
        rules = _rules_file(workdir / f"rules-vmalert-pass{i}.yml", part, step)
        proc = subprocess.run(
            [
                find_binary("vmalert"), f"-rule={rules}", f"-datasource.url={vm.url}",
                f"-remoteWrite.url={vm.url}", f"-replay.timeFrom={_rfc3339(start)}",
                f"-replay.timeTo={_rfc3339(end)}", f"-evaluationInterval={step}s",
                # Replay steps by -datasource.queryStep (default 5m), not the group's interval.
                f"-datasource.queryStep={step}s", "-replay.disableProgressBar",
                "-replay.rulesDelay=0s",
                # count_values over a long range query exceeds MetricsQL's per-aggregation
                # series limit ("too many timeseries after aggregation"): short chunks. Live
                # evaluation is one instant query per interval and never meets it.
                "-replay.maxDatapointsPerQuery=5", "-remoteWrite.flushInterval=1s",
                "-loggerLevel=WARN",
                "-httpListenAddr=127.0.0.1:0",
            ],
            capture_output=True, text=True, timeout=600,
        )
        if proc.returncode != 0:
            err = proc.stderr
            raise RuntimeError(f"vmalert replay failed: {err[:1500]} ... {err[-800:]}")
        vm.flush()


@contextlib.contextmanager
def synthetic_hour(
    workdir: Path, *, ranks: int, interval: int, groups: int, ports: tuple[int, int]
) -> Iterator[Hour]:
    """Both engines serving the same synthetic hour with their own ruler's records."""
    b = bench()
    step = interval
    end = int(time.time()) // step * step - step
    start = end - 3600
    # The data and the records begin PREROLL_S before the hour compared: every window of the
    # rules and panels (up to 15 m; the hour-long ones end at the hour's end) then holds data
    # that began before it, as in a run that has been going for a while.
    data_start = start - PREROLL_S
    om = workdir / "metrics.om"
    b.write_openmetrics(
        om, ranks=ranks, hours=(end - data_start) / 3600, interval=interval, groups=groups,
        end=end,
    )
    rule_groups = yaml.safe_load(render.generate()[render.RULES_FILE])["groups"]
    _backfill_prometheus(workdir, om, rule_groups, data_start, end, step, ports[0])
    text = workdir / "metrics.prom"
    _to_ms_exposition(om, text)
    om.unlink()
    vm = prom = None
    try:
        vm = _started(lambda p: VictoriaMetrics(
            workdir / "victoria", port=p, extra_args=["-search.disableCache"]), ports[1])
        with open(text, "rb") as body:
            req = urllib.request.Request(
                f"{vm.url}/api/v1/import/prometheus", data=body, method="POST",
                headers={"Content-Length": str(text.stat().st_size)},
            )
            with urllib.request.urlopen(req, timeout=300):
                pass
        vm.flush()
        _replay_victoria(workdir, vm, rule_groups, data_start, end, step)
        prom = _started(lambda p: Prometheus(workdir / "prometheus", sd_dir=workdir / "sd",
                                             port=p), ports[0], timeout=120)
        prometheus = Engine("prometheus", prom.url, {})
        yield Hour(
            prometheus=prometheus,
            victoria=Engine("victoriametrics", vm.url, {"nocache": "1"}),
            start=start, end=end, step=step, ranks=ranks, run=b.RUN,
            rules=rule_groups, phase=record_phase(prometheus, step, at=end - step),
        )
    finally:
        for server in (prom, vm):
            if server is not None:
                server.stop()


def record_phase(prometheus: Engine, step: int, at: int) -> float:
    """The largest offset, within the interval, at which Prometheus' backfill evaluated a rule
    group: its evaluator puts each group at an offset hashed from the group's name and file
    (here a temporary path, so it changes from run to run, anywhere in [0, step)). A record
    made from the sample at t is stored at t + offset; queried at t + this phase, every group's
    record from that sample is there, and no later sample is."""
    window = f"{2 * step}s"  # the stored samples themselves, with their own timestamps
    body = prometheus.get("query", query=f'{{__name__=~".+:.+"}}[{window}]', time=str(at))
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus: {body.get('error', body)}")
    offsets = {round(float(t) % step, 3)
               for row in body["data"]["result"] for t, _ in row["values"]}
    if not offsets:
        raise RuntimeError(f"Prometheus holds no backfilled record at {at}")
    return max(offsets)


def _started(make, port: int, timeout: float = 30.0, tries: int = 3):
    """``make(port).start()``; on another free port when that one was taken before ours bound
    it (the server then says so and exits: ``wait_ready`` never takes another's answer)."""
    for attempt in range(tries):
        server = make(port)
        try:
            return server.start(timeout=timeout)
        except StackError as exc:
            server.stop()
            if "address already in use" not in str(exc).lower() or attempt == tries - 1:
                raise
            port = free_port()
    raise AssertionError("unreachable")


def close(a: float, b: float, rel: float, abs_: float = 1e-9) -> bool:
    """Equal within ``rel`` (relative) or ``abs_``; NaN equals NaN, infinities equal by sign."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= max(abs_, rel * max(abs(a), abs(b)))
