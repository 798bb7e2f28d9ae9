"""PromQL building blocks of the dashboard queries.

Query templates carry placeholders that :func:`expand` fills from the config: ``{S}`` (the ranks
the user selected), ``{R}`` (every rank of the run: medians and leaders are run-wide whatever
ranks are shown), ``{D}`` (one rank, rank detail), ``{D0}`` (rank 0 of the run: the copy of a
series only rank 0 exports under ``series_profile=large``), the same three with an ``R`` suffix for
recording-rule outputs (``{SR}``, ``{RR}``, ``{DR}``), and ``{K}`` (``dashboard_topk``).
"""

from __future__ import annotations

from ddpmon.mixin.config import MixinConfig

ALERT_SELECTOR = 'alertname=~"Ddpmon.*", alertstate="firing", run=~"$run|"'
"""Firing ddpmon alerts of the selected run (and run-less ones)."""


def base_matchers(cfg: MixinConfig) -> str:
    """The job selector plus ``dashboard_selector``: what every dashboard query matches."""
    return ", ".join(m for m in (cfg.job_selector, cfg.dashboard_selector) if m.strip())


def selectors(cfg: MixinConfig) -> dict[str, str]:
    job = base_matchers(cfg) + ', cluster=~"$cluster"'
    extra = f"{cfg.dashboard_selector}, " if cfg.dashboard_selector.strip() else ""
    extra += 'cluster=~"$cluster", '
    return {
        "S": f'{{{job}, run="$run", rank=~"$rank"}}',
        "R": f'{{{job}, run="$run"}}',
        "D": f'{{{job}, run="$run", rank="$rank"}}',
        "D0": f'{{{job}, run="$run", rank="0"}}',
        "SR": f'{{{extra}run="$run", rank=~"$rank"}}',
        "RR": f'{{{extra}run="$run"}}',
        "DR": f'{{{extra}run="$run", rank="$rank"}}',
    }


def expand(template: str, cfg: MixinConfig) -> str:
    """Fill a query template's placeholders for ``cfg``."""
    sel = selectors(cfg)
    for key in ("SR", "RR", "DR", "D0", "S", "R", "D"):
        template = template.replace(f"{{{key}}}", sel[key])
    return template.replace("{K}", str(cfg.dashboard_topk))


def hq(q: float, metric: str, by: str, s: str) -> str:
    """histogram_quantile over ``rate`` of the buckets, aggregated ``by`` (plus ``le``)."""
    return (
        f"histogram_quantile({q}, sum by ({by}, le) "
        f"(rate({metric}_bucket{s}[$__rate_interval])))"
    )


def over_range(expr: str) -> str:
    """The same expression over the whole dashboard range, evaluated once at its end."""
    return expr.replace("[$__rate_interval]", "[$__range] @ end()")


def ranked(fn: str, now: str, whole_range: str) -> str:
    """``now`` for the k ranks that rank highest (``topk``) or lowest (``bottomk``) by
    ``whole_range``: one fixed set of k ranks for the whole graph. A plain ``topk`` in a range
    query picks k ranks per step, so at 1024 ranks the graph would draw hundreds of them."""
    return f"{now} and on (rank) {fn}({{K}}, {whole_range})"


def ranks_of(fn: str, selector: str, whole_range: str) -> str:
    """``selector`` narrowed to the k ranks of ``ranked`` *before* any arithmetic on it: a
    binary operation in a range query runs per step over every series it is given, so at
    16,384 ranks ``(x / y) and on (rank) topk(...)`` took 3-4 s on Prometheus where
    ``(x and on (rank) topk(...)) / y`` takes under 1 s (the same k series)."""
    return f"({ranked(fn, selector, whole_range)})"


def gauge_top(fn: str, metric: str, sel: str = "{S}") -> str:
    over = "max_over_time" if fn == "topk" else "min_over_time"
    return ranked(fn, f"{metric}{sel}", f"{over}({metric}{sel}[$__range] @ end())")


def rate_top(fn: str, now: str) -> str:
    return ranked(fn, now, over_range(now))
