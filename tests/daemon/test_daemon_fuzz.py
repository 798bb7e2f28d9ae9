"""Property-based fuzzing of the published OpenAPI (schemathesis + hypothesis) against a real
daemon: every operation, valid and invalid inputs, with and without the token; no 5xx."""

from __future__ import annotations

import hypothesis
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from .conftest import Daemon

EXAMPLES_PER_MODE = 12  # per operation, once schema-valid and once schema-invalid


def test_openapi_fuzz_has_no_server_errors(make_daemon) -> None:
    daemon: Daemon = make_daemon(max_nproc=1, max_running_jobs=1)
    schema = schemathesis.openapi.from_url(daemon.url + "/openapi.json")
    counts: dict[str, int] = {}
    statuses: set[int] = set()
    server_errors: list[str] = []
    negative_ok = {"POST /api/v1/jobs", "POST /api/v1/ranks", "GET /api/v1/jobs/{job_id}/logs"}

    def run_operation(op, mode: GenerationMode) -> None:
        label = f"{op.method.upper()} {op.path}"

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_MODE,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        )
        def check(case) -> None:
            headers = daemon.auth if counts.get(label, 0) % 2 == 0 else None
            resp = case.call(base_url=daemon.url, headers=headers, timeout=10)
            counts[label] = counts.get(label, 0) + 1
            statuses.add(resp.status_code)
            if resp.status_code >= 500:
                server_errors.append(f"{label} -> {resp.status_code}: {resp.text[:200]}")

        try:
            check()
        except hypothesis.errors.Unsatisfiable:
            # No parameters and no body (GET /healthz): nothing to make invalid.
            assert mode is GenerationMode.NEGATIVE and label not in negative_ok

    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run_operation(result.ok(), mode)

    total = sum(counts.values())
    print(f"\nschemathesis: {total} cases, {len(counts)} operations, statuses {sorted(statuses)}")
    for label, n in sorted(counts.items()):
        print(f"  {n:4d}  {label}")
    assert not server_errors, server_errors[:5]
    assert len(counts) >= 8 and total >= 7 * EXAMPLES_PER_MODE
    assert {200, 400, 401, 404} <= statuses
