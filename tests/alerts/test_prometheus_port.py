"""A port probed free can be taken before Prometheus binds it (the suite's parallel workers do
it). A real Prometheus whose picked port another socket holds starts on another free port; one
given an explicit port that is taken fails with a clear error naming it."""

from __future__ import annotations

import socket

import pytest

from ddpmon.services.process import StackError
from ddpmon.services.prometheus import Prometheus


def hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_picked_port_taken_first_is_replaced(tmp_path):
    prom = Prometheus(tmp_path / "p", sd_dir=tmp_path / "sd")
    taken = prom.port
    with hold(taken):
        prom.start()
        try:
            assert prom.port != taken
            assert prom.query("vector(1)")[0]["value"][1] == "1"
        finally:
            prom.stop()


def test_an_explicit_port_taken_is_an_error(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with hold(port):
        prom = Prometheus(tmp_path / "p", sd_dir=tmp_path / "sd", port=port)
        with pytest.raises(StackError, match="address already in use"):
            prom.start()
        prom.stop()
