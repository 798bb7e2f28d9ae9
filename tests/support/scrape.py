"""The suite's one scrape helper: read a rank's ``/metrics`` over real HTTP and parse it with
``prometheus_client``'s parser (the text a Prometheus would get)."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterable

from prometheus_client.parser import text_string_to_metric_families

IDENTITY_LABELS = frozenset({"run", "rank"})


def scrape_text(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> str:
    """The body of ``http://HOST:PORT/metrics``; raises if the endpoint does not answer."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
        return resp.read().decode()


def parse(
    text: str, keep: Callable[[str], bool] = lambda label: label not in IDENTITY_LABELS
) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted (label, value) pairs kept by keep): value}``; by default the
    run and rank labels, the same on every sample of one rank, are left out."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if keep(k))))] = s.value
    return out


def scrape(port: int, keep: Callable[[str], bool] | None = None, **kw) -> dict:
    """``parse(scrape_text(port))``."""
    text = scrape_text(port, **kw)
    return parse(text) if keep is None else parse(text, keep)


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample called ``name`` in an exposition."""
    return [
        (dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample ``name`` whose labels include ``labels``, or None."""
    for have, value in samples(text, name):
        if labels.items() <= have.items():
            return value
    return None


def lines_of(text: str, names: Iterable[str]) -> list[str]:
    """The exposition lines of the samples named ``names`` (as a Prometheus reads them)."""
    heads = tuple(f"{n}{sep}" for n in names for sep in ("{", " "))
    return [line for line in text.splitlines() if line.startswith(heads)]
