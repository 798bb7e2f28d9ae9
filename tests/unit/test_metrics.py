"""The metric catalogue: consistent entries, and the README table in step with it."""

import re
from pathlib import Path

import pytest

from ddpmon import metrics
from ddpmon.metrics import CATALOGUE, Layer, MetricType

README = Path(__file__).resolve().parents[2] / "README.md"
NAME = re.compile(r"`(ddpmon_[a-z0-9_]+)(?:\{([a-z_,]*)\})?`")


def readme_table() -> dict[str, dict[str, tuple[str, ...] | None]]:
    """``{layer: {metric: labels or None}}`` from the "What is measured" table."""
    text = README.read_text()
    start = text.index("### What is measured")
    rows: dict[str, dict[str, tuple[str, ...] | None]] = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("layer", "---"):
            continue
        rows[cells[0]] = {
            name: tuple(labels.split(",")) if labels else None
            for name, labels in NAME.findall(cells[1])
        }
    return rows


def test_readme_table_names_every_catalogue_metric_in_its_layer_and_nothing_else():
    table = readme_table()
    assert list(table) == [layer.value for layer in Layer]
    for layer in Layer:
        documented = table[layer.value]
        declared = {m.name: m for m in metrics.by_layer(layer)}
        assert set(documented) == set(declared), (
            f"{layer}: missing from README {sorted(set(declared) - set(documented))}, "
            f"not in the catalogue {sorted(set(documented) - set(declared))}"
        )
        for name, labels in documented.items():
            assert labels == (declared[name].labels or None), f"{name}: labels differ"


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
    constants = [v for v in vars(metrics).values() if isinstance(v, metrics.Metric)]
    assert constants == list(CATALOGUE)
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
