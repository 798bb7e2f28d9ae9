"""Hostile clients against a real endpoint in this process, with a CPU 'training' loop running
in the main thread: slow clients (idle, slowloris, stalled TLS handshakes) and a fuzzer.

The attackers run as separate processes so their CPU use is not charged to the training loop;
the server runs here, as it does inside a training process. Figures are printed (-s)."""

from __future__ import annotations

import json
import statistics

import pytest
from conftest import (
    ANSWERED_WITHIN,
    PASSWORD,
    client_ctx,
    fetch,
    helper,
    ms,
    train_steps,
    wait_for_line,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

pytestmark = pytest.mark.timeout(120)


def realistic_render():
    """About 150 series, the per-rank series budget (docs/architecture.md)."""
    reg = CollectorRegistry()
    g = Gauge("ddpmon_grad_group_norm", "norm", ["run", "rank", "group"], registry=reg)
    for i in range(100):
        g.labels("run1", "0", f"layer{i}").set(i * 0.1)
    h = Histogram("ddpmon_step_duration_seconds", "step", ["run", "rank"], registry=reg)
    h.labels("run1", "0").observe(0.2)
    Counter("ddpmon_steps", "steps", ["run", "rank"], registry=reg).labels("run1", "0").inc(5)
    return lambda: generate_latest(reg)


def write_tls_auth_config(tmp_path, pki, pw_hash):
    cfg = tmp_path / "web.yml"
    cfg.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"basic_auth_users:\n  prometheus: '{pw_hash}'\n"
    )
    return cfg


def scrape(spawn, port, pki, seconds, name):
    """Scrape from another process (as Prometheus does) every 0.25 s for ``seconds``."""
    return spawn(helper("sec_scrape.py", "--port", port, "--cafile", pki.ca, "--user",
                        "prometheus", "--password", PASSWORD, "--seconds", seconds), name)


def scrape_results(proc):
    proc.wait(timeout=30)
    results = json.loads(proc.output_path.read_text().splitlines()[-1])
    return [lat for lat, _ in results], {status for _, status in results}


def test_slow_clients_do_not_block_scrapes(make_server, spawn, tmp_path, pki, pw_hash):
    srv = make_server(write_tls_auth_config(tmp_path, pki, pw_hash), render=realistic_render())
    ctx, auth = client_ctx(pki), ("prometheus", PASSWORD)
    assert fetch(srv.port, ctx=ctx, auth=auth)[0] == 200  # bcrypt once; cached from now on
    quiet = scrape(spawn, srv.port, pki, 2.5, "scrape-quiet")
    baseline = train_steps(3.0)
    quiet_latencies, quiet_statuses = scrape_results(quiet)

    attack = spawn(helper("sec_slow.py", "--port", srv.port, "--idle", 50, "--handshakes", 20,
                          "--seconds", 10), "slow")
    wait_for_line(attack.output_path, "ready", 20)
    scraper = scrape(spawn, srv.port, pki, 9.0, "scrape-attack")
    during = train_steps(9.5)
    latencies, statuses = scrape_results(scraper)
    attack.wait(timeout=30)
    report = json.loads(attack.output_path.read_text().splitlines()[-1])

    print(
        f"\nslow clients: {report}\nserver: {srv.stats}\n"
        f"scrape latency: quiet {ms(quiet_latencies)}; under attack {ms(latencies)}, "
        f"max {max(latencies) * 1e3:.1f} ms, statuses {statuses}\n"
        f"training step (scraped every 0.25 s throughout): baseline {ms(baseline)}; "
        f"under attack {ms(during)}; median ratio "
        f"{statistics.median(during) / statistics.median(baseline):.2f}"
    )
    assert quiet_statuses == {200}
    assert report["opened"]["idle"] >= 25 and report["opened"]["stalled_handshake"] >= 20
    assert report["opened"]["slowloris"] >= 25 and report["slowloris_bytes"] > 100
    assert statuses == {200} and len(latencies) >= 20
    assert max(latencies) < ANSWERED_WITHIN  # answered, not locked out
    assert srv.stats["errors"] == 0
    assert len(during) > 100  # training kept stepping (its speed is printed, not judged here)


def fuzz_and_train(spawn, port, requests, seconds, *extra, name="fuzz"):
    proc = spawn(helper("sec_fuzz.py", "--port", port, "--requests", requests,
                        "--seconds", seconds, *extra), name)
    steps: list[float] = []
    while proc.poll() is None:
        steps += train_steps(0.25)
    proc.wait(timeout=10)
    return json.loads(proc.output_path.read_text().splitlines()[-1]), steps


def assert_no_server_failures(report):
    fives = {code: n for code, n in report["statuses"].items() if code.startswith("5")}
    assert report["server_errors"] == [] and fives == {}
    assert report["outcomes"].get("timeout", 0) == 0


def test_fuzz_metrics_endpoint(make_server, spawn):
    srv = make_server(render=realistic_render())
    baseline = train_steps(1.5)
    report, steps = fuzz_and_train(spawn, srv.port, 10_000, 40)
    print(
        f"\nfuzz /metrics: {json.dumps(report)}\nserver: {srv.stats}\n"
        f"training step: baseline {ms(baseline)}; during fuzz {ms(steps)}"
    )
    assert report["requests"] == 10_000
    assert_no_server_failures(report)
    assert srv.stats["errors"] == 0
    assert srv._thread is not None and srv._thread.is_alive()
    assert sum(report["statuses"].values()) >= 5_000
    assert fetch(srv.port)[0] == 200
    assert len(steps) > 100  # training kept stepping (its speed is printed, not judged here)


def test_fuzz_tls_endpoint(make_server, spawn, tmp_path, pki, pw_hash):
    """Plain-text junk at a TLS+auth port: every connection fails its handshake, none hurts."""
    srv = make_server(write_tls_auth_config(tmp_path, pki, pw_hash))
    report, steps = fuzz_and_train(spawn, srv.port, 1_500, 20, "--seed", 11, name="fuzz-tls")
    print(f"\nfuzz TLS port: {json.dumps(report)}\nserver: {srv.stats}")
    assert report["requests"] == 1_500 and report["statuses"] == {}
    assert report["outcomes"].get("timeout", 0) == 0
    assert srv.stats["errors"] == 0 and srv.stats["tls_failed"] >= report["connections"] * 0.9
    assert fetch(srv.port, ctx=client_ctx(pki), auth=("prometheus", PASSWORD))[0] == 200
    assert len(steps) > 10
