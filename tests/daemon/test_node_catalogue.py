"""The node daemon's series are the metric catalogue's: every family its collector serves is
declared in ``ddpmon.metrics`` (name, type, help and labels), and ``node.py`` names none itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

from ddpmon import metrics
from ddpmon.daemon import node
from ddpmon.daemon.node import NodeCollector
from ddpmon.metrics.types import MetricType
from ddpmon.sources.nvml import NvmlSource
from tests.daemon.test_daemon_units import FakeNvml


def test_every_family_the_daemon_serves_is_declared_in_the_catalogue(tmp_path: Path) -> None:
    collector = NodeCollector(node="n1", nvml=NvmlSource(FakeNvml()), job_counts=lambda: {},
                              live_ranks=lambda: 0, disk_paths=(str(tmp_path),))
    declared = {m.family: m for m in (*metrics.CATALOGUE, *metrics.NODE_CATALOGUE)}
    served = list(collector.collect())
    assert len(served) >= len(metrics.NODE_CATALOGUE)  # every node series, GPUs included
    for family in served:
        entry = declared.get(family.name)
        assert entry is not None, f"{family.name} is not in ddpmon.metrics"
        assert family.documentation == entry.help
        assert isinstance(family, CounterMetricFamily) == (entry.type is MetricType.COUNTER)
        for sample in family.samples:
            assert tuple(sample.labels) == entry.labels, family.name
    assert {m.family for m in metrics.NODE_CATALOGUE} <= {f.name for f in served}


def test_node_metrics_names_no_series_itself() -> None:
    tree = ast.parse(Path(node.__file__).read_text())
    literals = [n.value for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and n.value.startswith("ddpmon_")]
    assert literals == []


def test_node_series_carry_no_run_or_rank() -> None:
    for entry in metrics.NODE_CATALOGUE:
        assert entry.all_labels == entry.labels, entry.name
    assert not set(metrics.NODE_CATALOGUE) & set(metrics.CATALOGUE)
