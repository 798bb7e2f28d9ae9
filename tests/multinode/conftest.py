"""Fixtures for the two-node tests: the namespaces and the monitoring stack, torn down always."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import Stack, start_stack

from tests.support.netns import NetnsUnavailable, check_available, create


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        check_available()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    cluster = create()
    try:
        s = start_stack(cluster, tmp_path_factory.mktemp("multinode"))
    except BaseException:
        cluster.close()
        raise
    try:
        yield s
    finally:
        s.close()
        cluster.close()
