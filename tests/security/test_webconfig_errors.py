"""One test per bad web_config shape, each with its exact error message.

``{cfg}`` is the config file, ``{pki}`` the directory of generated certificates. A bad file
must stop the server before it binds: nothing is served rather than something insecure."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from sec_pki import Pki

from ddpmon.export.server import MetricsServer
from ddpmon.web.config import WebConfigError, load_web_config

HASH = "$2b$04$0123456789abcdefghijkO0123456789abcdefghijklmnopqrstu"
TLS = "tls_server_config:\n  cert_file: {pki}/server.crt\n  key_file: {pki}/server.key\n"
P = "web_config {cfg}: "

CASES: dict[str, tuple[str, str]] = {
    "yaml_syntax": ("tls_server_config: [\n", P + "invalid YAML at line 2, column 1: "
                    "expected the node content, but found '<stream end>'"),
    "yaml_mapping_values": ("a: b: c\n", P + "invalid YAML at line 1, column 5: "
                            "mapping values are not allowed here"),
    "top_level_list": ("- tls_server_config\n",
                       P + "expected a mapping at the top level, got list"),
    "top_level_scalar": ("hello\n", P + "expected a mapping at the top level, got str"),
    "unknown_top_key": ("tls_config: {{}}\n", P + "unknown key tls_config (known: "
                        "tls_server_config, basic_auth_users, http_server_config)"),
    "tls_not_mapping": ("tls_server_config: yes\n",
                        P + "tls_server_config must be a mapping, got bool"),
    "unknown_tls_key": (TLS + "  certfile: x\n", P + "unknown key tls_server_config.certfile "
                        "(known: cert_file, key_file, min_version, max_version, client_auth_type, "
                        "client_ca_file, prefer_server_cipher_suites)"),
    "cipher_suites_refused": (TLS + "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
                              P + "tls_server_config.cipher_suites is not supported: Go "
                              "cipher-suite names cannot be applied exactly to OpenSSL; remove it "
                              "to use OpenSSL's defaults, or raise min_version to TLS13"),
    "curve_preferences_refused": (TLS + "  curve_preferences: [X25519]\n",
                                  P + "tls_server_config.curve_preferences is not supported: "
                                  "curve selection is not supported; remove it"),
    "missing_key_file": ("tls_server_config:\n  cert_file: {pki}/server.crt\n",
                         P + "tls_server_config.key_file is required"),
    "cert_file_not_string": ("tls_server_config:\n  cert_file: 3\n  key_file: x\n",
                             P + "tls_server_config.cert_file must be a non-empty string, got int"),
    "cert_file_missing": ("tls_server_config:\n  cert_file: nope.crt\n"
                          "  key_file: {pki}/server.key\n",
                          P + "tls_server_config.cert_file {dir}/nope.crt: file not found"),
    "cert_file_not_pem": ("tls_server_config:\n  cert_file: {pki}/server.key\n"
                          "  key_file: {pki}/server.key\n",
                          P + "tls_server_config.cert_file {pki}/server.key: "
                          "no PEM certificate found"),
    "key_file_not_pem": ("tls_server_config:\n  cert_file: {pki}/server.crt\n"
                         "  key_file: {pki}/server.crt\n",
                         P + "tls_server_config.key_file {pki}/server.crt: "
                         "no PEM private key found"),
    "key_mismatch": ("tls_server_config:\n  cert_file: {pki}/server.crt\n"
                     "  key_file: {pki}/client.key\n",
                     P + "cannot load tls_server_config.cert_file {pki}/server.crt with key_file "
                     "{pki}/client.key: KEY_VALUES_MISMATCH"),
    "key_encrypted": ("tls_server_config:\n  cert_file: {pki}/server.crt\n"
                      "  key_file: {pki}/encrypted.key\n",
                      P + "tls_server_config.key_file {pki}/encrypted.key is encrypted; ddpmon "
                      "needs an unencrypted key (protect it with file permissions)"),
    "bad_min_version": (TLS + "  min_version: TLS1.2\n", P + "tls_server_config.min_version "
                        "'TLS1.2' is invalid (expected one of TLS10, TLS11, TLS12, TLS13)"),
    "bad_max_version": (TLS + "  max_version: SSL3\n", P + "tls_server_config.max_version "
                        "'SSL3' is invalid (expected one of TLS10, TLS11, TLS12, TLS13)"),
    "min_above_max": (TLS + "  min_version: TLS13\n  max_version: TLS12\n",
                      P + "tls_server_config.min_version TLS13 is above max_version TLS12"),
    "bad_client_auth_type": (TLS + "  client_auth_type: Always\n",
                             P + "tls_server_config.client_auth_type 'Always' is invalid (expected "
                             "one of NoClientCert, RequestClientCert, RequireAnyClientCert, "
                             "VerifyClientCertIfGiven, RequireAndVerifyClientCert)"),
    "unsupported_client_auth_type": (TLS + "  client_auth_type: RequireAnyClientCert\n",
                                     P + "tls_server_config.client_auth_type RequireAnyClientCert "
                                     "is not supported (Python's ssl cannot accept a client "
                                     "certificate without verifying it); use "
                                     "VerifyClientCertIfGiven or RequireAndVerifyClientCert with "
                                     "client_ca_file"),
    "verify_without_ca": (TLS + "  client_auth_type: RequireAndVerifyClientCert\n",
                          P + "tls_server_config.client_auth_type RequireAndVerifyClientCert "
                          "needs client_ca_file"),
    "ca_with_no_client_cert": (TLS + "  client_auth_type: NoClientCert\n"
                               "  client_ca_file: {pki}/ca.crt\n",
                               P + "tls_server_config.client_ca_file is set but client_auth_type "
                               "is NoClientCert, so client certificates would not be checked; set "
                               "RequireAndVerifyClientCert"),
    "client_ca_missing": (TLS + "  client_ca_file: {pki}/nope.crt\n",
                          P + "tls_server_config.client_ca_file {pki}/nope.crt: file not found"),
    "users_not_mapping": ("basic_auth_users: [prometheus]\n", P + "basic_auth_users must be a "
                          "mapping of user to bcrypt hash, got list"),
    "users_empty": ("basic_auth_users: {{}}\n",
                    P + "basic_auth_users is empty; remove it or add a user"),
    "plain_password": ("basic_auth_users:\n  prometheus: hunter2\n",
                       P + "basic_auth_users.prometheus: not a bcrypt hash (expected "
                       "$2b$<cost>$<53 characters>, e.g. from htpasswd -nBC 12 USER)"),
    "bcrypt_cost_too_low": ("basic_auth_users:\n  prometheus: '" + HASH.replace("$04$", "$03$")
                            + "'\n", P + "basic_auth_users.prometheus: not a bcrypt hash (expected "
                            "$2b$<cost>$<53 characters>, e.g. from htpasswd -nBC 12 USER)"),
    "truncated_hash": ("basic_auth_users:\n  prometheus: '" + HASH[:-1] + "'\n",
                       P + "basic_auth_users.prometheus: not a bcrypt hash (expected "
                       "$2b$<cost>$<53 characters>, e.g. from htpasswd -nBC 12 USER)"),
    "user_with_colon": ("basic_auth_users:\n  'a:b': '" + HASH + "'\n",
                        P + "basic_auth_users: user name 'a:b' must be a non-empty string "
                        "without ':'"),
    "http_not_mapping": ("http_server_config: 1\n",
                         P + "http_server_config must be a mapping, got int"),
    "http_unknown_key": ("http_server_config:\n  header: {{}}\n", P + "unknown key "
                         "http_server_config.header (known: headers, http2)"),
    "header_not_allowed": ("http_server_config:\n  headers:\n    Set-Cookie: a=b\n",
                           P + "http_server_config.headers.Set-Cookie is not allowed (allowed: "
                           "Content-Security-Policy, X-Frame-Options, X-Content-Type-Options, "
                           "X-XSS-Protection, Strict-Transport-Security)"),
    "header_value_not_string": ("http_server_config:\n  headers:\n    X-Frame-Options: [deny]\n",
                                P + "http_server_config.headers.X-Frame-Options must be a "
                                "printable ASCII string"),
}


@pytest.fixture(scope="module")
def pki_dir(pki: Pki) -> Path:
    key = ec.generate_private_key(ec.SECP256R1())
    enc = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"),
    )
    (pki.dir / "encrypted.key").write_bytes(enc)
    return pki.dir


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_web_config(case: str, tmp_path: Path, pki_dir: Path) -> None:
    text, expected = CASES[case]
    cfg = tmp_path / "web.yml"
    cfg.write_text(text.format(pki=pki_dir))
    with pytest.raises(WebConfigError) as info:
        load_web_config(cfg)
    assert str(info.value) == expected.format(cfg=cfg, pki=pki_dir, dir=tmp_path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(WebConfigError) as info:
        load_web_config(tmp_path / "absent.yml")
    assert str(info.value) == f"web_config {tmp_path / 'absent.yml'}: file not found"


def test_bad_config_stops_server_before_it_binds(tmp_path: Path) -> None:
    cfg = tmp_path / "web.yml"
    cfg.write_text("basic_auth_users:\n  prometheus: hunter2\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    srv = MetricsServer(lambda: b"", bind="127.0.0.1", port=port, web_config=str(cfg))
    with pytest.raises(WebConfigError, match=r"basic_auth_users\.prometheus: not a bcrypt hash"):
        srv.start()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    srv.close()


def test_empty_file_is_plain_http(tmp_path: Path) -> None:
    cfg = tmp_path / "web.yml"
    cfg.write_text("")
    loaded = load_web_config(cfg)
    assert loaded.ssl_context is None and loaded.auth is None and loaded.headers == {}
