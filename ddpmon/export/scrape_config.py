"""The scrape client's config, validated when loaded so a typo fails at start, not at the
first scrape (``ddpmon top --scrape-config``, ``scrape_config:`` in daemon.yaml, the demo).

The client config is the HTTP part of a Prometheus ``scrape_config``, so the block that lets
Prometheus scrape the ranks can be copied as is::

    scheme: https                    # default: https when tls_config is set, else http
    metrics_path: /metrics
    basic_auth:
      username: prometheus
      password_file: prometheus.pw   # or password: ...; re-read on every scrape
    tls_config:
      ca_file: ca.crt                # paths are relative to this file's directory
      cert_file: client.crt          # client certificate, for mTLS
      key_file: client.key
      server_name: rank0.example     # name checked in the server certificate (and SNI)
      insecure_skip_verify: false
      min_version: TLS12

A key the client does not know is an error naming the file and key, never silently ignored.
"""

from __future__ import annotations

import base64
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..web.config import TLS_VERSIONS

TOP_KEYS = ("scheme", "metrics_path", "basic_auth", "tls_config")
AUTH_KEYS = ("username", "password", "password_file")
TLS_KEYS = (
    "ca_file",
    "cert_file",
    "key_file",
    "server_name",
    "insecure_skip_verify",
    "min_version",
)


class ScrapeError(OSError):
    """A scrape failed; the message names the URL and what to check."""


class ScrapeConfigError(ValueError):
    """The client config or a target is invalid; the message names the file and key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BasicAuth:
    username: str
    password: str | None = None
    password_file: Path | None = None

    def header(self) -> str:
        password = self.password or ""
        if self.password_file is not None:
            try:
                password = self.password_file.read_text().strip()
            except OSError as exc:
                raise ScrapeError(
                    f"basic_auth.password_file {self.password_file}: {exc.strerror or exc}"
                ) from exc
        token = base64.b64encode(f"{self.username}:{password}".encode()).decode()
        return f"Basic {token}"


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsConfig:
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    insecure_skip_verify: bool = False
    min_version: str = "TLS12"

    def context(self, source: str) -> ssl.SSLContext:
        """The client SSL context; bad files are reported against their key in ``source``."""
        try:
            ctx = ssl.create_default_context(
                cafile=str(self.ca_file) if self.ca_file is not None else None
            )
        except (ssl.SSLError, OSError) as exc:
            raise ScrapeConfigError(
                f"{source}: tls_config.ca_file {self.ca_file}: not a readable PEM CA ({exc})"
            ) from exc
        ctx.minimum_version = TLS_VERSIONS[self.min_version]
        if self.cert_file is not None and self.key_file is not None:
            try:
                ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
            except (ssl.SSLError, OSError) as exc:
                raise ScrapeConfigError(
                    f"{source}: tls_config.cert_file {self.cert_file} / key_file "
                    f"{self.key_file}: not a matching PEM certificate and key ({exc})"
                ) from exc
        if self.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


@dataclass(frozen=True, slots=True, kw_only=True)
class ScrapeConfig:
    scheme: str = "http"
    metrics_path: str = "/metrics"
    basic_auth: BasicAuth | None = None
    tls_config: TlsConfig | None = None
    source: str = "scrape config"
    """Where this config came from, for error messages."""

    @classmethod
    def load(cls, path: str | Path) -> ScrapeConfig:
        import yaml  # yaml loads only when used: a light CLI start

        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ScrapeConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        except yaml.YAMLError as exc:
            raise ScrapeConfigError(f"{path}: not valid YAML: {exc}") from exc
        return cls.from_dict(data or {}, source=str(path), base_dir=path.parent)

    @classmethod
    def from_dict(cls, data: Any, *, source: str, base_dir: Path) -> ScrapeConfig:
        """Validate a mapping; relative file paths resolve against ``base_dir``."""
        top = _mapping(data, source, "", TOP_KEYS)
        tls = None
        if top.get("tls_config") is not None:
            tls = _tls(
                _mapping(top["tls_config"], source, "tls_config", TLS_KEYS), source, base_dir
            )
        auth = None
        if top.get("basic_auth") is not None:
            raw = _mapping(top["basic_auth"], source, "basic_auth", AUTH_KEYS)
            auth = _auth(raw, source, base_dir)
        scheme = top.get("scheme", "https" if tls is not None else "http")
        if scheme not in ("http", "https"):
            raise ScrapeConfigError(f"{source}: scheme: {scheme!r}: expected http or https")
        path = top.get("metrics_path", "/metrics")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ScrapeConfigError(
                f"{source}: metrics_path: {path!r}: expected a path like /metrics"
            )
        return cls(scheme=scheme, metrics_path=path, basic_auth=auth, tls_config=tls, source=source)


def _mapping(data: Any, source: str, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    label = f"{source}: {where}" if where else source
    if not isinstance(data, dict):
        raise ScrapeConfigError(f"{label}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise ScrapeConfigError(
            f"{label}: unknown key(s) {', '.join(unknown)} (known: {', '.join(allowed)})"
        )
    return data


def _string(raw: dict, key: str, source: str, where: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise ScrapeConfigError(f"{source}: {where}.{key}: expected a string")
    return value


def _file(raw: dict, key: str, source: str, where: str, base_dir: Path) -> Path | None:
    value = _string(raw, key, source, where)
    if value is None:
        return None
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        raise ScrapeConfigError(f"{source}: {where}.{key}: {path}: no such file")
    return path


def _auth(raw: dict, source: str, base_dir: Path) -> BasicAuth:
    username = _string(raw, "username", source, "basic_auth")
    if not username:
        raise ScrapeConfigError(f"{source}: basic_auth.username: required")
    password = _string(raw, "password", source, "basic_auth")
    password_file = _file(raw, "password_file", source, "basic_auth", base_dir)
    if password is not None and password_file is not None:
        raise ScrapeConfigError(
            f"{source}: basic_auth: set one of password or password_file, not both"
        )
    return BasicAuth(username=username, password=password, password_file=password_file)


def _tls(raw: dict, source: str, base_dir: Path) -> TlsConfig:
    files = {k: _file(raw, k, source, "tls_config", base_dir) for k in TLS_KEYS[:3]}
    if (files["cert_file"] is None) != (files["key_file"] is None):
        raise ScrapeConfigError(f"{source}: tls_config: cert_file and key_file go together")
    skip = raw.get("insecure_skip_verify", False)
    if not isinstance(skip, bool):
        raise ScrapeConfigError(f"{source}: tls_config.insecure_skip_verify: expected true/false")
    min_version = raw.get("min_version", "TLS12")
    if min_version not in TLS_VERSIONS:
        raise ScrapeConfigError(
            f"{source}: tls_config.min_version: {min_version!r}: expected one of "
            f"{', '.join(TLS_VERSIONS)}"
        )
    server_name = _string(raw, "server_name", source, "tls_config")
    tls = TlsConfig(
        **files, server_name=server_name, insecure_skip_verify=skip, min_version=min_version
    )
    tls.context(source)  # report unreadable certificates now, not at the first scrape
    return tls
