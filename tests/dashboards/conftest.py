"""A real, empty Prometheus on loopback (the shared harness): its query API is the PromQL
syntax checker, since promtool 2.42 has no PromQL-only check."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ddpmon.services import Prometheus


@pytest.fixture(scope="session")
def empty_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("prom")
    sd = base / "sd"
    sd.mkdir()
    with Prometheus(base / "prometheus", sd_dir=sd) as prom:
        yield prom.url
