"""HTTP framing by RFC 9112 on both fronts: ambiguous framing closes the connection, conflicting
or non-ASCII Content-Length is 400, and a malformed head always gets a status (never a dropped
connection). Raw bytes against the real agent endpoint and the real daemon."""

from __future__ import annotations

import pytest
from sec_daemon import start_daemon
from test_server_http import raw, status_of


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: 0\r\nContent-Length: 5\r\n",  # conflicting: which did a proxy read?
        b"Content-Length: \xb2\r\n",  # "2" to str.isdigit(), not to int()
        b"Content-Length: \xd9\xa1\r\n",  # an Arabic-Indic digit, as latin-1 bytes
        b"Host: a\r\nHost: b\r\n",
        b"Authorization: Basic eDp5\r\nAuthorization: Basic eTp6\r\n",
    ],
    ids=["two-lengths", "superscript-two", "arabic-indic", "two-hosts", "two-credentials"],
)
def test_agent_answers_ambiguous_heads_with_400(make_server, head):
    srv = make_server()
    reply = raw(srv.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
    assert status_of(reply) == 400, reply[:200]
    assert reply.count(b"HTTP/1.1 ") == 1


def test_agent_takes_a_repeated_identical_length(make_server):
    srv = make_server()
    head = b"GET /metrics HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n"
    reply = raw(srv.port, head)
    assert status_of(reply) == 200, reply[:200]


def test_daemon_closes_after_length_and_chunked_together(spawn, tmp_path):
    proc, port = start_daemon(spawn, tmp_path, "f")
    smuggle = (
        b"POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        b"GET /sd HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    )
    reply = raw(port, smuggle)
    assert status_of(reply) == 400, reply[:300]
    assert b"connection: close" in reply.lower()
    assert reply.count(b"HTTP/1.1 ") == 1, reply  # the pipelined request was never served


@pytest.mark.parametrize(
    "head",
    [b"Content-Length: 1\r\nContent-Length: 2\r\n", b"Content-Length: \xb2\r\n",
     b"Host: 127.0.0.1\r\n"],  # fmt: skip
    ids=["two-lengths", "superscript-two", "two-hosts"],
)
def test_daemon_answers_ambiguous_heads_with_400(spawn, tmp_path, head):
    proc, port = start_daemon(spawn, tmp_path, "g")
    reply = raw(port, b"POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n" + head + b"\r\nab")
    assert status_of(reply) == 400, reply[:300]
