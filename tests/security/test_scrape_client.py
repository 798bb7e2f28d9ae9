"""The shared scrape client against a real agent that serves TLS + basic auth: `ddpmon top`,
the daemon's job summary and the client itself read it with a scrape config, and a wrong
password, a wrong CA, a wrong server name or plain http each fail with an error that says why."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PASSWORD, client_ctx, fetch
from sec_pki import Pki, make_pki

import ddpmon
from ddpmon.daemon import summary
from ddpmon.daemon.settings import DaemonSettings
from ddpmon.export.scrape import ScrapeClient, ScrapeConfig, ScrapeError
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, pki: Pki, pw_hash: str):
    """One real agent with TLS + basic auth that has completed 3 steps."""
    d = tmp_path_factory.mktemp("agent")
    cfg = d / "web.yml"
    cfg.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"basic_auth_users:\n  prometheus: '{pw_hash}'\n"
    )
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ddpmon.attach(
        model, opt, port=free_port(), bind="127.0.0.1", web_config=str(cfg), run_dir=str(d)
    )
    try:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
        assert mon.port is not None
        assert fetch(mon.port, ctx=client_ctx(pki), auth=("prometheus", PASSWORD))[0] == 200
        yield mon
    finally:
        mon.close()


def scrape_yml(d: Path, *, ca: Path, password: str = PASSWORD, extra_tls: str = "") -> Path:
    (d / "pw").write_text(password + "\n")
    path = d / "scrape.yml"
    path.write_text(
        "basic_auth:\n  username: prometheus\n  password_file: pw\n"
        f"tls_config:\n  ca_file: {ca}\n{extra_tls}"
    )
    return path


def test_client_reads_the_agent_over_tls_with_basic_auth(agent, pki, tmp_path):
    client = ScrapeClient.from_file(scrape_yml(tmp_path, ca=pki.ca))
    values = client.samples(f"127.0.0.1:{agent.port}")  # https from the config's tls_config
    assert values["ddpmon_steps_total"] == 3 and values["rank"] == 0
    named = ScrapeClient.from_file(
        scrape_yml(tmp_path, ca=pki.ca, extra_tls="  server_name: localhost\n")
    )
    assert named.samples(f"https://127.0.0.1:{agent.port}")["ddpmon_step"] == 2


def test_wrong_password_is_a_clear_401(agent, pki, tmp_path):
    client = ScrapeClient.from_file(scrape_yml(tmp_path, ca=pki.ca, password="wrong"))
    with pytest.raises(ScrapeError) as err:
        client.fetch(f"https://127.0.0.1:{agent.port}")
    assert str(err.value) == (
        f"https://127.0.0.1:{agent.port}/metrics: 401 Unauthorized: the endpoint rejected the "
        "credentials of basic_auth.username 'prometheus'"
    )
    anonymous = ScrapeClient(ScrapeConfig(scheme="https", tls_config=client.config.tls_config))
    with pytest.raises(ScrapeError, match="401 Unauthorized: the endpoint wants basic auth"):
        anonymous.fetch(f"127.0.0.1:{agent.port}")


def test_wrong_ca_or_server_name_is_a_clear_tls_error(agent, pki, tmp_path):
    other = make_pki(tmp_path / "other-pki")
    client = ScrapeClient.from_file(scrape_yml(tmp_path, ca=other.ca))
    with pytest.raises(ScrapeError) as err:
        client.fetch(f"127.0.0.1:{agent.port}")
    message = str(err.value)
    assert message.startswith(
        f"https://127.0.0.1:{agent.port}/metrics: TLS certificate not trusted"
    )
    assert re.search(
        r"not trusted \(.*certificate.*\); check tls_config.ca_file and server_name", message
    )
    assert message.endswith(str(tmp_path / "scrape.yml"))
    wrong_name = ScrapeClient.from_file(
        scrape_yml(tmp_path, ca=pki.ca, extra_tls="  server_name: rank0.example\n")
    )
    with pytest.raises(ScrapeError, match="TLS certificate not trusted .*rank0.example"):
        wrong_name.fetch(f"127.0.0.1:{agent.port}")
    skip = ScrapeClient.from_file(
        scrape_yml(tmp_path, ca=other.ca, extra_tls="  insecure_skip_verify: true\n")
    )
    assert skip.samples(f"127.0.0.1:{agent.port}")["ddpmon_steps_total"] == 3


def test_plain_http_to_a_tls_endpoint_says_so(agent):
    with pytest.raises(ScrapeError, match=r"http://127.0.0.1:\d+/metrics: .*https"):
        ScrapeClient().fetch(f"127.0.0.1:{agent.port}", timeout=3)


def top(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "top", "--once", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={"COLUMNS": "250", "PATH": "/usr/bin"},
    )


def test_top_once_json_over_https(agent, pki, tmp_path):
    cfg = scrape_yml(tmp_path, ca=pki.ca)
    ok = top("--json", "--scrape-config", str(cfg), "--targets", f"https://127.0.0.1:{agent.port}")
    assert ok.returncode == 0, ok.stderr
    (doc,) = [json.loads(line) for line in ok.stdout.splitlines()]  # one snapshot, then exit
    (values,) = doc["ranks"].values()
    assert values["ddpmon_steps_total"] == 3 and doc["errors"] == {}
    (tmp_path / "denied").mkdir()
    denied = top(
        "--json",
        "--scrape-config",
        str(scrape_yml(tmp_path / "denied", ca=pki.ca, password="nope")),
        "--targets",
        f"https://127.0.0.1:{agent.port}",
    )
    assert denied.returncode == 1
    (error,) = json.loads(denied.stdout)["errors"].values()
    assert "401 Unauthorized" in error
    table = top("--scrape-config", str(cfg), "--targets", f"127.0.0.1:{agent.port}")
    assert table.returncode == 0 and "communication" in table.stdout, table.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text("tls_config: {ca_file: absent.crt}\n")
    refused = top("--scrape-config", str(bad), "--targets", f"127.0.0.1:{agent.port}")
    assert refused.returncode == 2
    assert f"{bad}: tls_config.ca_file: {tmp_path / 'absent.crt'}: no such file" in refused.stderr


def test_daemon_job_summary_reads_tls_ranks_with_its_scrape_config(agent, pki, tmp_path):
    scrape_yml(tmp_path, ca=pki.ca)
    (tmp_path / "daemon.yaml").write_text("scrape_config: scrape.yml\n")
    settings = DaemonSettings.load(tmp_path / "daemon.yaml")
    got = summary.merge({}, "127.0.0.1", [agent.port], client=settings.scrape_client())
    assert got["ranks_up"] == 1 and got["ranks"]["0"]["steps_total"] == 3
    assert "scrape_errors" not in got
    plain = summary.merge(got, "127.0.0.1", [agent.port])
    assert plain["ranks_up"] == 0 and plain["ranks"]["0"]["up"] is False
    assert "https" in plain["scrape_errors"]["0"]


def test_client_certificate_for_mtls(make_server, pki, pw_hash, tmp_path):
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"
    )
    srv = make_server(web)
    without = ScrapeClient(
        ScrapeConfig.from_dict(
            {"tls_config": {"ca_file": str(pki.ca)}}, source="inline", base_dir=tmp_path
        )
    )
    with pytest.raises(ScrapeError, match="TLS handshake failed|connection closed"):
        without.fetch(f"127.0.0.1:{srv.port}", timeout=3)
    with_cert = ScrapeClient(
        ScrapeConfig.from_dict(
            {
                "tls_config": {
                    "ca_file": str(pki.ca),
                    "cert_file": str(pki.client_cert),
                    "key_file": str(pki.client_key),
                }
            },
            source="inline",
            base_dir=tmp_path,
        )
    )
    assert with_cert.fetch(f"127.0.0.1:{srv.port}").startswith("# HELP ddpmon_test")
