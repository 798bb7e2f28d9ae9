"""The one client that reads ranks' /metrics: ``ddpmon top``, the demo and the daemon's job
summary all scrape through ``ScrapeClient``, so an agent behind TLS and basic auth (``web_config``)
is readable by every tool with the same client config.

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
Targets are ``host:port`` (scheme and path from the config) or ``https://host:port[/path]``.
"""

from __future__ import annotations

import base64
import functools
import http.client
import json
import ssl
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .. import metrics
from .webconfig import TLS_VERSIONS

MAX_BODY_BYTES = 16 * 1024 * 1024
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


class ScrapeConfigError(ValueError):
    """The client config or a target is invalid; the message names the file and key."""


class ScrapeError(OSError):
    """A scrape failed; the message names the URL and what to check."""


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
        import yaml

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


@dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str
    port: int
    path: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"


class _HTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection that checks the certificate against ``server_name`` when set."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float,
        context: ssl.SSLContext,
        server_name: str | None,
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._tls_context = context
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._tls_context.wrap_socket(
            self.sock, server_hostname=self._server_name or self.host
        )


class ScrapeClient:
    """Fetches /metrics over http or https with the config's auth; one instance per config."""

    def __init__(self, config: ScrapeConfig | None = None) -> None:
        self.config = config or ScrapeConfig()
        self._tls = self.config.tls_config or TlsConfig()
        self._context_cache: ssl.SSLContext | None = None

    @property
    def _context(self) -> ssl.SSLContext:
        """Built at the first https scrape: loading the trust store costs milliseconds."""
        if self._context_cache is None:
            self._context_cache = self._tls.context(self.config.source)
        return self._context_cache

    @classmethod
    def from_file(cls, path: str | Path | None) -> ScrapeClient:
        return cls(ScrapeConfig.load(path) if path else None)

    @classmethod
    def for_config(cls, config: ScrapeConfig) -> ScrapeClient:
        """A shared client per config, for callers that scrape in a loop (the daemon)."""
        return _client_for(config)

    def target(self, target: str) -> Target:
        """Parse ``host:port`` or ``http(s)://host:port[/path]``."""
        explicit = "://" in target
        parts = urlsplit(target if explicit else f"//{target}")
        scheme = parts.scheme if explicit else self.config.scheme
        if scheme not in ("http", "https"):
            raise ScrapeConfigError(f"target {target}: scheme {scheme!r}: expected http or https")
        try:
            port = parts.port
        except ValueError as exc:
            raise ScrapeConfigError(f"target {target}: the port is not a number 0-65535") from exc
        if not parts.hostname or port is None:
            raise ScrapeConfigError(f"target {target}: expected host:port or https://host:port")
        path = parts.path if explicit and parts.path not in ("", "/") else self.config.metrics_path
        return Target(scheme, parts.hostname, port, path)

    def fetch(self, target: str | Target, timeout: float = 1.0) -> str:
        """The exposition text of one endpoint; ``ScrapeError`` saying what went wrong."""
        t = target if isinstance(target, Target) else self.target(target)
        conn: http.client.HTTPConnection
        if t.scheme == "https":
            conn = _HTTPSConnection(
                t.host,
                t.port,
                timeout=timeout,
                context=self._context,
                server_name=self._tls.server_name,
            )
        else:
            conn = http.client.HTTPConnection(t.host, t.port, timeout=timeout)
        headers = {"Accept": "text/plain"}
        auth = self.config.basic_auth
        if auth is not None:
            headers["Authorization"] = auth.header()
        try:
            conn.request("GET", t.path, headers=headers)
            resp = conn.getresponse()
            body = resp.read(MAX_BODY_BYTES + 1)
        except ssl.SSLCertVerificationError as exc:
            raise ScrapeError(
                f"{t.url}: TLS certificate not trusted ({exc.verify_message}); check "
                f"tls_config.ca_file and server_name in {self.config.source}"
            ) from exc
        except ssl.SSLError as exc:
            raise ScrapeError(
                f"{t.url}: TLS handshake failed ({exc.reason or exc}); does the endpoint serve "
                "https, and does it want a client certificate (tls_config.cert_file)?"
            ) from exc
        except (http.client.BadStatusLine, ConnectionResetError) as exc:
            hint = " (is it an https endpoint?)" if t.scheme == "http" else ""
            raise ScrapeError(f"{t.url}: connection closed without an HTTP answer{hint}") from exc
        except TimeoutError as exc:
            raise ScrapeError(f"{t.url}: no answer within {timeout:g} s") from exc
        except OSError as exc:
            raise ScrapeError(f"{t.url}: {exc.strerror or exc}") from exc
        finally:
            conn.close()
        if resp.status == 401:
            why = (
                f"rejected the credentials of basic_auth.username {auth.username!r}"
                if auth is not None
                else "wants basic auth; set basic_auth in a scrape config"
            )
            raise ScrapeError(f"{t.url}: 401 Unauthorized: the endpoint {why}")
        if resp.status != 200:
            raise ScrapeError(f"{t.url}: HTTP {resp.status} {resp.reason}")
        if len(body) > MAX_BODY_BYTES:
            raise ScrapeError(f"{t.url}: answer larger than {MAX_BODY_BYTES} bytes")
        return body.decode("utf-8", "replace")

    def samples(self, target: str | Target, timeout: float = 1.0) -> dict[str, float]:
        return flatten(self.fetch(target, timeout))


@functools.lru_cache(maxsize=8)
def _client_for(config: ScrapeConfig) -> ScrapeClient:
    return ScrapeClient(config)


def flatten(text: str) -> dict[str, float]:
    """Samples keyed by name. Series with labels beyond run/rank are dropped, except
    ``ddpmon_agent_errors_total`` (summed over probes) and the rank read from
    ``ddpmon_rank_info`` (as ``rank``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = sample.labels.keys() - set(metrics.BASE_LABELS)
            if not extra:
                out[sample.name] = sample.value
            elif sample.name == metrics.AGENT_ERRORS.name:
                out[sample.name] += sample.value
            elif sample.name == metrics.RANK_INFO.name:
                out["rank"] = float(sample.labels.get("rank", "nan"))
    return dict(out)


def scrape(
    target: str, timeout: float = 1.0, client: ScrapeClient | None = None
) -> dict[str, float]:
    """``flatten`` of one endpoint, with a plain-http client unless one is given."""
    return (client or ScrapeClient()).samples(target, timeout)


def targets_from_sd_dir(sd_dir: str | Path, run: str | None = None) -> list[tuple[str, dict]]:
    """``(target, labels)`` of every rank published into a file_sd directory."""
    found = []
    for path in sorted(Path(sd_dir).glob("*.json")):
        try:
            groups = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now, or not ours
        for group in groups if isinstance(groups, list) else []:
            labels = group.get("labels", {})
            if run is not None and labels.get("run") != run:
                continue
            found.extend((t, labels) for t in group.get("targets", []))
    return found
