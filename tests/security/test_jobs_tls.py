"""``ddpmon jobs`` against a daemon behind TLS: ``--ca`` and ``--client-config`` (the client
config of ``ddpmon top --scrape-config``), with the real daemon and the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PASSWORD
from sec_daemon import TOKEN, start_daemon

pytestmark = pytest.mark.timeout(120)


def jobs(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "jobs", *argv],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", **(env or {})},
    )


def tls_daemon(spawn, tmp_path: Path, pki, pw_hash: str | None = None) -> tuple[int, Path]:
    cfg = tmp_path / "web.yml"
    text = f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
    if pw_hash:
        text += f"basic_auth_users:\n  prometheus: '{pw_hash}'\n"
    cfg.write_text(text)
    _, port = start_daemon(spawn, tmp_path, "d", "--web-config", str(cfg))
    token = tmp_path / "d-state" / "token"
    assert token.read_text().strip() == TOKEN
    return port, token


def test_ca_names_the_daemons_ca_and_without_it_the_certificate_is_refused(spawn, tmp_path,
                                                                          pki):
    port, token = tls_daemon(spawn, tmp_path, pki)
    url = f"https://127.0.0.1:{port}"
    refused = jobs("--url", url, "--token-file", str(token), "list")
    assert refused.returncode == 3 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr
    ok = jobs("--url", url, "--ca", str(pki.ca), "--token-file", str(token), "--json", "list")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["jobs"] == []
    # a mutation goes through TLS too: past the token check, refused by the allow-list
    sub = jobs("--url", url, "--ca", str(pki.ca), "--token-file", str(token), "submit", "j1",
               "nope")
    assert sub.returncode != 0 and "nope" in sub.stdout + sub.stderr
    assert "HTTP 400" in sub.stdout + sub.stderr


def test_client_config_gives_ca_basic_auth_and_server_name(spawn, tmp_path, pki, pw_hash):
    port, token = tls_daemon(spawn, tmp_path, pki, pw_hash)
    url = f"https://127.0.0.1:{port}"
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    cfg = tmp_path / "client.yml"
    cfg.write_text(f"tls_config:\n  ca_file: {pki.ca}\n  server_name: localhost\n"
                   "basic_auth:\n  username: prometheus\n  password_file: pw\n")
    ok = jobs("--url", url, "--client-config", str(cfg), "--json", "list")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    no_auth = tmp_path / "noauth.yml"
    no_auth.write_text(f"tls_config:\n  ca_file: {pki.ca}\n")
    denied = jobs("--url", url, "--client-config", str(no_auth), "list")
    assert denied.returncode != 0 and "HTTP 401" in denied.stdout + denied.stderr
    wrong_name = tmp_path / "wrong.yml"
    wrong_name.write_text(f"tls_config:\n  ca_file: {pki.ca}\n  server_name: rank0.example\n")
    mismatch = jobs("--url", url, "--client-config", str(wrong_name), "list")
    assert mismatch.returncode == 3 and "rank0.example" in mismatch.stderr


def test_a_bad_client_config_is_one_line_naming_the_file(tmp_path):
    cfg = tmp_path / "client.yml"
    cfg.write_text("tls_config:\n  ca_fle: ca.crt\n")
    bad = jobs("--client-config", str(cfg), "list")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and str(cfg) in bad.stderr and "ca_fle" in bad.stderr
    missing = jobs("--ca", str(tmp_path / "nope.crt"), "list")
    assert missing.returncode == 2 and "nope.crt" in missing.stderr
    both = jobs("--ca", "a", "--client-config", "b", "list")
    assert both.returncode == 2 and "not allowed with" in both.stderr
