"""Auth matrix of the exporter-toolkit web config: TLS, mTLS and basic auth, on real sockets."""

from __future__ import annotations

import http.client
import ssl
import statistics
import time
import warnings
from pathlib import Path

import bcrypt
import pytest
from conftest import BODY, PASSWORD, client_ctx, fetch
from sec_pki import Pki

from ddpmon.web.config import BasicAuth

REFUSED = (OSError, http.client.HTTPException)  # ssl.SSLError and resets are OSErrors


def tls_failures(srv, expected: int, timeout: float = 2.0) -> int:
    """The server thread counts a failed handshake just after the client sees it fail."""
    deadline = time.monotonic() + timeout
    while srv.stats["tls_failed"] < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return srv.stats["tls_failed"]


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "web.yml"
    path.write_text(text)
    return path


def tls_block(pki: Pki, extra: str = "") -> str:
    return (
        "tls_server_config:\n"
        f"  cert_file: {pki.server_cert}\n"
        f"  key_file: {pki.server_key}\n" + extra
    )


@pytest.fixture
def tls_auth_server(make_server, tmp_path, pki, pw_hash):
    cfg = write_config(
        tmp_path,
        tls_block(pki)
        + f"basic_auth_users:\n  prometheus: '{pw_hash}'\n"
        + "http_server_config:\n  headers:\n    X-Frame-Options: deny\n",
    )
    return make_server(cfg)


def test_basic_auth_matrix_over_tls(tls_auth_server, pki):
    port, ctx = tls_auth_server.port, client_ctx(pki)
    status, headers, _ = fetch(port, ctx=ctx)
    assert status == 401
    assert headers["www-authenticate"].startswith('Basic realm="ddpmon"')
    assert fetch(port, ctx=ctx, auth=("prometheus", "wrong"))[0] == 401
    assert fetch(port, ctx=ctx, auth=("nobody", PASSWORD))[0] == 401
    assert fetch(port, ctx=ctx, auth=("prometheus", ""))[0] == 401
    status, headers, body = fetch(port, ctx=ctx, auth=("prometheus", PASSWORD))
    assert (status, body) == (200, BODY)
    assert headers["x-frame-options"] == "deny"
    # 401 comes before routing: an anonymous client learns nothing about paths or methods.
    assert fetch(port, "/admin", ctx=ctx)[0] == 401
    assert fetch(port, "/admin", ctx=ctx, auth=("prometheus", PASSWORD))[0] == 404


def test_cve_2022_46146_wrong_password_after_right_one(tls_auth_server, pki):
    port, ctx = tls_auth_server.port, client_ctx(pki)
    assert fetch(port, ctx=ctx, auth=("prometheus", PASSWORD))[0] == 200
    assert fetch(port, ctx=ctx, auth=("prometheus", PASSWORD))[0] == 200  # now cached
    assert fetch(port, ctx=ctx, auth=("prometheus", "wrong"))[0] == 401
    assert fetch(port, ctx=ctx, auth=("prometheus", PASSWORD + "x"))[0] == 401
    assert fetch(port, ctx=ctx, auth=("prometheus", PASSWORD[:-1]))[0] == 401
    assert fetch(port, ctx=ctx, auth=("prometheus", PASSWORD))[0] == 200


def test_basic_auth_cache_unit(pw_hash):
    auth = BasicAuth({b"prometheus": pw_hash.encode()})
    assert not auth.cached(b"prometheus", PASSWORD.encode())
    assert auth.check(b"prometheus", PASSWORD.encode())
    assert auth.cached(b"prometheus", PASSWORD.encode())
    assert not auth.cached(b"prometheus", b"wrong")
    assert not auth.check(b"prometheus", b"wrong")
    assert not auth.check(b"nobody", PASSWORD.encode())
    assert not auth.check(b"prometheus", b"x" * 100)  # bcrypt limit: refused, not truncated


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("Basic cHJvbWV0aGV1czpwdw==", (b"prometheus", b"pw")),
        ("basic   cHJvbWV0aGV1czpwdw==", (b"prometheus", b"pw")),
        ("Basic dTpwOnc=", (b"u", b"p:w")),
        ("Basic bm9jb2xvbg==", None),
        ("Basic !!!", None),
        ("Bearer abc", None),
        ("Basic", None),
        ("", None),
    ],
)
def test_authorization_header_parsing(header, expected):
    assert BasicAuth.parse_header(header) == expected


def test_unknown_user_costs_as_much_as_a_wrong_password(make_server, tmp_path):
    # Cost 8 (~15 ms) so bcrypt dominates the round trip; without the dummy-hash check an
    # unknown user would be answered in well under a millisecond.
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(8)).decode()
    srv = make_server(write_config(tmp_path, f"basic_auth_users:\n  prometheus: '{hashed}'\n"))

    def timed(user: str) -> float:
        t0 = time.perf_counter()
        assert fetch(srv.port, auth=(user, "wrong"))[0] == 401
        return time.perf_counter() - t0

    known, unknown = [], []
    for _ in range(7):
        known.append(timed("prometheus"))
        unknown.append(timed("nobody"))
    ratio = statistics.median(unknown) / statistics.median(known)
    print(
        f"\nwrong password {statistics.median(known) * 1e3:.1f} ms, "
        f"unknown user {statistics.median(unknown) * 1e3:.1f} ms (ratio {ratio:.2f})"
    )
    assert 0.5 < ratio < 2.0


def test_basic_auth_without_tls(make_server, tmp_path, pw_hash):
    srv = make_server(write_config(tmp_path, f"basic_auth_users:\n  prometheus: '{pw_hash}'\n"))
    assert fetch(srv.port)[0] == 401
    assert fetch(srv.port, auth=("prometheus", PASSWORD))[0] == 200


def test_plain_http_to_tls_port_fails(make_server, tmp_path, pki):
    srv = make_server(write_config(tmp_path, tls_block(pki)))
    with pytest.raises(REFUSED):
        fetch(srv.port)
    assert fetch(srv.port, ctx=client_ctx(pki))[0] == 200
    assert tls_failures(srv, 1) == 1


def test_tls_below_minimum_version_refused(make_server, tmp_path, pki):
    srv = make_server(write_config(tmp_path, tls_block(pki)))  # default min_version TLS12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = client_ctx(pki, max_version=ssl.TLSVersion.TLSv1_1)
    with pytest.raises(ssl.SSLError):
        fetch(srv.port, ctx=old)
    assert tls_failures(srv, 1) == 1
    tls12 = client_ctx(pki, max_version=ssl.TLSVersion.TLSv1_2)
    assert fetch(srv.port, ctx=tls12)[0] == 200


def test_min_version_tls13_refuses_tls12(make_server, tmp_path, pki):
    srv = make_server(write_config(tmp_path, tls_block(pki, "  min_version: TLS13\n")))
    with pytest.raises(ssl.SSLError):
        fetch(srv.port, ctx=client_ctx(pki, max_version=ssl.TLSVersion.TLSv1_2))
    assert fetch(srv.port, ctx=client_ctx(pki))[0] == 200


def test_mtls_require_and_verify(make_server, tmp_path, pki):
    cfg = tls_block(
        pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"
    )
    srv = make_server(write_config(tmp_path, cfg))
    good = client_ctx(pki, cert=(pki.client_cert, pki.client_key))
    rogue = client_ctx(pki, cert=(pki.rogue_cert, pki.rogue_key))
    with pytest.raises(REFUSED):
        fetch(srv.port, ctx=rogue)
    with pytest.raises(REFUSED):
        fetch(srv.port, ctx=client_ctx(pki))
    status, _, body = fetch(srv.port, ctx=good)
    assert (status, body) == (200, BODY)
    assert tls_failures(srv, 2) == 2


def test_mtls_verify_if_given(make_server, tmp_path, pki):
    cfg = tls_block(
        pki, f"  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {pki.ca}\n"
    )
    srv = make_server(write_config(tmp_path, cfg))
    assert fetch(srv.port, ctx=client_ctx(pki))[0] == 200
    assert fetch(srv.port, ctx=client_ctx(pki, cert=(pki.client_cert, pki.client_key)))[0] == 200
    with pytest.raises(REFUSED):
        fetch(srv.port, ctx=client_ctx(pki, cert=(pki.rogue_cert, pki.rogue_key)))


def test_client_ca_file_alone_means_require_and_verify(make_server, tmp_path, pki):
    srv = make_server(write_config(tmp_path, tls_block(pki, f"  client_ca_file: {pki.ca}\n")))
    with pytest.raises(REFUSED):
        fetch(srv.port, ctx=client_ctx(pki))
    assert fetch(srv.port, ctx=client_ctx(pki, cert=(pki.client_cert, pki.client_key)))[0] == 200


def test_relative_paths_resolve_against_the_config_file(make_server, pki):
    cfg = pki.dir / "relative.yml"
    cfg.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    srv = make_server(cfg)
    assert fetch(srv.port, ctx=client_ctx(pki))[0] == 200


def test_bcrypt_queue_is_bounded_and_cached_credentials_skip_it(make_server, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from ddpmon.export.server import Limits

    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    cfg = write_config(tmp_path, f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    srv = make_server(cfg, limits=Limits(max_auth_pending=2))
    t0 = time.perf_counter()
    assert fetch(srv.port, auth=("prometheus", PASSWORD))[0] == 200  # one bcrypt round
    one_bcrypt = time.perf_counter() - t0
    with ThreadPoolExecutor(8) as pool:
        flood = [pool.submit(fetch, srv.port, auth=("prometheus", f"guess{i}"), timeout=30)
                 for i in range(8)]
        time.sleep(0.05)
        t0 = time.perf_counter()
        assert fetch(srv.port, auth=("prometheus", PASSWORD))[0] == 200
        cached = time.perf_counter() - t0
        statuses = sorted(f.result()[0] for f in flood)
    print(f"\nbcrypt cost 10: {one_bcrypt * 1e3:.0f} ms; cached scrape during a guessing flood "
          f"{cached * 1e3:.1f} ms; flood statuses {statuses}")
    assert set(statuses) == {401, 503} and statuses.count(401) >= 2
    assert cached < one_bcrypt / 2
