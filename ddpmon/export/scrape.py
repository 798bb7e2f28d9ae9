"""The one client that reads ranks' /metrics: ``ddpmon top``, the demo and the daemon's job
summary all scrape through ``ScrapeClient``, so an agent behind TLS and basic auth (``web_config``)
is readable by every tool with one client config (format: ``scrape_config.py``).

Targets are ``host:port`` (scheme and path from the config) or ``https://host:port[/path]``.
Failures raise ``ScrapeError`` naming the URL and what to check (401, untrusted certificate,
handshake, plain http to an https endpoint, timeout).

``timeout`` is a deadline for the whole scrape (connect, handshake, request, headers and body),
not for each read: an endpoint that trickles one byte every 0.3 s is cut off when the deadline
passes, so it cannot hold a caller (the daemon's job summary, ``ddpmon top``) for longer.
"""

from __future__ import annotations

import functools
import http.client
import io
import json
import socket
import ssl
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .. import metrics
from ..rundir.damage import ReadWarnings, parse_json_object, type_name
from .scrape_config import (
    BasicAuth,
    ScrapeConfig,
    ScrapeConfigError,
    ScrapeError,
    TlsConfig,
)

__all__ = [
    "BasicAuth",
    "ScrapeClient",
    "ScrapeConfig",
    "ScrapeConfigError",
    "ScrapeError",
    "Target",
    "TlsConfig",
    "flatten",
    "scrape",
    "read_sd_dir",
    "targets_from_sd_dir",
]

MAX_BODY_BYTES = 16 * 1024 * 1024


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


def _remaining(deadline: float) -> float:
    """Seconds left before ``deadline`` (``time.monotonic``); TimeoutError once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("scrape deadline passed")
    return left


class _DeadlineReader(io.RawIOBase):
    """The response's reads from the socket, each bounded by what is left of the deadline:
    ``http.client`` reads headers line by line and the body in pieces, so a per-read timeout
    alone lets a trickling endpoint hold the scrape for as long as it keeps sending."""

    def __init__(self, owner: _DeadlineSocket) -> None:
        super().__init__()
        self._owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def,override]
        sock = self._owner.sock
        sock.settimeout(_remaining(self._owner.deadline))
        return sock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._owner.release_reader()
        super().close()


class _DeadlineSocket:
    """A connected socket whose ``makefile`` (what ``HTTPResponse`` reads through) keeps the
    scrape's deadline; everything else is the socket's own.

    ``close`` waits for the open readers, as ``socket.makefile``'s files do: for an answer that
    ends by closing the connection (HTTP/1.0, ``Connection: close``) ``http.client`` closes the
    connection right after the headers and leaves the response to read the body from its file;
    closing the socket then would cut the body off with "Bad file descriptor"."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self._readers = 0
        self._close_asked = False

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def release_reader(self) -> None:
        self._readers -= 1
        if self._close_asked and self._readers <= 0:
            self.sock.close()

    def close(self) -> None:
        self._close_asked = True
        if self._readers <= 0:
            self.sock.close()

    def sendall(self, data: bytes) -> None:
        self.sock.settimeout(_remaining(self.deadline))
        self.sock.sendall(data)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.sock, name)


class _HTTPConnection(http.client.HTTPConnection):
    """A plain connection whose whole exchange ends by ``deadline``."""

    def __init__(self, host: str, port: int, *, deadline: float) -> None:
        super().__init__(host, port, timeout=max(deadline - time.monotonic(), 0.001))
        self._deadline = deadline

    def connect(self) -> None:
        self.timeout = _remaining(self._deadline)
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self._deadline)  # type: ignore[assignment]


class _HTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection that checks the certificate against ``server_name`` when set, and
    whose whole exchange (the handshake included) ends by ``deadline``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        deadline: float,
        context: ssl.SSLContext,
        server_name: str | None,
    ) -> None:
        super().__init__(
            host, port, timeout=max(deadline - time.monotonic(), 0.001), context=context
        )
        self._tls_context = context
        self._server_name = server_name
        self._deadline = deadline

    def connect(self) -> None:
        self.timeout = _remaining(self._deadline)
        http.client.HTTPConnection.connect(self)
        self.sock.settimeout(_remaining(self._deadline))  # the handshake is one deadline
        tls = self._tls_context.wrap_socket(
            self.sock, server_hostname=self._server_name or self.host
        )
        self.sock = _DeadlineSocket(tls, self._deadline)  # type: ignore[assignment]


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
        """The exposition text of one endpoint, read whole within ``timeout`` seconds (a
        deadline for the entire scrape); ``ScrapeError`` saying what went wrong."""
        t = target if isinstance(target, Target) else self.target(target)
        deadline = time.monotonic() + timeout
        conn: http.client.HTTPConnection
        if t.scheme == "https":
            conn = _HTTPSConnection(
                t.host,
                t.port,
                deadline=deadline,
                context=self._context,
                server_name=self._tls.server_name,
            )
        else:
            conn = _HTTPConnection(t.host, t.port, deadline=deadline)
        headers = {"Accept": "text/plain"}
        auth = self.config.basic_auth
        if auth is not None:
            headers["Authorization"] = auth.header()
        resp: http.client.HTTPResponse | None = None
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
            raise ScrapeError(f"{t.url}: no complete answer within {timeout:g} s") from exc
        except OSError as exc:
            raise ScrapeError(f"{t.url}: {exc.strerror or exc}") from exc
        finally:
            if resp is not None:
                resp.close()  # an answer that closes the connection holds the socket until now
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


_PER_OP = frozenset(
    (
        metrics.COLLECTIVE_DURATION.sample("sum"),
        metrics.COLLECTIVE_DURATION.sample("count"),
        metrics.COLLECTIVE_BYTES.name,
    )
)


_PART = metrics.STEP_PART_SECONDS.name


def stage_key(stage: str) -> str:
    """The key of :func:`flatten`'s output naming the pipeline stage(s) a rank runs."""
    return f'{_PART}{{stage="{stage}"}}'


def stage_of(samples: dict[str, float]) -> str | None:
    """The stage(s) a rank runs, from :func:`flatten`'s output; None outside pipelines."""
    prefix = stage_key("")[:-2]
    return next((k[len(prefix):-2] for k in samples if k.startswith(prefix)), None)


def flatten(text: str) -> dict[str, float]:
    """Samples keyed by name. Series with labels beyond run/rank are dropped, except
    ``ddpmon_agent_errors_total`` (summed over probes), ``ddpmon_steps_skipped_total`` (over
    skippers), the rank read from
    ``ddpmon_rank_info`` (as ``rank``) and the collective families' ``_sum``, ``_count`` and
    bytes (summed over ops under the plain name, and each op as ``name{op="..."}``), and the
    step's parts, each as ``name{part="..."}`` (a pipeline rank's stage as the key
    :func:`stage_key`, valued 1)."""
    # prometheus_client loads only when used: a light CLI start
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = sample.labels.keys() - set(metrics.BASE_LABELS)
            if not extra:
                out[sample.name] = sample.value
            elif sample.name in (metrics.AGENT_ERRORS.name, metrics.STEPS_SKIPPED.name):
                out[sample.name] += sample.value  # summed over probes, over skippers
            elif sample.name == metrics.RANK_INFO.name:
                out["rank"] = float(sample.labels.get("rank", "nan"))
            elif extra == {"op"} and sample.name in _PER_OP:
                out[sample.name] += sample.value
                out[f'{sample.name}{{op="{sample.labels["op"]}"}}'] = sample.value
            elif "part" in extra <= {"part", "stage"} and sample.name == _PART:
                out[f'{_PART}{{part="{sample.labels["part"]}"}}'] = sample.value
                if stage := sample.labels.get("stage"):  # a pipeline rank's stages
                    out[stage_key(stage)] = 1.0
    return dict(out)


def scrape(
    target: str, timeout: float = 1.0, client: ScrapeClient | None = None
) -> dict[str, float]:
    """``flatten`` of one endpoint, with a plain-http client unless one is given."""
    return (client or ScrapeClient()).samples(target, timeout)


def targets_from_sd_dir(sd_dir: str | Path, run: str | None = None) -> list[tuple[str, dict]]:
    """``(target, labels)`` of every rank published into a file_sd directory."""
    return read_sd_dir(sd_dir, run, ReadWarnings(Path(sd_dir)))


def read_sd_dir(
    sd_dir: str | Path, run: str | None, damage: ReadWarnings
) -> list[tuple[str, dict]]:
    """:func:`targets_from_sd_dir` that names each damaged file in ``damage``: not JSON, not a
    list of ``{"targets": [...], "labels": {...}}`` groups, or a group of another shape. What is
    readable is still used (another file's targets, the good groups of a file)."""

    found: list[tuple[str, dict]] = []
    for path in sorted(Path(sd_dir).glob("*.json")):
        try:
            raw = path.read_bytes()
        except OSError as exc:
            damage.add(path, f"unreadable ({exc.strerror or exc})", "skipped")
            continue
        try:
            groups = json.loads(raw)
        except ValueError:
            _, problem = parse_json_object(raw)
            damage.add(path, problem or "not JSON", "its targets skipped")
            continue
        if not isinstance(groups, list):
            damage.add(path, f"a JSON {type_name(groups)}, not a list of target groups",
                       "skipped")
            continue
        bad = 0
        for group in groups:
            targets = group.get("targets") if isinstance(group, dict) else None
            labels = group.get("labels", {}) if isinstance(group, dict) else None
            if not isinstance(targets, list) or not isinstance(labels, dict) or not all(
                    isinstance(t, str) for t in targets):
                bad += 1
                continue
            if run is not None and labels.get("run") != run:
                continue
            found.extend((t, labels) for t in targets)
        if bad:
            damage.add(path, f"{bad} of {len(groups)} target group(s) not "
                       '{"targets": [str...], "labels": {...}}', "those skipped")
    return found
