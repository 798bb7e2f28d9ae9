"""Two real ranks (gloo) with the agent attached; scraped over real HTTP."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.ports import free_port_pair
from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("ddp_worker.py")


# One launch runs every case in order (starting two ranks costs far more than a case's steps);
# each case has its own model, optimizer, scaler, monitor and run id. (id, steps, injection
# step); "raise" must be last: the ranks stop where it raised.
CASES = [
    ("clean", 6, 3),
    ("nan", 8, 3),
    ("collapse", 10, 2),
    ("skip", 6, 2),
    ("clip", 4, 3),
    ("dupdata", 8, 4),
    ("raise", 6, 2),
]


def run_workers(tmp_path: Path) -> dict[str, list[dict]]:
    """Every case's per-rank results: the worker's record plus its parsed scrape."""
    args = ["--port", str(free_port_pair())]
    for case, steps, step in CASES:
        args += ["--case", f"{case}:{case}:{steps}:{step}"]
    records = run_ranks(WORKER, tmp_path, args)
    results: dict[str, list[dict]] = {}
    for case, _, _ in CASES:
        results[case] = []
        for rank in range(2):
            data = records[rank][case]
            text = (tmp_path / f"{case}.rank{rank}.metrics").read_text()
            families = list(text_string_to_metric_families(text))
            # Each case's scrape holds only its own run: nothing left over from earlier cases.
            assert {s.labels.get("run") for f in families for s in f.samples} <= {
                data["run_id"], None
            }, case
            data["text"] = text
            manifest = tmp_path / "runs" / data["run_id"] / "manifest.json"
            data["manifest"] = json.loads(manifest.read_text()) if rank == 0 else None
            data["metrics"] = {
                (
                    s.name,
                    tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run", "rank"))),
                ): s.value
                for fam in families
                for s in fam.samples
            }
            results[case].append(data)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return run_workers(tmp_path_factory.mktemp("agent_ddp"))


def value(result: dict, name: str, **labels: str) -> float:
    return result["metrics"][(name, tuple(sorted(labels.items())))]


def test_nan_origin_rank_and_first_nonfinite(runs):
    # Step 3 is not a local-norm sample step on CPU (every 10th, plus data checks every 2nd):
    # the origin is found on the rare path, from the local param.grad after the all-reduce.
    # The skip/raise tests inject at step 2, a sampled step (local norms before the all-reduce).
    r0, r1 = runs["nan"]
    assert value(r1, "ddpmon_grad_nonfinite_origin_steps_total") == 1
    assert value(r0, "ddpmon_grad_nonfinite_origin_steps_total") == 0
    for r in (r0, r1):
        assert value(r, "ddpmon_grad_nonfinite_steps_total") >= 1
        assert value(r, "ddpmon_steps_skipped_total", by="scaler") == 1  # the scaler skipped it
        assert value(r, "ddpmon_steps_skipped_total", by="loop") == 0
        assert value(r, "ddpmon_steps_total") == 8  # the skipped step still counts
    first = [k for k in r1["metrics"] if k[0] == "ddpmon_grad_first_nonfinite_info"]
    assert dict(first[0][1]) == {"kind": "nan", "param": "layers.2.weight", "step": "3"}
    assert not [k for k in r0["metrics"] if k[0] == "ddpmon_grad_first_nonfinite_info"]


@pytest.fixture(scope="module")
def clean_run(runs):
    return runs["clean"]


def test_collective_histogram_counts_every_bucket_of_every_step_through_a_user_hook(clean_run):
    results = clean_run
    for r in results:
        calls = r["hook_calls"]
        assert calls >= 2 * 6, "small buckets should give several all-reduces per step"
        op = {"op": "all_reduce"}
        count = value(r, "ddpmon_collective_duration_seconds_count", **op)
        assert count == calls
        assert value(r, "ddpmon_collective_bytes_total", **op) > 0
        mean = value(r, "ddpmon_collective_duration_seconds_sum", **op) / count
        step_mean = value(r, "ddpmon_step_duration_seconds_sum") / value(
            r, "ddpmon_step_duration_seconds_count"
        )
        assert 0 < mean < step_mean  # wall time of one bucket, inside its step
        assert {k[1] for k in r["metrics"] if k[0] == "ddpmon_collective_bytes_total"} == {
            (("op", "all_reduce"),)
        }  # DDP issues nothing else: no other op is exported
        assert value(r, "ddpmon_grad_local_norm") > 0
        # Post-reduce norms are identical across ranks; local ones differ (different data).
    assert value(results[0], "ddpmon_grad_norm") == pytest.approx(
        value(results[1], "ddpmon_grad_norm"), rel=1e-6
    )
    assert value(results[0], "ddpmon_grad_local_norm") != value(
        results[1], "ddpmon_grad_local_norm"
    )


def test_scale_halves_per_skipped_step_and_skips_equal_injections(runs):
    results = runs["collapse"]
    for r in results:
        scales = r["scales"]
        assert value(r, "ddpmon_steps_skipped_total", by="scaler") == 5
        for step in range(2, 7):  # each injected step halves the scale, as GradScaler does
            assert scales[step] == scales[step - 1] / 2
        assert scales[-1] == 2.0**10 / 2**5
        assert value(r, "ddpmon_amp_loss_scale") == 2.0**10 / 2**5
        assert value(r, "ddpmon_amp_loss_scale_floor") == 1.0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="make test installs promtool")
def test_real_scrape_passes_promtool_and_series_budget(clean_run):
    for r in clean_run:
        proc = subprocess.run(
            ["promtool", "check", "metrics"], input=r["text"].encode(), capture_output=True
        )
        assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
            proc.stdout + proc.stderr
        )
        assert len(r["metrics"]) <= 150


def test_on_nonfinite_skip_keeps_replicas_bit_identical(runs):
    r0, r1 = runs["skip"]
    assert r0["params_finite"] and r1["params_finite"]
    assert r0["params_sha256"] == r1["params_sha256"]
    assert value(r1, "ddpmon_grad_nonfinite_origin_steps_total") == 1


def test_on_nonfinite_raise_raises_on_every_rank(runs):
    r0, r1 = runs["raise"]
    for r in (r0, r1):
        assert r["raised"] and "step 2" in r["raised"] and "layers.2.weight" in r["raised"]
    assert "rank 0" in r0["raised"] and "rank 1" in r1["raised"]


def test_clip_grad_norm_matches_torch_reuses_hook_norms_and_handles_shards(runs):
    results = runs["clip"]
    for r in results:
        assert len(r["clip"]) == 4
        assert r["clip_passes_replicated"] == 0  # reused the comm hook's reduced norms
        for check in r["clip"]:
            assert check["ddpmon"] == pytest.approx(check["torch"], rel=1e-5)
            assert check["max_grad_diff"] < 1e-6
            # The exported norm is the pre-clip norm clip_grad_norm_ returned.
            assert check["reported"] == pytest.approx(check["ddpmon"], rel=1e-5)
        sharded = r["sharded"]
        assert sharded["ddpmon"] == pytest.approx(sharded["expected"], rel=1e-6)
    assert results[0]["sharded"]["ddpmon"] == pytest.approx(results[1]["sharded"]["ddpmon"])


def test_duplicated_data_shard_is_detected_on_both_ranks(runs, clean_run):
    # Sampled every 2 steps; from step 4 on rank 1 reads rank 0's shard: steps 4 and 6 match.
    r0, r1 = runs["dupdata"]
    for r in (r0, r1):
        assert value(r, "ddpmon_data_identical_batches_total") == 2
    for r in clean_run:  # distinct shards never match
        assert value(r, "ddpmon_data_identical_batches_total") == 0
    assert r0["manifest"]["data_check"] == {"every": 2,
                                            "over": "the ranks of the DDP process group"}
