"""Live goodput on a real monitor (a marked phase included): rank 0's thread recomputes it from
the run dir and /metrics serves ``ddpmon_goodput_*`` over real HTTP, one series per bucket, the
buckets adding up to the wall-clock series; ``goodput_seconds=0`` serves none."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import ddpmon
from ddpmon.forensics.goodput import NAMES
from tests.support.ports import free_port
from tests.support.scrape import scrape

pytest.importorskip("pyarrow")


def train(mon, model, opt, steps: int, tmp_path) -> None:
    for step in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        time.sleep(0.01)
        opt.step()
        opt.zero_grad()
        if step == 4:
            path = tmp_path / "ck.pt"
            with mon.observe_checkpoint(5, path):
                torch.save(model.state_dict(), path)
            with mon.phase("eval"):
                time.sleep(0.2)


def goodput_series(port: int) -> dict:
    return {k: v for k, v in scrape(port).items() if k[0].startswith("ddpmon_goodput")}


def attached(tmp_path, run_id: str, goodput_seconds: float):
    """A one-rank monitor serving on a free port: (model, optimizer, monitor, port)."""
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    port = free_port()
    mon = ddpmon.attach(model, opt, port=port, bind="127.0.0.1", run_dir=str(tmp_path),
                        run_id=run_id, goodput_seconds=goodput_seconds, linger_seconds=0)
    return model, opt, mon, port


def test_rank0_serves_goodput_that_adds_up(tmp_path):
    model, opt, mon, port = attached(tmp_path, "gl", 0.5)
    try:
        train(mon, model, opt, 10, tmp_path)
        mon.flush()
        # the history reaches the disk in batches (about once a second): wait for the steps
        deadline = time.monotonic() + 30
        series = goodput_series(port)
        while (series.get(("ddpmon_goodput_ratio", ()), 0) <= 0
               and time.monotonic() < deadline):
            time.sleep(0.2)
            series = goodput_series(port)
        buckets = {dict(k[1])["bucket"]: v for k, v in series.items()
                   if k[0] == "ddpmon_goodput_seconds"}
        assert set(buckets) == set(NAMES)
        assert len(series) == len(NAMES) + 3  # bounded: buckets, wall, two ratios
        wall = series[("ddpmon_goodput_wall_seconds", ())]
        assert sum(buckets.values()) == pytest.approx(wall, rel=1e-6)
        assert buckets["productive"] > 0 and buckets["unproductive_checkpoint_save"] > 0
        assert buckets["initialization"] > 0  # process start to the first step
        assert 0.2 <= buckets["custom_badput_events"] < 0.2 + 0.5  # the marked phase
        ratio = series[("ddpmon_goodput_ratio", ())]
        assert 0 < ratio < series[("ddpmon_goodput_ettr_ratio", ())] <= 1
    finally:
        mon.close()


def test_goodput_seconds_zero_serves_none(tmp_path):
    model, opt, mon, port = attached(tmp_path, "off", 0)
    try:
        train(mon, model, opt, 3, tmp_path)
        assert mon.goodput is None
        assert goodput_series(port) == {}
    finally:
        mon.close()
