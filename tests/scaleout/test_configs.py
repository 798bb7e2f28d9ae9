"""The shipped scale-out configs are valid for the binaries that run them, and stay in step with
the single-Prometheus ones (cheap checks; the live path is test_sharded_path.py)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ddpmon.mixin import render, shipped
from ddpmon.services import StackError, find_binary, shard_scrape_config
from ddpmon.services.victoria import SHARD_SCRAPE_YML
from tests.support import alert_contract

try:
    VMAGENT, VMALERT = find_binary("vmagent"), find_binary("vmalert")
except StackError as exc:
    pytest.skip(f"{exc} (scripts/install-debs.sh)", allow_module_level=True)


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("shard", [0, 1])
def test_vmagent_accepts_the_shipped_shard_config(shard: int) -> None:
    proc = _run(
        [VMAGENT, f"-promscrape.config={shipped.path(SHARD_SCRAPE_YML)}",
         "-promscrape.config.dryRun", "-promscrape.config.strictParse"],
        env={"DDPMON_SHARD": str(shard), "DDPMON_SHARDS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_vmagent_refuses_a_broken_config(tmp_path: Path) -> None:
    """Control: the dry run can fail."""
    bad = tmp_path / "bad.yml"
    bad.write_text(shipped.path(SHARD_SCRAPE_YML).read_text().replace("hashmod", "hashmodd"))
    proc = _run(
        [VMAGENT, f"-promscrape.config={bad}", "-promscrape.config.dryRun",
         "-promscrape.config.strictParse"],
        env={"DDPMON_SHARD": "0", "DDPMON_SHARDS": "2"},
    )
    assert proc.returncode != 0


def test_shard_job_is_the_shipped_job_plus_hashmod(tmp_path: Path) -> None:
    """A change to the shipped scrape job must reach the shards too."""
    (single,) = yaml.safe_load(shipped.path(shipped.PROMETHEUS_YML).read_text())["scrape_configs"]
    (shard,) = shard_scrape_config(shard=1, shards=3, sd_dir=tmp_path)["scrape_configs"]
    shard_files = shard["file_sd_configs"][0]["files"]
    assert shard_files == [str(tmp_path.resolve() / "*.json")]
    relabel = shard.pop("relabel_configs")
    assert relabel[0] == {
        "source_labels": ["__address__"], "modulus": 3, "target_label": "__tmp_shard",
        "action": "hashmod",
    }
    assert relabel[1] == {"source_labels": ["__tmp_shard"], "regex": "1", "action": "keep"}
    assert shard["job_name"] == single["job_name"]
    assert shard["honor_labels"] == single["honor_labels"]
    with pytest.raises(ValueError, match="shard 3 is not in 0..2"):
        shard_scrape_config(shard=3, shards=3, sd_dir=tmp_path)


def test_vmalert_accepts_every_shipped_rule_and_template(tmp_path: Path) -> None:
    """vmalert parses every expression as MetricsQL and every annotation template; a failure
    names the rule (the engine comparison, test_engines.py, checks the answers)."""
    files = render.write(tmp_path, None)
    proc = _run([VMALERT, "-dryRun", *(f"-rule={f}" for f in files)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    broken = tmp_path / "broken.yml"
    text = files[0].read_text()
    broken.write_text(text.replace("expr: ", "expr: sum by (", 1))
    assert _run([VMALERT, "-dryRun", f"-rule={broken}"]).returncode != 0  # control


def test_the_where_each_rule_runs_table_classifies_every_alert() -> None:
    """docs/scale-out.md's federation table puts each alert on the shard (it reads one rank's
    series) or the global Prometheus (it aggregates the ranks of a run or reads a ``run:``
    record); a new alert must be placed there too."""
    groups = yaml.safe_load(render.generate()[render.ALERTS_FILE])["groups"]
    run_aggregation = re.compile(r"\b(by|on) \(cluster, namespace, job, run\b|\brun:")
    expected = {
        r["alert"]: "global" if run_aggregation.search(r["expr"]) else "each shard"
        for g in groups for r in g["rules"]
    }
    page = (Path(__file__).resolve().parents[2] / "docs" / "scale-out.md").read_text()
    assert alert_contract.federation_rows(page) == expected


def test_the_families_the_global_prometheus_federates_are_what_its_rules_read() -> None:
    rules = yaml.safe_load(render.generate()[render.RULES_FILE])["groups"]
    alerts = yaml.safe_load(render.generate()[render.ALERTS_FILE])["groups"]
    name = re.compile(r"\b((?:rank|run):[a-z_:0-9]+|ddpmon_[a-z_0-9]+|up)\b")
    run_aggregation = re.compile(r"\b(by|on) \(cluster, namespace, job, run\b|\brun:")
    read: set[str] = set()
    for r in (r for g in rules for r in g["rules"] if r["record"].startswith("run:")):
        read |= set(name.findall(r["expr"]))
    for a in (a for g in alerts for a in g["rules"] if run_aggregation.search(a["expr"])):
        read |= set(name.findall(a["expr"] + a["annotations"]["description"]))
    page = (Path(__file__).resolve().parents[2] / "docs" / "scale-out.md").read_text()
    listed = page.split("plus the raw families the global rules read (", 1)[1].split(")", 1)[0]
    assert set(re.findall(r"`([a-z_]+)`", listed)) == {
        x for x in read if not x.startswith(("rank:", "run:"))
    }
