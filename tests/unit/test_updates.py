"""Per-group update figures in one process (probes.updates): equal to a reference from the
weights and optimizer state before and after each sampled step, sampled every ``update_every``
steps only, written to the history, exported only on request; max logits read in the forward."""

from __future__ import annotations

import glob

import pytest
import torch

import ddpmon
from ddpmon.recorder.history_read import read_history
from tests.support.ports import free_port
from tests.support.scrape import scrape
from tests.support.updates import Reference, TinyTransformer, batch, loss_of, relative_errors


def train(mon, model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens, targets = batch(gen)
        loss = loss_of(model, tokens, targets)
        mon.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def run(tmp_path):
    def start(optimizer=torch.optim.AdamW, **options):
        torch.manual_seed(0)
        model = TinyTransformer()
        opt = optimizer(model.parameters(), lr=1e-2)
        mon = ddpmon.attach(model, opt, port=options.pop("port", 0), bind="127.0.0.1",
                            run_dir=str(tmp_path), run_id="updates", **options)
        assert mon.enabled, mon.error
        return model, opt, mon, Reference(model, opt)

    return start


def test_adam_figures_equal_the_reference_on_sampled_steps_only(run, tmp_path):
    model, opt, mon, reference = run(update_every=3, logit_modules=["head"])
    heads = []
    model.head.register_forward_hook(lambda m, a, out: heads.append(float(out.detach().max())))
    train(mon, model, opt, 8)
    records = {r.step: r for r in mon.recent_steps()}
    mon.close()
    sampled = sorted(s for s, r in records.items() if r.update_stats)
    assert sampled == [0, 3, 6]
    for step in sampled:
        stats = records[step].update_stats
        assert set(stats) == {"emb", "block", "head"}
        errors = relative_errors(stats, reference.steps[step])
        assert len(errors) == 3 * 5 and max(e for *_, e in errors) < 1e-6, errors
    # max logits: every step, the value the head's output held
    assert [records[s].logit_max["head"] for s in range(8)] == pytest.approx(heads, rel=1e-6)
    # the history keeps the sampled steps' figures per group, NaN on the others
    history = read_history(glob.glob(f"{tmp_path}/**/history.rank0.arrow", recursive=True)[0])
    ratios = history.columns["update_ratios"]
    block = history.groups.index("block")
    for row, step in enumerate(history.columns["step"]):
        if step in sampled:
            want = reference.steps[step]["block"]["update_ratio"]
            assert ratios[row, block] == pytest.approx(want, rel=1e-6)
            moment = history.columns["exp_avg_sq_norms"][row, block]
            assert moment == pytest.approx(reference.steps[step]["block"]["exp_avg_sq_norm"],
                                           rel=1e-6)
        else:
            assert torch.isnan(torch.tensor(ratios[row])).all()


def test_sgd_has_no_moments_and_the_ratio_series_is_opt_in(run):
    port = free_port()
    model, opt, mon, reference = run(torch.optim.SGD, update_every=2, update_series=True,
                                     port=port)
    train(mon, model, opt, 3)
    metrics = scrape(port)
    records = {r.step: r for r in mon.recent_steps()}
    mon.close()
    stats = records[2].update_stats
    assert all(set(f) == {"weight_norm", "update_norm", "update_ratio"} for f in stats.values())
    assert max(e for *_, e in relative_errors(stats, reference.steps[2])) < 1e-6
    for group in ("emb", "block", "head"):
        assert metrics[("ddpmon_update_ratio", (("group", group),))] == pytest.approx(
            stats[group]["update_ratio"], rel=1e-6)


def test_without_update_series_no_ratio_is_exported_and_zero_turns_it_off(run):
    port = free_port()
    model, opt, mon, _ = run(update_every=0, port=port)
    train(mon, model, opt, 2)
    metrics = scrape(port)
    records = mon.recent_steps()
    mon.close()
    assert not any(name == "ddpmon_update_ratio" for name, _ in metrics)
    assert not any(r.update_stats for r in records)


def test_a_bad_logit_module_name_disables_nothing_but_is_counted(run):
    model, opt, mon, _ = run(logit_modules=["no_such_module"])
    train(mon, model, opt, 2)
    errors = dict(mon.state.agent_errors)
    steps = mon.state.steps_total
    mon.close()
    assert errors.get("logits") == 1 and steps == 2


def test_compare_and_report_show_the_update_figures(tmp_path):
    from ddpmon.forensics.compare import compare_runs
    from ddpmon.forensics.report import build_report

    runs = []
    for name, lr in (("a", 1e-2), ("b", 1e-2), ("c", 5e-2)):
        torch.manual_seed(0)
        model = TinyTransformer()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        mon = ddpmon.attach(model, opt, port=0, bind="127.0.0.1", run_dir=str(tmp_path / name),
                            run_id=name, update_every=2)
        train(mon, model, opt, 6)
        mon.close()
        runs.append(tmp_path / name)
    same = compare_runs(runs[0], runs[1])
    ratios = [s.name for s in same.series if s.name.startswith("ratio:")]
    assert sorted(ratios) == ["ratio:block", "ratio:emb", "ratio:head"] and not same.diverged
    other = compare_runs(runs[0], runs[2])  # 5x the lr: the ratios part at the first step
    parted = {s.name: s.first_step for s in other.series if s.name.startswith("ratio:")}
    assert parted == dict.fromkeys(ratios, 0)
    html = build_report(runs[0]).html
    assert "Update/weight ratio" in html and "first moment norm" in html
