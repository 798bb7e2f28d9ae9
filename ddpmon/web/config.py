"""Prometheus exporter-toolkit web configuration: TLS, mTLS and basic auth for /metrics.

Operators configure every exporter with the same YAML file (``--web.config.file``); ddpmon
reads that format so one file serves node_exporter, dcgm-exporter and every training rank::

    tls_server_config:
      cert_file: server.crt          # paths are relative to this file's directory
      key_file: server.key
      min_version: TLS12             # default; TLS10, TLS11, TLS12, TLS13
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: clients-ca.crt
    basic_auth_users:
      prometheus: $2b$12$...         # bcrypt hash (htpasswd -nBC 12 prometheus)
    http_server_config:
      headers:
        Strict-Transport-Security: max-age=31536000

Anything ddpmon cannot honour exactly is rejected (``WebConfigError`` naming the key or
file) rather than ignored: a setting that narrows access and is silently dropped would serve
more openly than the operator asked. ``cipher_suites``, ``curve_preferences`` and
``client_allowed_sans`` are therefore refused; ``RequestClientCert`` and
``RequireAnyClientCert`` too, because Python's ``ssl`` cannot take a client certificate
without verifying it. ``prefer_server_cipher_suites`` and ``http2`` change nothing about who
may read and are accepted and ignored with a log line.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import ssl
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("ddpmon.webconfig")

TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH_TYPES = (
    "NoClientCert",
    "RequestClientCert",
    "RequireAnyClientCert",
    "VerifyClientCertIfGiven",
    "RequireAndVerifyClientCert",
)
UNSUPPORTED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
TOP_KEYS = ("tls_server_config", "basic_auth_users", "http_server_config")
TLS_KEYS = (
    "cert_file",
    "key_file",
    "min_version",
    "max_version",
    "client_auth_type",
    "client_ca_file",
    "prefer_server_cipher_suites",
)
TLS_REFUSED_KEYS = {
    "cipher_suites": "Go cipher-suite names cannot be applied exactly to OpenSSL; remove it "
    "to use OpenSSL's defaults, or raise min_version to TLS13",
    "curve_preferences": "curve selection is not supported; remove it",
    "client_allowed_sans": "SAN allow-lists are not supported; restrict with client_ca_file",
    "cert": "inline certificates are not supported; use cert_file",
    "key": "inline keys are not supported; use key_file",
}
HTTP_KEYS = ("headers", "http2")
ALLOWED_HEADERS = (
    "Content-Security-Policy",
    "X-Frame-Options",
    "X-Content-Type-Options",
    "X-XSS-Protection",
    "Strict-Transport-Security",
)
_BCRYPT_RE = re.compile(
    rb"^\$2[abxy]\$(\d\d)\$[./A-Za-z0-9]{21}[.Oeu][./A-Za-z0-9]{31}$"
)
_HEADER_VALUE_RE = re.compile(r"^[\t\x20-\x7e]*$")
AUTH_CACHE_SIZE = 256


class WebConfigError(ValueError):
    """The web config file cannot be used; the message names the file and the key."""


@dataclass(slots=True)
class WebConfig:
    """A validated web config: a ready server ``ssl.SSLContext`` and a basic-auth checker."""

    path: str
    ssl_context: ssl.SSLContext | None = None
    auth: BasicAuth | None = None
    headers: dict[str, str] = field(default_factory=dict)
    client_auth_type: str = "NoClientCert"


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read, validate and materialise ``path``; raise ``WebConfigError`` on any problem."""
    import yaml  # yaml loads only when used: a light CLI start

    p = Path(path)
    where = f"web_config {p}"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WebConfigError(f"{where}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WebConfigError(f"{where}: cannot read: {exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise WebConfigError(f"{where}: invalid YAML{at}: {problem}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise WebConfigError(f"{where}: expected a mapping at the top level, got {_kind(doc)}")
    _check_keys(where, "", doc, TOP_KEYS, {})
    cfg = WebConfig(path=str(p))
    base = p.parent
    tls = doc.get("tls_server_config")
    if tls is not None:
        cfg.ssl_context, cfg.client_auth_type = _tls_context(where, base, tls)
    users = doc.get("basic_auth_users")
    if users is not None:
        cfg.auth = BasicAuth(_users(where, users))
    http = doc.get("http_server_config")
    if http is not None:
        cfg.headers = _http(where, http)
    return cfg


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _check_keys(
    where: str, prefix: str, doc: dict[Any, Any], known: tuple[str, ...], refused: dict[str, str]
) -> None:
    for key in doc:
        name = f"{prefix}{key}"
        if key in refused:
            raise WebConfigError(f"{where}: {name} is not supported: {refused[key]}")
        if key not in known:
            raise WebConfigError(f"{where}: unknown key {name} (known: {', '.join(known)})")


def _str(where: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise WebConfigError(f"{where}: {name} must be a non-empty string, got {_kind(value)}")
    return value


def _file(where: str, base: Path, name: str, value: Any) -> str:
    rel = _str(where, name, value)
    full = Path(rel) if os.path.isabs(rel) else base / rel
    if not full.is_file():
        raise WebConfigError(f"{where}: {name} {full}: file not found")
    return str(full)


def _tls_context(where: str, base: Path, tls: Any) -> tuple[ssl.SSLContext, str]:
    if not isinstance(tls, dict):
        raise WebConfigError(f"{where}: tls_server_config must be a mapping, got {_kind(tls)}")
    _check_keys(where, "tls_server_config.", tls, TLS_KEYS, TLS_REFUSED_KEYS)
    for key in ("cert_file", "key_file"):
        if key not in tls:
            raise WebConfigError(f"{where}: tls_server_config.{key} is required")
    cert = _file(where, base, "tls_server_config.cert_file", tls["cert_file"])
    key = _file(where, base, "tls_server_config.key_file", tls["key_file"])
    low = _version(where, "min_version", tls.get("min_version", "TLS12"))
    high = _version(where, "max_version", tls.get("max_version", "TLS13"))
    if low > high:
        raise WebConfigError(
            f"{where}: tls_server_config.min_version {tls.get('min_version', 'TLS12')} is above "
            f"max_version {tls.get('max_version')}"
        )
    if "prefer_server_cipher_suites" in tls:
        log.info("%s: prefer_server_cipher_suites is accepted and ignored", where)
    ca_value = tls.get("client_ca_file")
    default_auth = "RequireAndVerifyClientCert" if ca_value is not None else "NoClientCert"
    auth = tls.get("client_auth_type", default_auth)
    if auth not in CLIENT_AUTH_TYPES:
        raise WebConfigError(
            f"{where}: tls_server_config.client_auth_type {auth!r} is invalid "
            f"(expected one of {', '.join(CLIENT_AUTH_TYPES)})"
        )
    if auth in UNSUPPORTED_CLIENT_AUTH:
        raise WebConfigError(
            f"{where}: tls_server_config.client_auth_type {auth} is not supported (Python's ssl "
            "cannot accept a client certificate without verifying it); use "
            "VerifyClientCertIfGiven or RequireAndVerifyClientCert with client_ca_file"
        )
    verify = auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
    if verify and ca_value is None:
        raise WebConfigError(
            f"{where}: tls_server_config.client_auth_type {auth} needs client_ca_file"
        )
    if not verify and ca_value is not None:
        raise WebConfigError(
            f"{where}: tls_server_config.client_ca_file is set but client_auth_type is {auth}, "
            "so client certificates would not be checked; set RequireAndVerifyClientCert"
        )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.minimum_version = low
        ctx.maximum_version = high
    except (ValueError, ssl.SSLError) as exc:
        raise WebConfigError(f"{where}: tls_server_config versions rejected: {exc}") from None
    if low < ssl.TLSVersion.TLSv1_2:
        # OpenSSL 3's default security level forbids TLS 1.0/1.1 even when enabled.
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    _check_pem(where, "tls_server_config.cert_file", cert, b"-----BEGIN CERTIFICATE-----")
    _check_pem(where, "tls_server_config.key_file", key, b"PRIVATE KEY-----")

    def no_password() -> bytes:
        raise _EncryptedKey

    try:
        ctx.load_cert_chain(cert, key, password=no_password)
    except _EncryptedKey:
        raise WebConfigError(
            f"{where}: tls_server_config.key_file {key} is encrypted; ddpmon needs an "
            "unencrypted key (protect it with file permissions)"
        ) from None
    except (ssl.SSLError, OSError) as exc:
        raise WebConfigError(
            f"{where}: cannot load tls_server_config.cert_file {cert} with key_file {key}: "
            f"{_ssl_reason(exc)}"
        ) from None
    if verify:
        ca = _file(where, base, "tls_server_config.client_ca_file", ca_value)
        _check_pem(where, "tls_server_config.client_ca_file", ca, b"-----BEGIN CERTIFICATE-----")
        try:
            ctx.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise WebConfigError(
                f"{where}: cannot load tls_server_config.client_ca_file {ca}: {_ssl_reason(exc)}"
            ) from None
        ctx.verify_mode = (
            ssl.CERT_REQUIRED if auth == "RequireAndVerifyClientCert" else ssl.CERT_OPTIONAL
        )
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx, auth


class _EncryptedKey(Exception):
    pass


def _check_pem(where: str, name: str, path: str, marker: bytes) -> None:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise WebConfigError(f"{where}: {name} {path}: cannot read: {exc.strerror}") from None
    if marker not in data:
        what = "certificate" if b"CERTIFICATE" in marker else "private key"
        raise WebConfigError(f"{where}: {name} {path}: no PEM {what} found")


def _ssl_reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason) if reason else str(exc)


def _version(where: str, name: str, value: Any) -> ssl.TLSVersion:
    if value not in TLS_VERSIONS:
        raise WebConfigError(
            f"{where}: tls_server_config.{name} {value!r} is invalid "
            f"(expected one of {', '.join(TLS_VERSIONS)})"
        )
    return TLS_VERSIONS[value]


def _users(where: str, users: Any) -> dict[bytes, bytes]:
    if not isinstance(users, dict):
        raise WebConfigError(
            f"{where}: basic_auth_users must be a mapping of user to bcrypt hash, "
            f"got {_kind(users)}"
        )
    if not users:
        raise WebConfigError(f"{where}: basic_auth_users is empty; remove it or add a user")
    out: dict[bytes, bytes] = {}
    for user, hashed in users.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(
                f"{where}: basic_auth_users: user name {user!r} must be a non-empty string "
                "without ':'"
            )
        raw = hashed.encode("ascii", "replace") if isinstance(hashed, str) else b""
        m = _BCRYPT_RE.match(raw)
        if m is None or not 4 <= int(m.group(1)) <= 31:
            raise WebConfigError(
                f"{where}: basic_auth_users.{user}: not a bcrypt hash "
                "(expected $2b$<cost>$<53 characters>, e.g. from htpasswd -nBC 12 USER)"
            )
        out[user.encode("utf-8")] = raw
    return out


def _http(where: str, http: Any) -> dict[str, str]:
    if not isinstance(http, dict):
        raise WebConfigError(f"{where}: http_server_config must be a mapping, got {_kind(http)}")
    _check_keys(where, "http_server_config.", http, HTTP_KEYS, {})
    if "http2" in http:
        log.info("%s: http_server_config.http2 is accepted and ignored (HTTP/1.1 only)", where)
    headers = http.get("headers") or {}
    if not isinstance(headers, dict):
        raise WebConfigError(f"{where}: http_server_config.headers must be a mapping")
    allowed = {h.lower(): h for h in ALLOWED_HEADERS}
    out: dict[str, str] = {}
    for name, value in headers.items():
        canon = allowed.get(str(name).lower())
        if canon is None:
            raise WebConfigError(
                f"{where}: http_server_config.headers.{name} is not allowed "
                f"(allowed: {', '.join(ALLOWED_HEADERS)})"
            )
        if not isinstance(value, str) or not _HEADER_VALUE_RE.match(value):
            raise WebConfigError(
                f"{where}: http_server_config.headers.{name} must be a printable ASCII string"
            )
        out[canon] = value
    return out


class BasicAuth:
    """bcrypt basic auth with a success cache that a wrong password cannot hit.

    The cache key is (user, sha256(password), hash), so only the exact credential that once
    verified is served from it (CVE-2022-46146 keyed on the user alone). Unknown users are
    checked against a dummy hash of the highest configured cost so the time taken does not
    reveal which users exist. ``check`` may take a full bcrypt round (tens of ms, GIL
    released); ``cached`` never does, so servers answer cached credentials at once and run
    ``check`` off their event loop.
    """

    def __init__(self, users: dict[bytes, bytes]) -> None:
        self._users = users
        cost = max(int(h[4:6]) for h in users.values())
        self._dummy = b"$2b$%02d$" % cost + b"." * 53
        self._cache: OrderedDict[tuple[bytes, bytes, bytes], None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def parse_header(value: str | None) -> tuple[bytes, bytes] | None:
        """``Authorization: Basic b64(user:password)`` -> (user, password), or None."""

        if not value:
            return None
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "basic" or not token:
            return None
        try:
            raw = base64.b64decode(token.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        user, sep, password = raw.partition(b":")
        return (user, password) if sep else None

    def _lookup(self, user: bytes) -> bytes | None:
        found = None
        for name, hashed in self._users.items():  # no early exit: time independent of match
            if hmac.compare_digest(name, user):
                found = hashed
        return found

    def _key(self, user: bytes, password: bytes, hashed: bytes) -> tuple[bytes, bytes, bytes]:
        return (user, hashlib.sha256(password).digest(), hashed)

    def cached(self, user: bytes, password: bytes) -> bool:
        hashed = self._lookup(user)
        if hashed is None:
            return False
        key = self._key(user, password, hashed)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return True
        return False

    def check(self, user: bytes, password: bytes) -> bool:
        import bcrypt  # optional: ddpmon[auth]

        hashed = self._lookup(user)
        if self.cached(user, password):
            return True
        try:
            ok = bcrypt.checkpw(password, hashed if hashed is not None else self._dummy)
        except ValueError:
            ok = False
        ok = ok and hashed is not None
        if ok:
            with self._lock:
                self._cache[self._key(user, password, hashed)] = None
                while len(self._cache) > AUTH_CACHE_SIZE:
                    self._cache.popitem(last=False)
        return ok
