"""Fixtures for endpoint-hardening tests: fresh PKI, web config files, a server factory and a
small HTTP client that speaks plain or TLS with optional basic auth."""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import signal
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import bcrypt
import pytest
from sec_pki import Pki, make_pki

from ddpmon.export.server import Limits, MetricsServer

PASSWORD = "s3cret-pass"
ANSWERED_WITHIN = 5.0
"""The liveness bound on one scrape under attack (seconds): a locked-out server holds it until
the attack's sockets close (7-10 s here), while a loaded 2-core machine can take a TLS handshake
and a bcrypt check past 2 s (a fresh-clone run saw 2.18 s). Speed is printed, not judged."""
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


HERE = Path(__file__).resolve().parent


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start helper processes in their own process group, output to files; kill at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], name: str) -> subprocess.Popen[bytes]:
        out = open(tmp_path / f"{name}.out", "wb")  # noqa: SIM115 - closed by the process
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=HERE
        )
        out.close()
        proc.output_path = tmp_path / f"{name}.out"  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def helper(name: str, *args: object) -> list[str]:
    return [sys.executable, str(HERE / name), *map(str, args)]


def wait_for_line(path: Path, text: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{path.name}: no {text!r} within {timeout}s: {path.read_text()[-2000:]}")


def train_steps(seconds: float) -> list[float]:
    """A tiny CPU 'training' loop in the calling thread; returns each step's wall time.

    Small matmuls (which release the GIL) with Python around them (which needs it): more
    GIL-bound than a real step, so its step time is a sensitive gauge of a server thread
    that hogs the interpreter."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spinning OpenMP workers on a shared 2-core box would dominate
    torch.manual_seed(0)
    w = torch.randn(128, 128) * 0.05
    x = torch.randn(64, 128)
    times: list[float] = []
    end = time.perf_counter() + seconds
    try:
        with torch.no_grad():
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                h = x
                for _ in range(8):
                    h = torch.tanh(h @ w)
                float(h.sum())
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return times


def ms(values: list[float]) -> str:
    return (
        f"{statistics.median(values) * 1e3:.2f} ms median, "
        f"mean {statistics.fmean(values) * 1e3:.2f} ms, "
        f"p99 {p99(values) * 1e3:.2f} ms, n={len(values)}"
    )


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
