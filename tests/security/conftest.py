"""Fixtures for endpoint-hardening tests: fresh PKI, web config files, a server factory and a
small HTTP client that speaks plain or TLS with optional basic auth."""

from __future__ import annotations

import base64
import http.client
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import bcrypt
import pytest
from sec_pki import Pki, make_pki

from ddpmon.export.server import Limits, MetricsServer

PASSWORD = "s3cret-pass"
BODY = b"# HELP ddpmon_test 1\n# TYPE ddpmon_test gauge\nddpmon_test 1\n"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def pw_hash() -> str:
    # Cost 4 keeps tests fast; the dummy hash for unknown users takes the same cost.
    return bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


@pytest.fixture
def make_server() -> Iterator[Callable[..., MetricsServer]]:
    servers: list[MetricsServer] = []

    def factory(
        web_config: str | Path | None = None,
        render: Callable[[], bytes] = lambda: BODY,
        limits: Limits | None = None,
    ) -> MetricsServer:
        srv = MetricsServer(
            render,
            bind="127.0.0.1",
            port=0,
            web_config=str(web_config) if web_config else None,
            limits=limits,
        )
        srv.start()
        servers.append(srv)
        return srv

    yield factory
    for srv in servers:
        srv.close()


def client_ctx(
    pki: Pki,
    *,
    cert: tuple[Path, Path] | None = None,
    max_version: ssl.TLSVersion | None = None,
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    if max_version is not None:
        ctx.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
        ctx.maximum_version = max_version
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    return ctx


def fetch(
    port: int,
    path: str = "/metrics",
    *,
    method: str = "GET",
    ctx: ssl.SSLContext | None = None,
    auth: tuple[str, str] | None = None,
    timeout: float = 3.0,
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection; returns (status, headers, body)."""
    if ctx is not None:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=timeout, context=ctx
        )
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {}
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()
