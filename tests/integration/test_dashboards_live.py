"""Issue #4 item 5: every dashboard query has data in a live run, for every rank it should.

No Grafana runs here, so this is the proof that the dashboards work: a real Prometheus (shipped
config and recording/alert rules, 1s scrape/eval) scrapes a real 2-rank gloo demo found through
file_sd. Rank 1 gets NaN gradients at step 150, so the numerics panels that only have data after a
fault (non-finite origin table, non-finite/skipped annotations) are exercised too, and reads rank
0's data shard from step 160 on, so both ranks count identical batches (the agent samples every
10th step) and the identical-batch panels have data. Rank 0 recomputes goodput every 2 s and both
ranks count their FLOPs per step automatically against a given peak, so the goodput and MFU
panels (and the run's throughput records) have data. Every panel
query of both dashboards, variables resolved as Grafana resolves them, then runs through the HTTP
API over the run so far:

- per-rank queries must return a series for every rank of the run (overview, rank = All) or for
  the selected rank (rank detail, rank = 1);
- run-level queries must return data; fault queries must name rank 1;
- identical-batch queries must name ranks 0 and 1 (per rank) or count 2 ranks (the stat), and
  must show nothing at the first scrape, before the duplicated shard;
- "quiet" queries (down or missing ranks) must return nothing: every rank is up;
- "any" queries (per-rank alerts that take minutes, norms compared at the same step) must run.

The GradScaler absorbs the NaN, which never pages with the shipped rules; so that the alert
annotation has something to draw, this test's rules page on any non-finite step
(``nonfinite_persistent_steps=0``).

Exempt, with the reason checked rather than assumed: queries that need a GPU (torch allocator,
NVML; the test asserts ``ddpmon_collector_success`` is 0 for them on this machine) and the DCGM
join (needs dcgm-exporter on a GPU node).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ddpmon.mixin import dashboards as d
from ddpmon.mixin import names
from ddpmon.mixin.config import MixinConfig
from tests.support import grafana
from tests.support.demo import DemoRun
from tests.support.stack import WebhookReceiver, live_stack, wait_for, wait_for_scrapes

pytestmark = pytest.mark.timeout(240)

RUN = "dash"
RANKS = {"0", "1"}
NAN_STEP = 150  # late enough that Prometheus has scraped both ranks before the fault
DUP_STEP = 160  # a sampled step (every 10th) after the NaN step; 4 samples before step 190
DUP_RANKS = {"0", "1"}  # rank 1 reads rank 0's shard: both see the other's identical gradients
STEPS = 2000  # far more than the test needs: the run must still be going when it queries
STEP_DELAY = 0.05
CHECKPOINT_EVERY = 40  # the demo saves checkpoints, so the Checkpoints annotation has data
RUN_ONLY_ANNOTATIONS = {"Restarts"}  # no restart in this run: only checked to run
# Goodput recomputed every 2 s (rank 0), and a peak so that MFU is exported (the demo's FLOPs
# per step are counted automatically, its samples per step read from the batch).
FIGURES_ENV = {"DDPMON_GOODPUT_SECONDS": "2", "DDPMON_PEAK_FLOPS": "1e12"}
# Grafana: $__rate_interval = max(4 x scrape interval, step + scrape interval); scrape is 1s.
RATE_INTERVAL = "4s"


class CheckpointingRun(DemoRun):
    """The demo saving a checkpoint every CHECKPOINT_EVERY steps (rank 0)."""

    def command(self) -> list[str]:
        return [*super().command(), "--checkpoint-every", str(CHECKPOINT_EVERY)]


def _ranks(result: list[dict]) -> set[str]:
    return {s["metric"].get("rank") for s in result if s["metric"].get("rank") is not None}


def _values(result: list[dict]) -> set[str]:
    """Last value of every series (instant or range result)."""
    return {(s.get("value") or s["values"][-1])[1] for s in result}


def test_every_panel_query_has_data_for_every_rank(tmp_path: Path) -> None:
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    cfg = MixinConfig().replace(nonfinite_persistent_steps=0)
    with (
        WebhookReceiver() as hook,
        live_stack(tmp_path / "stack", sd_dir, cfg, hook.url) as stack,
        CheckpointingRun(
            tmp_path / "demo", sd_dir, STEPS, STEP_DELAY,
            [f"nan@rank1:step{NAN_STEP}", f"dup-data@rank1:step{DUP_STEP}"],
            run_id=RUN, env=FIGURES_ENV,
        ) as demo,
    ):
        prom = stack.prometheus
        sel = f'{{run="{RUN}"}}'
        # Both ranks scraped before the fault, so the counters' increase is seen (a counter
        # that is already 1 at its first scrape shows no increase, and no alert fires).
        first = wait_for(
            lambda: (r := prom.query(f"ddpmon_step{sel}")) and _ranks(r) == RANKS and r,
            timeout=120,
            what=f"both ranks scraped: {demo.log_tail(5)}",
        )
        assert max(float(s["value"][1]) for s in first) < NAN_STEP, "demo outran the scrapes"
        healthy_at = time.time()  # every sample so far is from before both faults
        # Well past the fault, and the recording rules have output.
        past = f"ddpmon_step{sel} >= {NAN_STEP + 40}"
        wait_for(
            lambda: _ranks(prom.query(past)) == RANKS,
            timeout=150,
            what=f"both ranks past step {NAN_STEP + 40}: {demo.log_tail(5)}",
        )
        wait_for(
            lambda: _ranks(prom.query(f"{names.COLLECTIVE_P99}{sel}")) == RANKS
            and _ranks(prom.query(f"{names.STEP_P99}{sel}")) == RANKS
            and _ranks(prom.query(f"{names.OWN_MEAN}{sel}")) == RANKS,
            timeout=30,
            what="recording rules evaluated for both ranks",
        )
        wait_for(
            lambda: _ranks(prom.query(f"ddpmon_mfu_ratio{sel}")) == RANKS
            and prom.query(f"ddpmon_goodput_ratio{sel}")
            and prom.query(f"{names.MFU_RUN}{sel}") and prom.query(f"{names.TOKENS_RUN_RATE}{sel}"),
            timeout=60,
            what="goodput (rank 0), MFU on both ranks and the run's throughput records",
        )
        # a few more scrapes after the fault for the rate windows
        wait_for_scrapes(prom, f"ddpmon_step{sel}", 3, timeout=60)
        end = time.time()
        start = demo.started_at or end - 60
        span = f"{int(end - start) + 1}s"

        # The GPU-only panels are exempt because these sources really are absent here.
        absent = {
            s["metric"]["collector"]: s["value"][1]
            for s in prom.query(f"ddpmon_collector_success{sel}")
        }
        assert absent["nvml"] == "0", absent  # exported, and failing: no NVML on this machine
        assert "allocator" not in absent or absent["allocator"] == "0", absent

        failures: list[str] = []
        exempt: list[str] = []
        checked = 0
        for doc in d.render_all(cfg).values():
            detail = doc["uid"] == d.DETAIL_UID
            variables = {"run": RUN, "rank": "1" if detail else "All"}
            expected = {"1"} if detail else RANKS
            queries = grafana.panel_queries(
                doc, variables, rate_interval=RATE_INTERVAL, interval="1s", range_=span
            )
            for q in queries:
                name = f"{doc['title']} / {q.title} {q.ref_id}"
                if q.coverage in (d.GPU, d.DCGM):
                    exempt.append(f"{name}: {d.EXEMPT_REASONS[q.coverage]}")
                    continue
                if q.instant:
                    result = prom.api("query", query=q.expr, time=str(end))["result"]
                else:
                    result = prom.api(
                        "query_range", query=q.expr, start=str(start), end=str(end), step="1s"
                    )["result"]
                checked += 1
                if q.coverage == d.EVERY_RANK and _ranks(result) != expected:
                    failures.append(f"{name}: ranks {sorted(_ranks(result))} != {sorted(expected)}"
                                    f"\n    {q.expr}")
                elif q.coverage == d.RUN and not result:
                    failures.append(f"{name}: no data\n    {q.expr}")
                elif q.coverage == d.QUIET and result:
                    failures.append(f"{name}: data in a healthy run: {result}\n    {q.expr}")
                elif q.coverage == d.FAULT and _ranks(result) != {"1"}:
                    failures.append(f"{name}: fault on rank 1 not shown: {result}\n    {q.expr}")
                elif q.coverage == d.DUP_DATA:
                    count = str(len(DUP_RANKS))
                    if _ranks(result) != DUP_RANKS and not (
                        not _ranks(result) and count in _values(result)
                    ):
                        failures.append(f"{name}: ranks {sorted(DUP_RANKS)} not shown: {result}"
                                        f"\n    {q.expr}")
                    # Before the duplicated shard the same query shows nothing (the stat: 0).
                    before = (
                        prom.api("query", query=q.expr, time=str(healthy_at))["result"]
                        if q.instant
                        else prom.api(
                            "query_range", query=q.expr, start=str(start),
                            end=str(healthy_at), step="1s",
                        )["result"]
                    )
                    if _ranks(before) or _values(before) - {"0"}:
                        failures.append(f"{name}: data before the fault: {before}\n    {q.expr}")
            anns = grafana.annotation_queries(doc, variables, rate_interval=RATE_INTERVAL)
            for ann, expr in anns:
                if ann == "Firing ddpmon alerts":
                    # DdpmonNonFiniteGradients (for: 0m, persistent_steps 0) fires for the
                    # absorbed NaN; poll briefly.
                    ok = wait_for(lambda e=expr: prom.query(e), timeout=30, what=ann)
                else:
                    ok = prom.api(
                        "query_range", query=expr, start=str(start), end=str(end), step="1s"
                    )["result"]
                checked += 1
                if not ok and ann not in RUN_ONLY_ANNOTATIONS:
                    failures.append(f"{doc['title']} / annotation {ann}: no data\n    {expr}")
        print(f"\n{checked} queries checked; exempt ({len(exempt)}):\n  " + "\n  ".join(exempt))
        assert checked >= 60
        assert not failures, "\n".join(failures)
