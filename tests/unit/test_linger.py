"""close() lingers for a store's scraper, and only for one: real HTTP, one process.

The live proof (a real Prometheus scraping a 3-second job every 10 s) is in
tests/integration/test_linger_live.py; here the policy's cases, each with a bound on how long
close() took.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
import torch
from torch import nn

import ddpmon
from ddpmon.config import Config, ConfigError
from ddpmon.export.delivery import STORE_SCRAPE_HEADER, linger_until
from tests.support.ports import free_ports


def _get(port: int, store: bool) -> str:
    headers = {STORE_SCRAPE_HEADER: "10"} if store else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.read().decode()


def _steps(text: str) -> int:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ddpmon_steps_total{")]
    return int(float(line.rsplit(" ", 1)[1]))


class Scraper(threading.Thread):
    """Scrapes every ``interval`` seconds like a store (or like a person, ``store=False``)."""

    def __init__(self, port: int, interval: float, store: bool = True) -> None:
        super().__init__(daemon=True)
        self.port, self.interval, self.store = port, interval, store
        self.stop = threading.Event()
        self.bodies: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.bodies.append(_get(self.port, self.store))
            except OSError:
                return  # the endpoint closed
            self.stop.wait(self.interval)


def _attach(tmp_path, **options):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    port = free_ports(1)
    mon = ddpmon.attach(model, opt, port=port, bind="127.0.0.1", run_dir=str(tmp_path),
                        run_id="linger", **options)
    for _ in range(3):
        loss = model(torch.ones(2, 4)).sum()
        mon.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return mon, port


def _timed_close(mon) -> float:
    start = time.monotonic()
    mon.close()
    return time.monotonic() - start


@pytest.mark.parametrize(
    ("store_scraped", "published", "opened_at", "deadline"),
    [
        (True, False, 0.0, 107.0),  # scraped before: wait for the next scrape, up to the bound
        (True, True, 99.0, 107.0),
        (False, True, 98.0, 105.0),  # young and published: until the bound after opening
        (False, True, 92.0, None),  # published, never scraped in a whole bound: no scraper
        (False, False, 99.0, None),  # nothing says a scraper exists
    ],
)
def test_policy(store_scraped, published, opened_at, deadline):
    got = linger_until(now=100.0, linger_seconds=7.0, store_scraped=store_scraped,
                       published=published, opened_at=opened_at)
    assert got == deadline


def test_zero_never_waits():
    assert linger_until(now=5.0, linger_seconds=0.0, store_scraped=True, published=True,
                        opened_at=4.0) is None


def test_config_bounds():
    assert Config().linger_seconds > 15  # over the shipped 15 s PodMonitor interval
    for bad in (-1, 601, float("nan"), "5"):
        with pytest.raises(ConfigError, match="linger_seconds"):
            Config(linger_seconds=bad)
    assert Config.from_sources(environ={"DDPMON_LINGER_SECONDS": "2.5"}).linger_seconds == 2.5


def test_nobody_scrapes_close_is_prompt(tmp_path):
    """Serving, never scraped, not published: close() does not wait at all."""
    mon, _ = _attach(tmp_path)  # the default linger_seconds
    assert _timed_close(mon) < 10.0  # far below the 20 s default linger; lingered says why
    assert mon.endpoint.lingered == "no-wait"


def test_a_person_reading_is_not_a_store(tmp_path):
    """curl or `ddpmon top` reading /metrics neither makes the rank wait nor ends a wait."""
    mon, port = _attach(tmp_path)
    _get(port, store=False)
    assert _timed_close(mon) < 10.0  # far below the 20 s default linger; lingered says why
    assert mon.endpoint.lingered == "no-wait"


def test_published_never_scraped_waits_only_until_the_bound(tmp_path):
    mon, _ = _attach(tmp_path, sd_dir=str(tmp_path / "sd"), linger_seconds=1.5)
    took = _timed_close(mon)
    assert mon.endpoint.lingered == "timeout"
    assert took < 1.5 + 0.5  # measured from attach, so at most the bound
    assert not list((tmp_path / "sd").glob("*.json"))  # the target is withdrawn afterwards


def test_store_scraper_takes_the_final_step(tmp_path):
    mon, port = _attach(tmp_path, linger_seconds=10)
    scraper = Scraper(port, interval=0.4)
    scraper.start()
    try:
        while not scraper.bodies:
            time.sleep(0.05)
        loss = mon.model(torch.ones(2, 4)).sum()  # a final step after the scraper's first visit
        loss.backward()
        mon.optimizer.step()
        took = _timed_close(mon)
    finally:
        scraper.stop.set()
        scraper.join(5)
    assert mon.endpoint.lingered == "scraped"
    assert took < 0.4 + 1.0  # one scrape interval, not the bound
    assert _steps(scraper.bodies[-1]) == 4  # the last answer the store got has the final step


def test_scraper_gone_close_returns_at_the_bound(tmp_path):
    mon, port = _attach(tmp_path, linger_seconds=1.0)
    _get(port, store=True)  # scraped once; the store then went away
    took = _timed_close(mon)
    assert mon.endpoint.lingered == "timeout"
    assert 0.9 < took < 1.0 + 0.5
