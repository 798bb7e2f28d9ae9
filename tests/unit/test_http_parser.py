"""The shared HTTP core's parser as a pure function (``ddpmon.web.framing``), and the rule that
keeps it shared: neither server, nor anything else in ddpmon, grows its own HTTP parser."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddpmon.web.framing import HttpError, encode_head, parse_request_head
from ddpmon.web.limits import Limits

PACKAGE = Path(__file__).resolve().parents[2] / "ddpmon"
HEAD = b"POST /api/v1/jobs?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
WITH_BODY = Limits(max_body_bytes=100)


def parse(data: bytes, lim: Limits = WITH_BODY):
    buf = bytearray(data)
    return parse_request_head(buf, lim), bytes(buf)


def refusal(data: bytes, lim: Limits = WITH_BODY) -> int:
    with pytest.raises(HttpError) as err:
        parse(data, lim)
    return err.value.code


def test_a_head_leaves_its_body_and_the_next_request_in_the_buffer():
    fields = b"Content-Length: 5\r\nX-A:  v \r\n\r\n"
    head, rest = parse(HEAD + fields + b"helloGET / HTTP/1.1\r\n")
    assert (head.method, head.path, head.query, head.version) == ("POST", "/api/v1/jobs",
                                                                 b"x=1", "1.1")
    assert head.content_length == 5 and rest == b"helloGET / HTTP/1.1\r\n"
    assert head.headers["x-a"] == "v" and (b"x-a", b"v") in head.raw_headers
    assert head.keep_alive and head.size == len(HEAD) + len(fields)


def test_empty_lines_before_a_request_are_dropped():
    head, rest = parse(b"\r\n\r\n\nGET / HTTP/1.1\r\n\r\n\r\n")
    assert head.path == "/" and rest == b"\r\n"
    assert parse(b"\r\n" * 5000)[0] is None  # nothing but blank lines: still waiting


def test_incomplete_heads_wait_within_the_bounds():
    assert parse(HEAD)[0] is None
    assert refusal(HEAD + b"X: " + b"a" * 9000) == 431  # no end in sight past the head limit
    assert refusal(b"GET /" + b"a" * 3000) == 414  # no line end past the request-line limit


@pytest.mark.parametrize(
    ("version", "connection", "keep"),
    [(b"1.1", b"", True), (b"1.1", b"close", False), (b"1.0", b"", False),
     (b"1.0", b"keep-alive", True)],
)
def test_keep_alive_by_version_and_connection(version, connection, keep):
    data = b"GET / HTTP/" + version + b"\r\nConnection: " + connection + b"\r\n\r\n"
    assert parse(data)[0].keep_alive is keep


@pytest.mark.parametrize(
    ("fields", "lim", "code"),
    [
        (b"Transfer-Encoding: chunked\r\n", WITH_BODY, 411),
        (b"Transfer-Encoding: gzip, chunked\r\n", WITH_BODY, 411),
        (b"Transfer-Encoding: chunked, gzip\r\n", WITH_BODY, 400),
        (b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n", WITH_BODY, 400),
        (b"Transfer-Encoding: chunked\r\n", Limits(), 413),  # a server that takes no body
        (b"Content-Length: 101\r\n", WITH_BODY, 413),
        (b"Content-Length: 1\r\n", Limits(), 413),
        (b"Content-Length: 1x\r\n", WITH_BODY, 400),
        (b"Content-Length: 3\r\nContent-Length: 4\r\n", WITH_BODY, 400),
    ],
)
def test_body_framing_is_content_length_only(fields, lim, code):
    assert refusal(HEAD + fields + b"\r\n", lim) == code


def test_a_repeated_identical_length_is_one_length():
    head, _ = parse(HEAD + b"Content-Length: 3\r\nContent-Length: 3\r\n\r\nabc")
    assert head.content_length == 3


def test_a_response_head_never_splits():
    assert encode_head(200, [("a", "b")]) == b"HTTP/1.1 200 OK\r\na: b\r\n\r\n"
    with pytest.raises(ValueError):
        encode_head(200, [("location", "/x\r\nSet-Cookie: y")])


FOREIGN_HTTP = {"h11", "httptools", "h2", "uvicorn", "hypercorn", "aiohttp", "wsgiref",
                "http.server", "socketserver"}
"""HTTP server stacks and parsers: the endpoint and the daemon use ``ddpmon.web.framing``."""
HELPER_SERVERS = {
    Path("commands/stack.py"): {"http.server"},  # the local stack's webhook receiver
    Path("commands/scaleout.py"): {"http.server"},  # simulated scrape targets
}
"""Tools that serve on localhost for a command, never the agent's endpoint or the daemon."""


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p.relative_to(PACKAGE), ast.parse(p.read_text(encoding="utf-8")))
            for p in sorted(PACKAGE.rglob("*.py"))]


def test_no_module_brings_its_own_http_parser():
    """A second parser would let the two servers drift apart again: only the shared core
    splits heads (the only CRLF literals in ddpmon), and no HTTP server stack is imported
    outside the helper servers named above."""
    found: dict[str, set[str]] = {}
    for rel, tree in _modules():
        allowed = HELPER_SERVERS.get(rel, set())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if any(name == f or name.startswith(f + ".") for f in FOREIGN_HTTP - allowed):
                    found.setdefault(str(rel), set()).add(name)
            if (isinstance(node, ast.Constant) and isinstance(node.value, str | bytes)
                    and ("\r\n" in node.value if isinstance(node.value, str)
                         else b"\r\n" in node.value)
                    and rel != Path("web/framing.py")):
                found.setdefault(str(rel), set()).add(repr(node.value)[:40])
    assert found == {}


@pytest.mark.parametrize("server", ["export/server.py", "daemon/server.py"])
def test_both_servers_parse_with_the_shared_core(server):
    tree = ast.parse((PACKAGE / server).read_text(encoding="utf-8"))
    imported = {(node.module or "").rpartition("web.")[2]: {a.name for a in node.names}
                for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {"parse_request_head", "encode_head"} <= imported.get("framing", set())
    assert "Limits" in imported.get("limits", set())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    assert not {"parse_request_head", "Limits", "HttpError"} & defined
