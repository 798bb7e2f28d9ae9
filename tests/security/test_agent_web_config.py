"""The agent with a web config: a bad file means no endpoint at all (never an insecure one),
a precise error in the log, and training that goes on; a good file means TLS + basic auth."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import torch
from conftest import PASSWORD, client_ctx, fetch
from prometheus_client.parser import text_string_to_metric_families

import ddpmon
from tests.support.ports import free_port


def train(mon_steps: int):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return (
        model,
        opt,
        lambda: [
            (opt.zero_grad(), model(torch.randn(3, 4)).sum().backward(), opt.step())
            for _ in range(mon_steps)
        ],
    )


def sample(text: bytes, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_bad_web_config_serves_nothing_and_training_continues(tmp_path: Path, caplog):
    cfg = tmp_path / "web.yml"
    cfg.write_text("basic_auth_users:\n  prometheus: hunter2\n")
    port = free_port()
    model, opt, run = train(3)
    with caplog.at_level(logging.ERROR):
        mon = ddpmon.attach(
            model,
            opt,
            port=port,
            bind="127.0.0.1",
            web_config=str(cfg),
            run_dir=str(tmp_path / "runs"),
        )
    try:
        assert mon.port is None
        assert f"web_config {cfg}: basic_auth_users.prometheus: not a bcrypt hash" in caplog.text
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        run()
        text = mon.exposition.render()
        assert sample(text, "ddpmon_steps_total") == 3
        assert sample(text, "ddpmon_agent_errors_total", probe="server") == 1
    finally:
        mon.close()


def test_agent_serves_tls_and_basic_auth(tmp_path: Path, pki, pw_hash):
    cfg = tmp_path / "web.yml"
    cfg.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"basic_auth_users:\n  prometheus: '{pw_hash}'\n"
    )
    model, opt, run = train(2)
    mon = ddpmon.attach(
        model,
        opt,
        port=free_port(),
        bind="127.0.0.1",
        web_config=str(cfg),
        run_dir=str(tmp_path / "runs"),
    )
    try:
        run()
        assert mon.port is not None
        ctx = client_ctx(pki)
        assert fetch(mon.port, ctx=ctx)[0] == 401
        with pytest.raises(OSError):
            fetch(mon.port)
        status, _, body = fetch(mon.port, ctx=ctx, auth=("prometheus", PASSWORD))
        assert status == 200 and sample(body, "ddpmon_steps_total") == 2
    finally:
        mon.close()
