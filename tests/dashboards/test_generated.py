"""The committed dashboards and manifests are exactly what the mixin generates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ddpmon.cli import main
from ddpmon.mixin import dashboards, outputs
from ddpmon.mixin.config import MixinConfig

ROOT = Path(__file__).resolve().parents[2]


def test_committed_files_match_generator() -> None:
    diffs = outputs.check(ROOT)
    assert not diffs, "run `ddpmon dashboards --write`:\n" + "".join(diffs)[:4000]


def test_check_command_detects_drift_and_write_repairs_it(tmp_path: Path, capsys) -> None:
    for rel in outputs.generate():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert main(["dashboards", "--check", "--root", str(tmp_path)]) == 0
    overview = tmp_path / "dashboards" / dashboards.FILENAMES[dashboards.OVERVIEW_UID]
    doc = json.loads(overview.read_text())
    doc["panels"][1]["title"] = "hand-edited"
    overview.write_text(json.dumps(doc))
    assert main(["dashboards", "--check", "--root", str(tmp_path)]) == 1
    assert "hand-edited" in capsys.readouterr().out
    assert main(["dashboards", "--write", "--root", str(tmp_path)]) == 0
    assert main(["dashboards", "--check", "--root", str(tmp_path)]) == 0


def test_config_drives_output() -> None:
    """A config change reaches every output (so the diff test above would catch it)."""
    changed = outputs.generate(MixinConfig(job_selector='job="training"', dashboard_topk=3))
    default = outputs.generate()
    assert set(changed) == set(default)
    for rel in changed:
        if rel.endswith("kustomization.yaml"):
            continue
        assert changed[rel] != default[rel], rel
    overview = changed[f"dashboards/{dashboards.FILENAMES[dashboards.OVERVIEW_UID]}"]
    assert 'job=\\"training\\"' in overview and "topk(3," in overview
    assert 'job=\\"ddpmon\\"' not in overview
