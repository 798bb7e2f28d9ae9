"""The metric catalogue: consistent entries (its docs page is generated from it: tests/docs)."""

import re

import pytest

from ddpmon import metrics
from ddpmon.metrics import CATALOGUE, Layer, MetricType


def test_entries_follow_prometheus_naming():
    names = [m.name for m in CATALOGUE]
    assert len(names) == len(set(names)) == len(metrics.BY_NAME)
    for m in CATALOGUE:
        assert re.fullmatch(r"ddpmon_[a-z0-9_]+", m.name), m.name
        assert m.name.endswith("_total") == (m.type is MetricType.COUNTER), m.name
        base = m.name.removesuffix("_total")
        assert not m.unit or base.endswith(f"_{m.unit}"), f"{m.name}: unit {m.unit}"
        assert m.help.endswith(".") and not m.help[0].islower(), m.name
        assert not set(m.labels) & {"run", "rank", "le"}, m.name


def test_module_constants_are_the_catalogue():
    # every entry the package names (its parts' re-exported) is in a catalogue, once
    constants = [v.name for v in vars(metrics).values() if isinstance(v, metrics.Metric)]
    catalogued = [m.name for m in (*CATALOGUE, *metrics.NODE_CATALOGUE)]
    assert sorted(constants) == sorted(catalogued) and len(set(catalogued)) == len(catalogued)
    assert metrics.GRAD_NORM.name == "ddpmon_grad_norm"
    assert metrics.STEPS.family == "ddpmon_steps"
    assert metrics.STEP_DURATION.sample("count") == "ddpmon_step_duration_seconds_count"
    assert set(metrics.__all__) >= {"GRAD_NORM", "Layer", "CATALOGUE"}


@pytest.mark.parametrize(
    ("layer", "slug"),
    [
        (Layer.DATA_SUPPLY, "data_supply"),
        (Layer.IDENTITY, "identity"),
        (Layer.NUMERICS, "numerics"),
    ],
)
def test_layer_slugs(layer, slug):
    assert layer.slug == slug
