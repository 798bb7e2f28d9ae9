"""Every agent metric the rules, alerts and dashboards select is one of the metric catalogue's
(``ddpmon/metrics/``): a rename there that misses the mixin fails here."""

from __future__ import annotations

import re

from ddpmon import metrics
from ddpmon.mixin import outputs, render

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
NAME = re.compile(r"(?<![:\w])ddpmon_[a-z0-9_]+")  # not inside a rule name


def _known(name: str) -> bool:
    if name in metrics.BY_NAME:
        return True
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and metrics.BY_NAME.get(base, None) is not None:
            return metrics.BY_NAME[base].type is metrics.MetricType.HISTOGRAM
    return False


def test_every_selected_metric_is_in_the_catalogue() -> None:
    texts = list(render.generate().values()) + [
        t for rel, t in outputs.generate().items() if rel.startswith("dashboards/")
    ]
    used = {n for text in texts for n in NAME.findall(text)}
    # Not metrics: label values and file names that start like one.
    used -= {"ddpmon_rank_info_"}
    assert len(used) >= 25, used
    unknown = sorted(n for n in used if not _known(n))
    assert unknown == [], unknown


def test_the_check_can_fail() -> None:
    assert not _known("ddpmon_grad_norms")
    assert not _known("ddpmon_loss_bucket")  # a gauge has no buckets
    assert _known("ddpmon_step_duration_seconds_bucket")
