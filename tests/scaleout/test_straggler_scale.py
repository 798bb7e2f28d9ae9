"""1,024 simulated ranks of one DDP run through the shipped rules (issue 48, at scale), on a real
Prometheus and a real VictoriaMetrics: a 5 % straggler is named within 50 steps of its start
(the rank-health problem, then the alert after its ``for``) with cause ``compute``, no other
rank is named, and the hang alert names exactly the ranks the others wait for, not the
thousand that wait. ``benchmarks/straggler_scale.py`` is the simulation (its docstring says
how the series are made); this test checks what it names, never its speed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "straggler_scale", ROOT / "benchmarks" / "straggler_scale.py"
    )
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("store", ["prometheus", "victoria-metrics"])
def test_a_5_percent_straggler_and_the_hang_holders_are_named_among_1024_ranks(
    store: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    rc = _bench().main(["--ranks", "1024", "--store", store, "--no-timings",
                        "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0, res
    assert res["named_at_step"] is not None and 0 <= res["named_at_step"] <= 50, res
    assert res["others_named"] == [] and res["others_alerted"] == [], res
    assert res["cause"] == ["compute"], res
    # The alert waits its ``for`` past the naming, and then fires.
    assert res["alert_fires_at_step"] is not None, res
    assert res["alert_fires_at_step"] >= res["named_at_step"], res
    assert res["hang_named"] == res["hang_holders"] and len(res["hang_holders"]) == 3, res
