"""Two short single-process runs for the step-value recipes (tests/unit/test_recipe_step_field.py):
run A and run B differ in their data, so ``compare`` has something to find. Prints, as JSON,
what the recipe must reach: /metrics, the history, ``compare`` and ``report``. Runs in-process
(a per-step metric) or as a script on a copy of ddpmon with a new step field."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import ddpmon
from ddpmon.forensics.compare import compare_runs
from ddpmon.forensics.report import build_report
from ddpmon.recorder.history_read import read_history
from tests.support.ports import free_port
from tests.support.scrape import scrape


def one_run(run_dir: Path, shift: float, steps: int = 6, **options) -> dict:
    """A loop the way scripts write it, ``observe_loss`` each step; returns /metrics parsed
    and the losses it saw."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ddpmon.attach(model, opt, port=free_port(), bind="127.0.0.1", run_dir=str(run_dir),
                        run_id="r", linger_seconds=0, **options)
    losses = []
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(5, 4, generator=g) + (shift if step >= 3 else 0.0)
            loss = model(x).pow(2).mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        mon.flush()
        exposed = scrape(mon.port)
    finally:
        mon.close()
    return {"exposed": exposed, "losses": losses}


def reach(tmp: Path, column: str, **options) -> dict:
    """Runs A and B, and what each layer shows of ``column``."""
    a = one_run(tmp / "a", 0.0, **options)
    one_run(tmp / "b", 3.0, **options)
    history = read_history(tmp / "a" / "r" / "history.rank0.arrow")
    comparison = compare_runs(tmp / "a" / "r", tmp / "b" / "r")
    series = {s.name: s.first_step for s in comparison.series}
    html = build_report(tmp / "a" / "r", tmp / "b" / "r").html
    return {
        "metrics": {name: v for (name, labels), v in a["exposed"].items() if not labels},
        "losses": a["losses"],
        "history": [None if v != v else float(v) for v in history.columns.get(column, [])],
        "compared": column in series,
        "first_step": series.get(column),
        "plotted": f'id="plot-value-{column}"' in html,
    }


if __name__ == "__main__":  # python -m tests.support.recipe_run TMP COLUMN
    print(json.dumps(reach(Path(sys.argv[1]), sys.argv[2])))
