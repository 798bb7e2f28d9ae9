"""examples/pp_fsdp2.py run as its docs say (torchrun, 4 CPU ranks: 2 stages x FSDP2 dp 2,
1F1B): what it prints and its --summary JSON are the issue's acceptance for pipeline parallel.
One global norm, equal to the reference (torchtitan's ``clip_grad_norm_(..., pp_mesh=)`` when
installed) on every step and rank; the loss only on the last stage, in the step records and in
each rank's own /metrics; send/recv/reduce_scatter/all_gather timed; the injected
activation-gradient NaN named as stage 1, the injected rank and micro-batch, activation_grad."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from tests.support.ports import free_ports
from tests.support.ranks import run_launcher, torchrun

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pp_fsdp2.py"
STEPS, NAN_STEP, NAN_MB = 4, 2, 2  # not the script's defaults: the test's own values must show
INJECTED_RANK = 2  # the first rank of stage 1 on the (pp, dp) = (2, 2) mesh
OPS = ("send", "recv", "reduce_scatter", "all_gather")
TIMEOUT_S = 150


def _run(tmp_path: Path) -> tuple[str, dict]:
    def command() -> list[str]:
        port = free_ports(4)  # /metrics: rank r serves port + r
        return torchrun(
            EXAMPLE, "--steps", str(STEPS), "--nan-step", str(NAN_STEP),
            "--nan-microbatch", str(NAN_MB), "--run-dir", str(tmp_path / "runs"),
            "--port", str(port), "--summary", str(tmp_path / "summary.json"), nproc=4,
        )

    done = run_launcher(command, TIMEOUT_S)
    out = done.stdout + done.stderr
    assert done.code == 0, out[-4000:]
    return out, json.loads((tmp_path / "summary.json").read_text())


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("pp_example"))


def test_one_global_norm_equal_to_the_reference_on_every_step_and_rank(example):
    out, summary = example
    has_titan = importlib.util.find_spec("torchtitan") is not None
    assert summary["reference"].startswith("torchtitan" if has_titan else "torch ("), summary
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for step in range(STEPS):
        norms = [r["steps"][step]["ddpmon_norm"] for r in ranks]
        for r in ranks:
            s = r["steps"][step]
            assert s["step"] == step
            if step < NAN_STEP:  # clean: one norm, the reference's
                assert s["ddpmon_norm"] > 0.1, (r["rank"], s)
                assert math.isclose(s["ddpmon_norm"], s["reference_norm"], rel_tol=1e-5), s
                assert s["ddpmon_norm"] == norms[0], (r["rank"], norms)
            else:  # the NaN step and after it (the NaN reached every stage's weights)
                assert math.isnan(s["ddpmon_norm"]) and math.isnan(s["reference_norm"]), s
    assert ranks[0]["steps"][0]["ddpmon_norm"] != ranks[0]["steps"][1]["ddpmon_norm"]
    # rank 0 printed each step's pair as it went
    lines = [ln for ln in out.splitlines() if ln.startswith("step ") and "reference" in ln]
    assert len(lines) == STEPS, out
    assert f"{ranks[0]['steps'][0]['ddpmon_norm']:.6f}" in lines[0]


def test_loss_only_on_the_last_stage_in_records_and_metrics(example):
    out, summary = example
    for r in summary["ranks"]:
        assert r["stage"] == r["rank"] // 2 and r["dp_rank"] == r["rank"] % 2
        losses = [s["loss"] for s in r["steps"]]
        line = r["metrics"]["loss_line"]
        if r["stage"] == 1:
            assert all(v is not None for v in losses), losses
            assert all(math.isfinite(v) and v > 0 for v in losses[: NAN_STEP + 1]), losses
            assert line is not None and line.startswith("ddpmon_loss{"), line
        else:
            assert losses == [None] * STEPS, losses
            assert line is None, line
    assert out.count("ddpmon_loss absent") == 2, out


def test_send_recv_and_fsdp2_collectives_timed_per_op(example):
    _, summary = example
    for r in summary["ranks"]:
        seen, scraped = r["collectives"], r["metrics"]["collectives"]
        assert set(OPS) <= set(seen), (r["rank"], seen)
        for op in OPS:
            count, seconds = seen[op]["count"], seen[op]["seconds"]
            assert count > 0 and math.isfinite(seconds) and 0 < seconds < 60, (r["rank"], op)
            # the histogram on /metrics holds at least what the step records list
            assert scraped[op]["count"] >= count, (r["rank"], op, scraped[op], count)
            assert 0 < scraped[op]["seconds"] < 60, (r["rank"], op, scraped[op])
        # 1F1B, 2 stages, 4 micro-batches: one send and one receive per micro-batch each step
        assert seen["send"]["count"] == seen["recv"]["count"] == 4 * STEPS, (r["rank"], seen)
        for s in r["steps"]:
            for op, durations in s["collective_seconds"].items():
                assert all(d >= 0 and math.isfinite(d) for d in durations), (op, durations)


def test_nan_origin_names_stage_rank_microbatch_and_site(example):
    out, summary = example
    assert summary["nan"] == {"step": NAN_STEP, "microbatch": NAN_MB, "rank": INJECTED_RANK}
    origins = [(r["rank"], o) for r in summary["ranks"] for o in r["origins"]]
    assert len(origins) == 1, origins  # the ranks that only received the NaN are no origin
    rank, origin = origins[0]
    assert rank == INJECTED_RANK
    assert (origin["step"], origin["stage"], origin["microbatch"], origin["site"]) == (
        NAN_STEP, 1, NAN_MB, "activation_grad"
    )
    assert origin["param"].startswith("stage1.")
    assert (
        f"NaN origin: step {NAN_STEP}, stage 1, rank {INJECTED_RANK}, micro-batch {NAN_MB}, "
        "site activation_grad"
    ) in out
    # the follow-up command names the run directory; its events name the origin too
    run_path = Path(summary["run_path"])
    assert run_path.is_absolute() and f"ddpmon timeline {run_path}" in out
    for r in range(4):
        events = [json.loads(ln) for ln in (run_path / f"events.rank{r}.jsonl").open()]
        found = [e for e in events if e["kind"] == "nonfinite" and e.get("origin")]
        if r == INJECTED_RANK:
            (event,) = found
            assert (event["step"], event["stage"], event["microbatch"], event["site"]) == (
                NAN_STEP, 1, NAN_MB, "activation_grad"
            )
        else:
            assert found == [], (r, found)
