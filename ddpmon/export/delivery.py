"""Which /metrics answers reached a store's scraper, and when: what ``close()`` waits on.

A rank's last steps exist only in its endpoint until a scraper takes them. ``Deliveries`` is
told (on the server's loop thread) each time a /metrics answer has been written to its socket,
with the time its body was rendered and whether the client was a store's scraper; the agent's
``close()`` waits on it for one store scrape rendered after the final step (``linger_seconds``).

A store's scraper is recognised by the ``X-Prometheus-Scrape-Timeout-Seconds`` request header,
which Prometheus (server and agent mode) and vmagent send with every scrape and which ddpmon's
own readers (``ddpmon top``, the demo, the node daemon) never send: a one-off read by a person
or a tool neither makes a rank wait nor ends its wait.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping

STORE_SCRAPE_HEADER = "x-prometheus-scrape-timeout-seconds"


def is_store_scraper(headers: Mapping[str, str]) -> bool:
    """True for a request from Prometheus or vmagent (header names are lower case here)."""
    return STORE_SCRAPE_HEADER in headers


class Deliveries:
    """Thread-safe record of delivered /metrics answers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.answers = 0
        """Every delivered /metrics answer (any client)."""
        self.store_scrapes = 0
        """Delivered answers to a store's scraper."""
        self.last_store_render = -math.inf
        """``time.monotonic()`` at which the newest delivered store answer was rendered."""
        self._store_times: list[float] = []

    def delivered(self, rendered_at: float, store: bool) -> None:
        with self._cond:
            self.answers += 1
            if store:
                self.store_scrapes += 1
                self.last_store_render = max(self.last_store_render, rendered_at)
                self._store_times = [*self._store_times[-1:], rendered_at]
            self._cond.notify_all()

    @property
    def store_interval(self) -> float | None:
        """Seconds between the last two store scrapes (the scraper's interval), if seen."""
        with self._cond:
            times = self._store_times
            return times[1] - times[0] if len(times) == 2 else None

    def wait_for_store_scrape(self, rendered_after: float, deadline: float) -> bool:
        """Block until a store's scraper received an answer rendered at or after
        ``rendered_after`` (monotonic), or until ``deadline`` (monotonic); True if it did."""
        with self._cond:
            while self.last_store_render < rendered_after:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True


def linger_until(
    *,
    now: float,
    linger_seconds: float,
    store_scraped: bool,
    published: bool,
    opened_at: float,
) -> float | None:
    """The monotonic deadline ``close()`` waits until for a store scrape of the final values,
    or None for no wait at all.

    - Scraped by a store before: the scraper comes back within one interval; wait for it, at
      most ``linger_seconds``.
    - Never scraped, but the rank published its target (``sd_dir``, ``daemon_url``): a short
      run may end before the scraper's first visit; wait for it until ``linger_seconds`` after
      the endpoint opened. A run older than that was never going to be scraped: no wait.
    - Never scraped and never published: nothing says a scraper exists; no wait.
    """
    if linger_seconds <= 0:
        return None
    if store_scraped:
        return now + linger_seconds
    if published and now < opened_at + linger_seconds:
        return opened_at + linger_seconds
    return None
