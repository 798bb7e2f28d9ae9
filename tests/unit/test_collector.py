"""Exposition: golden file, promtool lint, round trip through the parser, series budget."""

import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddpmon import metrics
from ddpmon.agent.activity import Activity
from ddpmon.export.collector import DdpmonCollector, Exposition, LiveSources
from ddpmon.job.identity import RankIdentity
from ddpmon.metrics.state import FirstNonfinite, MetricState, StepRecord
from ddpmon.sources.allocator import AllocatorSource
from ddpmon.sources.host import ProcessSource
from ddpmon.sources.nvml import NvmlSource

GOLDEN = Path(__file__).parent.parent / "golden" / "exposition.txt"


class FakeProcess:
    """psutil.Process stand-in with fixed numbers (the real one is used in integration tests)."""

    def oneshot(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def memory_info(self):
        return SimpleNamespace(rss=123_456_789)

    def cpu_times(self):
        return SimpleNamespace(user=10.5, system=2.25)


class FakeNvml:
    """The subset of pynvml the source calls, for one H100-like board."""

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUUID(self, handle):
        return "GPU-1234"

    def nvmlDeviceGetName(self, handle):
        return b"Fake H100"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=40 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=87)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 61

    def nvmlDeviceGetPowerUsage(self, handle):
        return 412_000

    def nvmlDeviceGetPciInfo(self, handle):
        return SimpleNamespace(busId=b"0000:18:00.0")

    def nvmlDeviceGetTotalEccErrors(self, handle, a, b):
        return 0


class BrokenNvml(FakeNvml):
    def nvmlInit(self):
        raise RuntimeError("NVML Shared Library Not Found")


def allocator_stats(device):
    return {
        "allocated_bytes.all.current": 1 << 30,
        "reserved_bytes.all.current": 2 << 30,
        "allocated_bytes.all.peak": 3 << 30,
        "num_alloc_retries": 2,
        "num_ooms": 1,
    }


def make_state(groups=4, opt_in=True, replicas=True) -> MetricState:
    """A rank's state with every series; ``opt_in=False`` leaves out the opt-in per-step metrics
    (``step_metrics``), the reruns' counter (``on_nonfinite='rerun'``), the update ratios and
    max logits, and the unrecovered-spike gauge, as an agent with defaults does;
    ``replicas=False`` the replica check's counter, as a strategy without replicas does."""
    s = MetricState(loss_scale_floor=1.0, started_at=1700000000.0)
    s.step, s.steps_total, s.last_step_timestamp = 41, 42, 1700000042.5
    s.loss, s.grad_norm, s.grad_local_norm = 2.5, float("nan"), float("inf")
    s.group_norms = {f"layer{i}": float(i) for i in range(groups)}
    s.grad_nonfinite_steps_total, s.grad_nonfinite_origin_steps_total = 3, 1
    s.first_nonfinite = FirstNonfinite(20, "encoder.layers.0.linear1.weight", "nan")
    s.amp_enabled, s.loss_scale, s.amp_skipped_steps_total = True, 0.5, 17
    s.steps_skipped_total = {"loop": 0, "scaler": 17}
    for v in (0.02, 0.3, 1.5, 100.0):
        s.step_duration.observe(v)
    for v in (0.0005, 0.004):
        s.data_wait.observe(v)
    s.apply(StepRecord(step=41, wall_time=1700000042.5, duration_seconds=None,
                       data_wait_seconds=None, collective_seconds={"all_reduce": [0.0002, 0.003,
                       0.003]}, collective_bytes={"all_reduce": 1 << 20},
                       phase_seconds=(0.004, 0.05, 0.125, 0.01, 0.005, 0.02, 0.001),
                       step_values={metrics.LEARNING_RATE: 3e-4} if opt_in else {}))
    s.step, s.steps_total, s.last_step_timestamp = 41, 42, 1700000042.5
    s.agent_errors = {"comm": 1}
    s.grad_nonfinite_poisoned_steps_total, s.grad_norm_mismatch_total = 2, 1
    s.stall_threshold_seconds, s.strategy = 300.0, "ddp"
    s.attempt = 1
    s.replica_mismatch_total = 0 if replicas else None
    s.step_reruns_total = {"deterministic": 0, "transient": 1} if opt_in else None
    if opt_in:  # update_series=True, logit_modules=[...], a spike that did not recover
        s.update_ratios = {"layer0": 0.002, "layer1": 0.0125}
        s.logit_max = {"head": 31.5}
        s.loss_spike_unrecovered_step = 120
    s.apply_checkpoint("load", 30, 2.5, 1700000001.0, None)
    s.apply_checkpoint("save", 40, 12.0, 1700000040.0, 5 << 20)
    return s


def stuck_activity() -> Activity:
    """A rank stuck 80 s in its data loader while an all-reduce is in flight (a fixed clock and
    recorder; no such thread, so the frame is ``unknown``)."""
    pipeline = SimpleNamespace(phase=ord("D"), phase_since=1000.0, loop_phase=None)
    recorder = {
        "pg_status": {"0": {"last_enqueued_collective": "36"}},
        "entries": [{"collective_seq_id": 36, "process_group": ["0", "default_pg"],
                     "profiling_name": "nccl:allreduce", "state": "scheduled",
                     "time_created_ns": 1_020_000_000_000}],
    }
    return Activity(pipeline, lambda: 5, lambda: 990.0, 30.0, -1,
                    read_recorder=lambda: recorder, clock=lambda: 1100.0)


def make_exposition(state=None, nvml=None, rank=1, series_profile="full",
                    activity=False) -> Exposition:
    identity = RankIdentity(
        rank=rank,
        local_rank=1,
        world_size=2,
        node="node-a",
        backend="nccl",
        device="cuda:1",
        pid=4242,
        gpu_uuid="GPU-1234",
    )
    live = LiveSources(
        process=ProcessSource(FakeProcess()),
        allocator=AllocatorSource("cuda:1", stats_fn=allocator_stats),
        nvml=NvmlSource(nvml or FakeNvml()),
        gpu_indices=[0],
        min_interval=1.0,
        on_error=lambda name, exc: None,
    )
    versions = {
        "version": "0.1.0",
        "torch_version": "2.13.0",
        "cuda_version": "12.8",
        "nccl_version": "2.27.3",
        "python_version": "3.11.7",
    }
    exposition = Exposition(
        DdpmonCollector(state or make_state(), identity, "run-1", versions, live,
                        series_profile=series_profile)
    )
    if activity:
        exposition.serve_at_scrape(stuck_activity().samples)
    return exposition


def test_golden_exposition():
    text = make_exposition(activity=True).render().decode()
    if os.environ.get("DDPMON_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
        pytest.fail("golden file rewritten: review its diff, then run again without it")
    assert text == GOLDEN.read_text(), "exposition changed: DDPMON_UPDATE_GOLDEN=1 to accept"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="make test installs promtool")
def test_promtool_check_metrics_is_clean():
    text = make_exposition(activity=True).render()
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == b"" and proc.stderr.strip() == b""


def test_text_parses_back_with_nonfinite_values():
    families = {
        f.name: f for f in text_string_to_metric_families(make_exposition().render().decode())
    }
    norm = families["ddpmon_grad_norm"].samples[0]
    assert norm.value != norm.value  # NaN survives the round trip
    assert families["ddpmon_grad_local_norm"].samples[0].value == float("inf")
    first = families["ddpmon_grad_first_nonfinite_info"].samples[0].labels
    assert first["param"] == "encoder.layers.0.linear1.weight" and first["step"] == "20"
    for family in families.values():
        for sample in family.samples:
            assert sample.labels["run"] == "run-1" and sample.labels["rank"] == "1"


def test_nvml_absent_reports_collector_failure_not_an_error_page():
    text = make_exposition(nvml=BrokenNvml()).render().decode()
    assert 'ddpmon_collector_success{collector="nvml",rank="1",run="run-1"} 0.0' in text
    assert "ddpmon_gpu_memory_used_bytes{" not in text


def test_series_budget_with_default_group_bound():
    text = make_exposition(make_state(groups=32, opt_in=False)).render().decode()
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(series) <= 150, len(series)


@pytest.mark.parametrize(
    ("ops", "replicas"),
    [
        (("all_reduce",), True),  # DDP
        (("reduce_scatter", "all_gather"), False),  # FSDP2
        # HSDP, TP (sequence parallel), FSDP2+TP
        (("all_reduce", "reduce_scatter", "all_gather"), True),
        (("all_reduce", "reduce_scatter", "all_gather", "broadcast"), False),  # ZeRO-3
        (("all_reduce", "reduce", "all_gather"), True),  # DeepSpeed ZeRO-1/2
        (("reduce_scatter", "all_gather", "send", "recv"), False),  # PP + FSDP2
        (("all_reduce", "send", "recv"), True),  # PP + DDP (each stage's dp replicas)
    ],
)
def test_series_budget_holds_for_every_strategy_op_set(ops, replicas):
    """Only the ops a rank issues are exported; each costs 8 series. Counted as an agent
    exports them: every core probe's error counter at zero, the default group cap, the replica
    check's counter where the strategy has replicas."""
    from ddpmon.config import Config
    from ddpmon.metrics.state import CORE_PROBES

    state = make_state(groups=Config().max_groups, opt_in=False, replicas=replicas)
    state.agent_errors = dict.fromkeys(CORE_PROBES, 0)
    state.collective_duration.clear()
    state.collective_bytes_total.clear()
    state.apply(StepRecord(step=42, wall_time=1700000043.0, duration_seconds=None,
                           data_wait_seconds=None,
                           collective_seconds={op: [0.001] for op in ops},
                           collective_bytes=dict.fromkeys(ops, 8)))
    text = make_exposition(state).render().decode()
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    per_op = [s for s in series if s.startswith("ddpmon_collective_")]
    assert len(per_op) == 8 * len(ops)
    assert len(series) <= 150, len(series)
    if "send" not in ops and "broadcast" not in ops:  # on_nonfinite='rerun' runs here: 2 more
        state.step_reruns_total = {"deterministic": 0, "transient": 0}
        text = make_exposition(state).render().decode()
        assert len(_series(text)) == len(series) + 2 <= 150, len(_series(text))


def _series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_series_profile_large_keeps_group_norms_on_rank_0_only():
    """Reduced group norms are the same on every rank of DDP/FSDP2/DeepSpeed: under ``large``
    only rank 0 exports them; everything else (global and local norms, origin) stays per
    rank. Ranks whose norms are their own (plain, unsupported) keep them."""
    def render(rank, profile, strategy="ddp"):
        state = make_state(groups=32)
        state.strategy = strategy
        return make_exposition(state, rank=rank, series_profile=profile).render().decode()

    full, large = render(1, "full"), render(1, "large")
    dropped = set(_series(full)) - set(_series(large))
    assert len(dropped) == 32 and all(x.startswith("ddpmon_grad_group_norm{") for x in dropped)
    assert set(_series(large)) <= set(_series(full))
    for name in ("ddpmon_grad_norm{", "ddpmon_grad_local_norm{",
                 "ddpmon_grad_nonfinite_origin_steps_total{", "ddpmon_grad_first_nonfinite_info{"):
        assert any(x.startswith(name) for x in _series(large)), name
    assert _series(render(0, "large")) == _series(render(0, "full"))
    for strategy in ("deepspeed-zero3", "fsdp2", "hsdp+tp", "tp"):
        assert "ddpmon_grad_group_norm{" not in render(1, "large", strategy), strategy
    for strategy in ("plain", "unsupported:pipeline-parallel"):
        assert "ddpmon_grad_group_norm{" in render(1, "large", strategy), strategy


def test_render_is_cached_until_state_changes():
    state = make_state()
    exposition = make_exposition(state)
    first = exposition.render()
    assert exposition.render() is first and exposition.renders == 1
    state.count_error("grads")
    assert b'probe="grads"' in exposition.render() and exposition.renders == 2


def with_figures(exposition: Exposition) -> Exposition:
    """The rank's other collectors, fed: rank 0's live goodput and the FLOPs/MFU rates."""
    import time as _time

    from ddpmon.agent.goodput_live import GoodputLive
    from ddpmon.flops.mfu import Throughput
    from ddpmon.forensics.goodput import NAMES

    labels = {"run": "run-1", "rank": "1"}
    goodput = GoodputLive(Path("."), labels, 60.0, lambda name, exc: None)
    goodput.result = {"buckets": dict.fromkeys(NAMES, 1.0), "wall": float(len(NAMES)),
                      "goodput": 1 / len(NAMES), "ettr": 4 / len(NAMES)}
    calls = iter([(0, 0.0)])
    rates = Throughput(labels, lambda: next(calls, (10, _time.time() + 10.0)), peak_flops=1e15,
                       flops_per_step=1e9, tokens_per_step=64)
    exposition.add(goodput)
    exposition.add(rates)
    return exposition


def test_exposition_is_exactly_the_catalogue():
    """Every catalogue entry is exposed with its type, help and labels, and nothing else is."""
    text = with_figures(make_exposition(activity=True)).render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    exposed = {}
    for fam in families.values():
        # the parser drops a counter's _total from the family name; samples keep it
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        exposed[name] = fam
    assert set(exposed) == set(metrics.BY_NAME)
    for name, fam in exposed.items():
        spec = metrics.BY_NAME[name]
        assert fam.type == spec.type.value and fam.documentation == spec.help, name
        for sample in fam.samples:
            assert set(sample.labels) - {"le"} == set(spec.all_labels), name


def test_new_counters_are_exported_at_zero_and_stall_gauge_only_when_set():
    text = make_exposition(MetricState(started_at=1.0)).render().decode()
    assert 'ddpmon_grad_nonfinite_poisoned_steps_total{rank="1",run="run-1"} 0.0' in text
    assert 'ddpmon_grad_norm_mismatch_total{rank="1",run="run-1"} 0.0' in text
    assert "ddpmon_stall_threshold_seconds" not in text
    assert 'strategy="plain"' in text


def test_docs_state_the_default_series_per_rank():
    """docs/deployment.md's per-rank counts and 16k totals are this collector's, with the
    default group cap and every core probe counted (an agent exports all of them at zero)."""
    from ddpmon.config import Config
    from ddpmon.metrics.state import CORE_PROBES

    def count(profile: str, rank: int) -> int:
        state = make_state(groups=Config().max_groups, opt_in=False)
        state.agent_errors = dict.fromkeys(CORE_PROBES, 0)
        exposition = make_exposition(state, rank=rank, series_profile=profile)
        return len(_series(exposition.render().decode()))

    full, large, large0 = count("full", 1), count("large", 1), count("large", 0)
    assert full <= 150 and large0 == full
    doc = (Path(__file__).parents[2] / "docs" / "deployment.md").read_text()
    assert f"**{full} series**" in doc and f"**{large} series**" in doc
    ranks = 16_384
    row = f"| 16,384 | {ranks * (full + 1):,} | {(ranks - 1) * (large + 1) + full + 1:,} |"
    assert row in doc, row


def test_the_loss_spike_series_stay_out_of_the_default_budget():
    """The per-group update ratios are opt-in (``update_series``: one series per group, bounded
    by ``max_groups``); the unrecovered-spike gauge exists only while such a spike lasts."""
    from ddpmon.config import Config

    state = make_state(groups=Config().max_groups, opt_in=False)
    base = len(_series(make_exposition(state).render().decode()))
    state.update_ratios = {f"layer{i}": 0.01 for i in range(Config().max_groups)}
    state.set_spike_unrecovered(120)
    text = make_exposition(state).render().decode()
    assert len(_series(text)) == base + Config().max_groups + 1
    assert "ddpmon_loss_spike_unrecovered_step" in text and 'group="layer31"' in text
    state.update_ratios, state.logit_max = None, {}
    state.set_spike_unrecovered(None)
    assert len(_series(make_exposition(state).render().decode())) == base


def test_a_failing_at_scrape_family_is_counted_and_the_rest_is_served():
    exposition = make_exposition()
    failures = []

    def broken():
        raise IndexError("pop from a list another thread emptied")

    exposition.serve_at_scrape(broken, lambda probe, exc: failures.append((probe, type(exc))))
    text = exposition.render().decode()
    assert "ddpmon_rank_info{" in text and "ddpmon_phase_since" not in text
    assert failures == [("activity", IndexError)]


def test_a_pipeline_ranks_step_parts_carry_its_stage_for_the_straggler_rules():
    """The straggler rules and ``ddpmon top`` compare a pipeline rank within its stage: its
    parts carry the stages it runs; elsewhere the label is empty, which a store drops."""
    from ddpmon.export.scrape import flatten, stage_of

    state = make_state()
    plain = make_exposition(state).render().decode()
    assert 'part="compute",rank="1",run="run-1",stage=""}' in plain
    assert stage_of(flatten(plain)) is None
    state.stage = "0,2"
    state.version += 1
    staged = make_exposition(state).render().decode()
    parts = [ln for ln in staged.splitlines() if ln.startswith(metrics.STEP_PART_SECONDS.name)]
    assert parts and all('stage="0,2"' in ln for ln in parts), parts
    flat = flatten(staged)
    assert stage_of(flat) == "0,2"
    assert flat[f'{metrics.STEP_PART_SECONDS.name}{{part="compute"}}'] > 0
