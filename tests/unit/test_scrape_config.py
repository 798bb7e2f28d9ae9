"""The scrape client's config and targets: clear errors naming file and key, Prometheus-style
defaults, and the daemon's ``scrape_config`` key. Live TLS/auth scrapes: tests/security."""

from pathlib import Path

import pytest

from ddpmon.daemon.settings import DaemonSettings, SettingsError
from ddpmon.export.scrape import (
    ScrapeClient,
    ScrapeConfig,
    ScrapeConfigError,
    ScrapeError,
    Target,
    flatten,
)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def files(tmp_path: Path) -> Path:
    write(tmp_path / "pw", "hunter2\n")
    return tmp_path


def load(files: Path, text: str) -> ScrapeConfig:
    return ScrapeConfig.load(write(files / "scrape.yml", text))


def test_relative_files_resolve_against_the_config_and_tls_defaults_to_https(files):
    (files / "sub").mkdir()
    cfg = ScrapeConfig.load(
        write(files / "sub" / "scrape.yml", "basic_auth: {username: u, password_file: ../pw}\n")
    )
    assert cfg.scheme == "http" and cfg.basic_auth.password_file == files / "sub" / "../pw"
    assert cfg.basic_auth.header() == "Basic dTpodW50ZXIy"  # u:hunter2, newline stripped
    import ssl

    ca = Path(ssl.get_default_verify_paths().cafile or "")
    if not ca.is_file():
        pytest.skip("no system CA bundle to stand in for a CA file")
    tls = load(files, f"tls_config: {{ca_file: {ca}}}\n")
    assert tls.scheme == "https" and tls.tls_config.ca_file == ca
    assert load(files, f"scheme: http\ntls_config: {{ca_file: {ca}}}\n").scheme == "http"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("basic_auth: {username: u, pasword: x}\n", "basic_auth: unknown key(s) pasword"),
        ("tls_config: {ca: x}\n", "tls_config: unknown key(s) ca (known: ca_file,"),
        ("scrape_interval: 5s\n", "unknown key(s) scrape_interval"),
        ("tls_config: {ca_file: missing.crt}\n", "tls_config.ca_file: "),
        ("basic_auth: {username: u, password_file: nope}\n", "basic_auth.password_file: "),
        ("basic_auth: {password: x}\n", "basic_auth.username: required"),
        ("basic_auth: {username: u, password: x, password_file: pw}\n", "not both"),
        ("tls_config: {cert_file: pw}\n", "cert_file and key_file go together"),
        ("tls_config: {insecure_skip_verify: yes please}\n", "insecure_skip_verify: expected"),
        ("tls_config: {min_version: SSL3}\n", "min_version: 'SSL3'"),
        ("scheme: ftp\n", "scheme: 'ftp': expected http or https"),
        ("metrics_path: metrics\n", "metrics_path: 'metrics'"),
        ("basic_auth: [u, p]\n", "basic_auth: expected a mapping, got list"),
        ("- a\n", "expected a mapping, got list"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_bad_config_names_file_and_key(files, text, message):
    with pytest.raises(ScrapeConfigError) as err:
        load(files, text)
    assert str(err.value).startswith(str(files / "scrape.yml")), err.value
    assert message in str(err.value)
    if "missing.crt" in text or "nope" in text:
        assert "no such file" in str(err.value) and str(files) in str(err.value)


def test_a_file_that_is_not_a_certificate_is_a_config_error(files):
    with pytest.raises(ScrapeConfigError, match=r"tls_config.ca_file .*pw: not a readable PEM CA"):
        load(files, "tls_config: {ca_file: pw}\n")
    with pytest.raises(ScrapeConfigError, match="not a matching PEM certificate and key"):
        load(files, "tls_config: {cert_file: pw, key_file: pw}\n")


def test_missing_config_file():
    with pytest.raises(ScrapeConfigError, match="nowhere.yml: cannot read"):
        ScrapeClient.from_file("/nowhere.yml")


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("127.0.0.1:7470", Target("http", "127.0.0.1", 7470, "/metrics")),
        ("https://node-1:7471", Target("https", "node-1", 7471, "/metrics")),
        ("http://node-1:80/custom", Target("http", "node-1", 80, "/custom")),
        ("[::1]:7470", Target("http", "::1", 7470, "/metrics")),
    ],
)
def test_targets(target, expected):
    assert ScrapeClient().target(target) == expected


def test_target_url_and_scheme_from_config(files):
    client = ScrapeClient(ScrapeConfig(scheme="https", metrics_path="/m"))
    assert client.target("h:1").url == "https://h:1/m"
    assert client.target("http://h:1").url == "http://h:1/m"
    assert Target("https", "::1", 7470, "/metrics").url == "https://[::1]:7470/metrics"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("node-1", "expected host:port"),
        ("node-1:http", "port is not a number"),
        ("ftp://node-1:21", "scheme 'ftp'"),
        ("https://:7470", "expected host:port"),
    ],
)
def test_bad_targets(target, message):
    with pytest.raises(ScrapeConfigError, match=message):
        ScrapeClient().target(target)


def test_unreachable_endpoint_is_a_scrape_error_naming_the_url():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ScrapeError, match=rf"http://127.0.0.1:{port}/metrics: .*refused"):
        ScrapeClient().fetch(f"127.0.0.1:{port}", timeout=1)


def test_flatten_keeps_plain_series_sums_errors_and_reads_the_rank():
    text = (
        'ddpmon_step{run="r",rank="3"} 7\n'
        'ddpmon_agent_errors_total{run="r",rank="3",probe="a"} 1\n'
        'ddpmon_agent_errors_total{run="r",rank="3",probe="b"} 2\n'
        'ddpmon_rank_info{run="r",rank="3",node="n"} 1\n'
        'ddpmon_grad_group_norm{run="r",rank="3",group="g"} 5\n'
    )
    assert flatten(text) == {"ddpmon_step": 7, "ddpmon_agent_errors_total": 3, "rank": 3}


def test_daemon_settings_scrape_config_inline_file_and_errors(files):
    inline = DaemonSettings.load(
        write(
            files / "daemon.yaml",
            "scrape_config:\n  basic_auth: {username: u, password_file: pw}\n",
        )
    )
    assert inline.scrape_config.basic_auth.password_file == files / "pw"
    assert inline.scrape_client() is inline.scrape_client()  # one shared client per config
    write(files / "scrape.yml", "scheme: https\n")
    by_path = DaemonSettings.load(write(files / "d2.yaml", "scrape_config: scrape.yml\n"))
    assert by_path.scrape_config.scheme == "https"
    assert DaemonSettings().scrape_config == ScrapeConfig()
    bad = write(files / "d3.yaml", "scrape_config:\n  tls_config: {ca_file: gone.crt}\n")
    with pytest.raises(SettingsError, match=r"d3.yaml: scrape_config: tls_config.ca_file: .*gone"):
        DaemonSettings.load(bad)
    with pytest.raises(SettingsError, match=r"d4.yaml: scrape_config: .*absent.yml: cannot read"):
        DaemonSettings.load(write(files / "d4.yaml", "scrape_config: absent.yml\n"))
