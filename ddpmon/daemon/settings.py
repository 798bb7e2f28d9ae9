"""The daemon's YAML config: which entry points may be launched, and the input limits.

Only entry points named here can run; a request names one by its key and never supplies a
command. Example::

    entrypoints:
      demo: {module: ddpmon.demo.train, description: "the ddpmon demo"}
    max_nproc: 8
    max_args: 64
    max_arg_length: 256
    max_running_jobs: 4
    port_range: [7500, 7999]
    slurm_args: ["--partition=gpu", "--time=04:00:00"]   # --backend slurm: sbatch options
    scrape_config:                 # how the job summary reads ranks that serve web_config
      basic_auth: {username: prometheus, password_file: prometheus.pw}
      tls_config: {ca_file: ca.crt}  # or a path to a file in `ddpmon top --scrape-config` format
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import DEFAULT_PORT
from ..export.scrape import ScrapeClient, ScrapeConfig, ScrapeConfigError
from .params import DEMO_PARAMS, Param, ParamError, check_args, parse_declaration

DEFAULT_DAEMON_PORT = DEFAULT_PORT - 1
DEMO_MODULE = "ddpmon.demo.train"


class SettingsError(ValueError):
    """The daemon config file is invalid; the message names the key."""


@dataclass(kw_only=True, slots=True)
class Entrypoint:
    name: str
    module: str | None = None
    """Python module run as ``torchrun -m MODULE``."""
    script: str | None = None
    """Or a script path run as ``torchrun SCRIPT``."""
    args: list[str] = field(default_factory=list)
    """Fixed arguments placed before the request's arguments."""
    description: str = ""
    params: dict[str, Any] | None = None
    """The options a request may pass (``--name: type``; ``params.py``). None: none, except
    for the demo module, which declares ``DEMO_PARAMS``."""
    positional: list[Any] | None = None
    """The types of the positional values a request may pass, in order."""
    options: dict[str, Param] = field(init=False)
    values: tuple[Param, ...] = field(init=False)

    def __post_init__(self) -> None:
        if (self.module is None) == (self.script is None):
            raise SettingsError(f"entrypoints.{self.name}: set exactly one of 'module' or 'script'")
        if not all(isinstance(a, str) for a in self.args):
            raise SettingsError(f"entrypoints.{self.name}.args: expected a list of strings")
        try:
            self.options, self.values = parse_declaration(
                self.params, self.positional, f"entrypoints.{self.name}"
            )
        except ParamError as exc:
            raise SettingsError(str(exc)) from None
        if self.params is None and self.module == DEMO_MODULE:
            self.options = dict(DEMO_PARAMS)

    def check_args(self, args: list[str], job_dir: Path | None) -> list[str]:
        """The request's ``args`` as the job gets them (``params.check_args``)."""
        return check_args(args, self.options, self.values, job_dir, self.name)

    def argv(self) -> list[str]:
        head = ["-m", self.module] if self.module else [str(self.script)]
        return head + list(self.args)


@dataclass(kw_only=True, slots=True)
class DaemonSettings:
    entrypoints: dict[str, Entrypoint] = field(
        default_factory=lambda: {
            "demo": Entrypoint(name="demo", module=DEMO_MODULE, description="ddpmon demo")
        }
    )
    max_nproc: int = 8
    """Upper bound on processes per job (1 <= nproc <= max_nproc)."""
    max_args: int = 64
    max_arg_length: int = 256
    max_running_jobs: int = 4
    """Jobs beyond this wait as PENDING."""
    port_range: tuple[int, int] = (7500, 7999)
    """Ranks' /metrics ports are allocated from this range (base + local rank)."""
    job_bind: str = "127.0.0.1"
    """Address the jobs' ranks serve /metrics on (DDPMON_BIND)."""
    cancel_grace_seconds: float = 10.0
    """SIGTERM first; SIGKILL to every process of the job after this long."""
    poll_seconds: float = 0.5
    """How often job processes are checked and their ranks' /metrics scraped."""
    torchrun_args: list[str] = field(default_factory=lambda: ["--monitor-interval", "0.1"])
    """Extra torchrun options (before the entry point)."""
    slurm_args: list[str] = field(default_factory=list)
    """``--backend slurm``: extra ``sbatch`` options for every job (``--partition=gpu``,
    ``--time=04:00:00``, ``--gres=gpu:8``), each one ``--name=value`` string."""
    scrape_config: ScrapeConfig = field(default_factory=ScrapeConfig)
    """Client config for scraping the jobs' ranks (scheme, basic_auth, tls_config), as in a
    Prometheus scrape config; inline or a file path, relative paths against this file."""

    def __post_init__(self) -> None:
        for name, (low, high) in {
            "max_nproc": (1, 1024),
            "max_args": (0, 10_000),
            "max_arg_length": (1, 1_000_000),
            "max_running_jobs": (1, 1000),
        }.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise SettingsError(f"{name}={value!r}: expected an integer from {low} to {high}")
        lo, hi = self.port_range
        if not (1 <= lo <= hi <= 65535):
            raise SettingsError(f"port_range={self.port_range!r}: expected [low, high] in 1..65535")
        if not isinstance(self.slurm_args, list) or not all(
                isinstance(a, str) and a.startswith("--") and "\n" not in a
                for a in self.slurm_args):
            raise SettingsError(f"slurm_args={self.slurm_args!r}: expected a list of "
                                "'--option=value' strings")
        if self.cancel_grace_seconds < 0 or self.poll_seconds <= 0:
            raise SettingsError("cancel_grace_seconds must be >= 0 and poll_seconds > 0")

    def scrape_client(self) -> ScrapeClient:
        """The shared client the job summary scrapes ranks with."""
        return ScrapeClient.for_config(self.scrape_config)

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], *, source: str = "daemon config", base_dir: Path | None = None
    ) -> DaemonSettings:
        data = dict(data or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise SettingsError(f"unknown key(s): {', '.join(sorted(unknown))}")
        if "entrypoints" in data:
            raw = data["entrypoints"]
            if not isinstance(raw, dict):
                raise SettingsError("entrypoints: expected a mapping of name -> {module|script}")
            eps = {}
            for name, spec in raw.items():
                if not isinstance(spec, dict):
                    raise SettingsError(f"entrypoints.{name}: expected a mapping")
                extra = set(spec) - {
                    "module", "script", "args", "description", "params", "positional"
                }
                if extra:
                    raise SettingsError(f"entrypoints.{name}: unknown key(s) {sorted(extra)}")
                eps[str(name)] = Entrypoint(name=str(name), **spec)
            data["entrypoints"] = eps
        if "scrape_config" in data:
            data["scrape_config"] = _scrape_config(
                data["scrape_config"], source, base_dir or Path.cwd()
            )
        if "port_range" in data:
            data["port_range"] = tuple(int(x) for x in data["port_range"])
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path | None) -> DaemonSettings:
        if path is None:
            return cls()
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise SettingsError(f"{path}: {exc}") from exc
        if not isinstance(data, dict):
            raise SettingsError(f"{path}: expected a YAML mapping")
        return cls.from_dict(data, source=str(path), base_dir=Path(path).parent)


def _scrape_config(raw: Any, source: str, base_dir: Path) -> ScrapeConfig:
    """An inline mapping, or the path of a file in the same format."""
    try:
        if isinstance(raw, str):
            path = Path(raw).expanduser()
            return ScrapeConfig.load(path if path.is_absolute() else base_dir / path)
        return ScrapeConfig.from_dict(raw, source=f"{source}: scrape_config", base_dir=base_dir)
    except ScrapeConfigError as exc:
        prefix = f"{source}: scrape_config: " if isinstance(raw, str) else ""
        raise SettingsError(f"{prefix}{exc}") from exc
