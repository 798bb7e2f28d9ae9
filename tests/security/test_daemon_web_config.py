"""``ddpmon daemon --web-config``: the auth matrix of TLS, mTLS, basic auth and the bearer token,
against the real daemon started with its CLI."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import sys
from pathlib import Path

import pytest
from conftest import PASSWORD, client_ctx
from sec_daemon import TOKEN, start_daemon
from sec_pki import Pki

from tests.support.agent_call import call as agent_call
from tests.support.agent_call import wait_for_socket

pytestmark = pytest.mark.timeout(120)
REFUSED = (OSError, http.client.HTTPException)


def call(
    port: int,
    path: str,
    *,
    method: str = "GET",
    ctx: ssl.SSLContext | None = None,
    host: str = "127.0.0.1",
    auth: tuple[str, str] | None = None,
    bearer: str | None = None,
    body: dict | None = None,
) -> tuple[int, dict[str, str], bytes]:
    conn: http.client.HTTPConnection
    if ctx is not None:
        conn = http.client.HTTPSConnection(host, port, timeout=10, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=10)
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(
            f"{auth[0]}:{auth[1]}".encode()).decode()
    if bearer is not None:
        headers["Authorization"] = f"Bearer {bearer}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def web_config(tmp_path: Path, pki: Pki, pw_hash: str, extra: str = "") -> Path:
    path = tmp_path / "web.yml"
    path.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        + extra
        + f"basic_auth_users:\n  prometheus: '{pw_hash}'\n"
        "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"
    )
    return path


def test_daemon_auth_matrix(spawn, tmp_path, pki, pw_hash):
    _, port = start_daemon(spawn, tmp_path, "d", "--web-config", str(web_config(tmp_path, pki,
                                                                                  pw_hash)))
    ctx, good = client_ctx(pki), ("prometheus", PASSWORD)
    for path in ("/metrics", "/sd", "/healthz", "/api/v1/jobs", "/no/such/path"):
        status, headers, _ = call(port, path, ctx=ctx)
        assert status == 401, path  # before routing: anonymous clients learn nothing
        assert headers["www-authenticate"].startswith("Basic")
        assert call(port, path, ctx=ctx, auth=("prometheus", "wrong"))[0] == 401
        assert call(port, path, ctx=ctx, auth=("nobody", PASSWORD))[0] == 401
    status, headers, body = call(port, "/metrics", ctx=ctx, auth=good)
    assert status == 200 and b"ddpmon_node_" in body
    assert headers["x-content-type-options"] == "nosniff"
    status, _, body = call(port, "/sd", ctx=ctx, auth=good)
    assert status == 200 and json.loads(body) == []
    # Plain HTTP at the TLS port gets no answer; a client that does not trust the CA neither.
    with pytest.raises(REFUSED):
        call(port, "/metrics", auth=good)
    with pytest.raises(ssl.SSLError):
        call(port, "/metrics", ctx=ssl.create_default_context(), auth=good)
    # Job routes: basic auth lets reads through but mutations still need the bearer token.
    submit = {"id": "j1", "entrypoint": "nope", "nproc": 1}
    assert call(port, "/api/v1/jobs", ctx=ctx, auth=good)[0] == 200
    assert call(port, "/api/v1/jobs", method="POST", ctx=ctx, auth=good, body=submit)[0] == 401
    assert call(port, "/api/v1/jobs", method="POST", ctx=ctx, bearer="wrong",
                body=submit)[0] == 401
    status, _, body = call(port, "/api/v1/jobs", method="POST", ctx=ctx, bearer=TOKEN,
                           body=submit)
    assert status == 400 and b"nope" in body  # past both checks, refused by the allow-list
    assert call(port, "/api/v1/jobs", ctx=ctx, bearer=TOKEN)[0] == 200
    assert call(port, "/api/v1/jobs/j9", method="DELETE", ctx=ctx, bearer=TOKEN)[0] == 404
    # The token opens job routes only, never /metrics or /sd.
    assert call(port, "/metrics", ctx=ctx, bearer=TOKEN)[0] == 401


def test_daemon_mtls(spawn, tmp_path, pki, pw_hash):
    cfg = web_config(tmp_path, pki, pw_hash, f"  client_ca_file: {pki.ca}\n")
    _, port = start_daemon(spawn, tmp_path, "m", "--web-config", str(cfg))
    good = ("prometheus", PASSWORD)
    with pytest.raises(REFUSED):
        call(port, "/metrics", ctx=client_ctx(pki), auth=good)
    with pytest.raises(REFUSED):
        call(port, "/metrics", ctx=client_ctx(pki, cert=(pki.rogue_cert, pki.rogue_key)),
             auth=good)
    ctx = client_ctx(pki, cert=(pki.client_cert, pki.client_key))
    assert call(port, "/metrics", ctx=ctx)[0] == 401
    assert call(port, "/metrics", ctx=ctx, auth=good)[0] == 200


def test_registration_on_the_agent_socket_under_tls(spawn, tmp_path, pki, pw_hash):
    """Bound to a node address with TLS and basic auth, agents still register without either,
    on the agent socket, and show up in the TLS-protected /sd; the TCP port refuses them."""
    cfg = web_config(tmp_path, pki, pw_hash)
    proc, port = start_daemon(spawn, tmp_path, "n", "--web-config", str(cfg), bind="127.0.0.2")
    sock = tmp_path / "n-state" / "agent.sock"
    wait_for_socket(sock)
    with socket.create_server(("127.0.0.2", 0)) as endpoint:
        own = endpoint.getsockname()[1]
        reg = {"run": "r1", "rank": 3, "local_rank": 1, "node": "n-node", "port": own,
               "host": "127.0.0.2"}  # fmt: skip
        status, doc = agent_call(sock, "POST", "/api/v1/ranks", reg)
        assert status == 201, doc
        assert agent_call(sock, "GET", "/sd")[0] == 404  # nothing else on the agent socket
        ctx = client_ctx(pki)
        ctx.check_hostname = False  # the test certificate names 127.0.0.1 only; the CA counts
        status, _, body = call(
            port, "/sd", ctx=ctx, host="127.0.0.2", auth=("prometheus", PASSWORD)
        )
        groups = json.loads(body)
        assert status == 200 and [g["targets"] for g in groups] == [[f"127.0.0.2:{own}"]]
        assert groups[0]["labels"]["rank"] == "3" and groups[0]["labels"]["local_rank"] == "1"
        status, _, body = call(
            port, "/api/v1/ranks", method="POST", body=reg, ctx=ctx, host="127.0.0.2",
            auth=("prometheus", PASSWORD),
        )
        assert status == 403 and json.loads(body)["agent_socket"] == str(sock)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tls_server_config:\n  cert_file: nope.crt\n  key_file: nope.key\n", "cert_file"),
        ("basic_auth_users:\n  prometheus: plaintext\n", "not a bcrypt hash"),
        ("tls_server_config: {cert_file: a, key_file: b, cipher_suites: [x]}\n", "cipher_suites"),
    ],
)
def test_bad_web_config_is_one_clear_error(spawn, tmp_path, text, message):
    cfg = tmp_path / "web.yml"
    cfg.write_text(text)
    proc = spawn(
        [sys.executable, "-m", "ddpmon.cli", "daemon", "--port", "0", "--state-dir",
         str(tmp_path / "s"), "--web-config", str(cfg)],
        "bad",
    )
    assert proc.wait(timeout=60) == 2
    out = proc.output_path.read_text()
    assert message in out and str(cfg) in out and "Traceback" not in out
