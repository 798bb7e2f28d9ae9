"""docs/architecture.md's "Add a step field" and "Add a per-step metric", held: a new
fused-path step value is its catalogue entry, its declaration and its computation (three
places, applied to a copy of ddpmon), a per-step metric is an object passed to ``attach``; each
reaches /metrics, the history, ``compare`` and ``report``."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ddpmon
from ddpmon.config import ConfigError
from ddpmon.metrics import Layer, Metric, MetricType, step_fields, step_metrics
from ddpmon.metrics.step_metrics import StepMetric
from ddpmon.recorder import history_schema
from tests.support.recipe_run import reach

ROOT = Path(__file__).resolve().parents[2]

# -- a step field: the recipe's three places, as edits to a copy of the source --------------
RECIPE = {
    "ddpmon/metrics/__init__.py": ("", '''
LOSS_DOUBLED = Metric("ddpmon_test_loss_doubled", MetricType.GAUGE, "Twice the step's loss.",
                      Layer.NUMERICS)
'''),
    "ddpmon/metrics/step_fields.py": ('REQUIRED = object()\n', '''

def loss_doubled(inputs):  # the computation: a device value stays a tensor
    return None if inputs.loss is None else 2 * inputs.loss
'''),
    "ddpmon/metrics/step_fields.py ": (
        '    StepField("logit_max", dict[str, float], factory=dict),\n', '''\
    StepField("loss_doubled", float | None, fold=Fold.LAST, metric=m.LOSS_DOUBLED,
              column="float32", column_doc="twice the loss", summary="loss_doubled",
              compare=True, compute=loss_doubled),
'''),
}
"""file -> (the line it goes after, or "" for the file's end; what is added)."""


def _apply(copy: Path) -> None:
    for name, (after, added) in RECIPE.items():
        path = copy / name.strip()
        text = path.read_text()
        if after:
            assert text.count(after) == 1, (name, after)
            text = text.replace(after, after + added)
        else:
            text += added
        path.write_text(text)


def test_a_step_field_is_its_declaration_its_computation_and_its_series(tmp_path):
    assert len(RECIPE) <= 3  # the bound on places a new step value touches
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "ddpmon", copy / "ddpmon",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests" / "support", copy / "tests" / "support",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "tests" / "__init__.py").write_text("")
    _apply(copy)
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.recipe_run", str(tmp_path / "runs"),
         "loss_doubled"], cwd=copy, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    twice = [2 * loss for loss in got["losses"]]
    assert got["metrics"]["ddpmon_test_loss_doubled"] == pytest.approx(twice[-1], rel=1e-6)
    assert got["history"] == pytest.approx(twice, rel=1e-6)  # float32 column
    assert got["compared"] and got["first_step"] == 3  # run B's data shifts at step 3
    assert got["plotted"]
    summary = json.loads((tmp_path / "runs" / "a" / "r" / "summary.rank0.json").read_text())
    assert summary["loss_doubled"] == pytest.approx(twice[-1], rel=1e-6)


def test_the_declarations_keep_the_history_format():
    """The columns files have always had, in their order; new fields append after them."""
    names = [n for n, _ in history_schema.SCALAR_COLUMNS]
    assert names == list(history_schema.FORMAT_ORDER) + list(history_schema.ADDED_COLUMNS)
    assert history_schema.ADDED_COLUMNS == ()
    assert set(history_schema.ROW_FIELDS) <= step_metrics.TAKEN_COLUMNS | {"group_norms"}
    assert all(f.column_doc for f in step_fields.IN_HISTORY)


# -- a per-step metric: an object passed to attach --------------------------------------------
TOKENS = Metric("ddpmon_test_tokens_total", MetricType.COUNTER, "Tokens trained on.",
                Layer.DATA_SUPPLY)


def tokens(inputs):  # a host value
    return 5.0 * (inputs.step + 1) if inputs.step < 3 else 40.0


def test_a_per_step_metric_reaches_metrics_history_compare_and_report(tmp_path):
    entry = StepMetric("tokens", TOKENS, tokens)
    got = reach(tmp_path, "tokens", step_metrics=[entry, "learning_rate"])
    assert got["metrics"]["ddpmon_test_tokens_total"] == 5 + 10 + 15 + 40 * 3
    assert got["metrics"]["ddpmon_learning_rate"] == 0.1  # a name still works beside it
    assert got["history"] == [5.0, 10.0, 15.0, 40.0, 40.0, 40.0]  # each step's own value
    assert got["compared"] and got["first_step"] is None  # same values in both runs
    assert got["plotted"]


def test_a_per_step_metric_object_is_checked_at_attach():
    with pytest.raises(ConfigError, match="a history column already"):
        ddpmon.Config(step_metrics=[StepMetric("loss", TOKENS, tokens)])
    with pytest.raises(ConfigError, match="PerStepMetric protocol"):
        ddpmon.Config(step_metrics=[object()])
