"""``ddpmon daemon``: node metrics, http_sd of live ranks, and the job gateway on one port."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import stat
import sys
from pathlib import Path

from ..config import DEFAULT_PORT
from ..web.agent_socket import SOCKET_NAME, AgentSocketError
from ..web.config import WebConfigError, load_web_config

log = logging.getLogger("ddpmon.daemon")


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ddpmon"


def _private_dir(path: Path) -> None:
    """The state dir holds the token, the job database and every job's files: the daemon's user
    only. An existing dir that others can read is tightened, and said so."""

    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077 and path.stat().st_uid == os.geteuid():
        os.chmod(path, 0o700)
        log.warning("ddpmon daemon: state dir %s was mode %o; now 700", path, mode)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "daemon",
        help="run the node daemon (node metrics, /sd discovery, job API)",
        description="Serve node metrics on /metrics, live ranks on /sd (Prometheus http_sd) "
        "and the job API on /api/v1/jobs. Jobs keep running across daemon restarts and are "
        "re-adopted on the next start.",
    )
    p.add_argument("--bind", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT - 1,
        help=f"listen port (default: {DEFAULT_PORT - 1}, the agents' base port - 1)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="job database, job logs, run dirs and the token file "
        "(default: $XDG_STATE_HOME/ddpmon or ~/.local/state/ddpmon)",
    )
    p.add_argument("--config", type=Path, default=None, help="YAML config (entry point allow-list)")
    p.add_argument("--token-file", type=Path, default=None, help="default: STATE_DIR/token")
    p.add_argument("--node", default=None, help="node label (default: host name)")
    p.add_argument(
        "--web-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="exporter-toolkit web config (the agents' format): TLS, mTLS and basic auth for "
        "every route; job routes also take the bearer token. Ranks register on the agent "
        "socket, which needs neither",
    )
    p.add_argument(
        "--agent-socket",
        type=Path,
        default=None,
        metavar="PATH",
        help="the Unix socket on which ranks register; the daemon reads each caller's PID from "
        "it (SO_PEERCRED), so a rank can register only itself (default: STATE_DIR/agent.sock; "
        "put it outside the 0700 state dir for ranks of other users)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name the daemon answers to besides loopback, its bind address, this host's "
        "name and the address a request arrived on (repeatable; a DNS alias Prometheus uses). "
        "Any other Host gets 421: a DNS-rebinding page cannot reach the API",
    )
    p.add_argument(
        "--backend",
        choices=("local", "slurm"),
        default="local",
        help="where jobs run: local (torchrun on this node) or slurm (each job one sbatch job "
        "on a node, followed with scontrol, cancelled with scancel; the state dir must be on "
        "a file system the nodes share)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from ..daemon.app import create_app  # loaded when the command runs: a light CLI start
        from ..daemon.jobs import JobManager
        from ..daemon.node import NodeCollector, build_registry
        from ..daemon.ranks import RankRegistry
        from ..daemon.server import DaemonServer
        from ..daemon.settings import DaemonSettings, SettingsError
        from ..daemon.store import Store, StoreError
        from ..daemon.token import TokenFileError, load_or_create
        from ..sources.nvml import NvmlSource
        from ..web.hostcheck import host_names  # loaded when the command runs: a light CLI start
    except ImportError as exc:
        print(
            f"ddpmon daemon needs the 'daemon' extra: pip install 'ddpmon[daemon]' ({exc})",
            file=sys.stderr,
        )
        return 2

    state_dir: Path = (args.state_dir or default_state_dir()).resolve()
    try:
        settings = DaemonSettings.load(args.config)
    except SettingsError as exc:
        print(f"ddpmon daemon: config error: {exc}", file=sys.stderr)
        return 2
    web = None
    if args.web_config is not None:
        try:
            web = load_web_config(args.web_config)
        except WebConfigError as exc:
            print(f"ddpmon daemon: {exc}", file=sys.stderr)
            return 2
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    _private_dir(state_dir)
    token_file = args.token_file or state_dir / "token"
    try:
        token = load_or_create(token_file)
    except TokenFileError as exc:
        print(f"ddpmon daemon: {exc}", file=sys.stderr)
        return 2

    wildcard = args.bind in ("0.0.0.0", "::", "")
    host = "127.0.0.1" if wildcard else args.bind
    tls = web is not None and web.ssl_context is not None
    url_host = f"[{host}]" if ":" in host else host
    daemon_url = f"{'https' if tls else 'http'}://{url_host}:{args.port}"
    agent_socket = (args.agent_socket or state_dir / SOCKET_NAME).absolute()
    try:
        store = Store(state_dir / "ddpmon.sqlite3")
    except StoreError as exc:
        print(f"ddpmon daemon: {exc}", file=sys.stderr)
        return 2
    if args.backend == "slurm":
        # loaded when the command runs: a light CLI start
        from ..daemon.slurm_jobs import SlurmJobManager, check_available

        why_not = check_available()
        if why_not:
            print(f"ddpmon daemon: {why_not}", file=sys.stderr)
            return 2
        # the ranks run on other nodes: they register with their own node's daemon, if any
        jobs = SlurmJobManager(store, settings, state_dir)
    else:
        jobs = JobManager(
            store, settings, state_dir, daemon_url=daemon_url, agent_socket=str(agent_socket)
        )
    names = host_names(args.bind, args.node, args.allowed_host)
    ranks = RankRegistry(store, names)
    collector = NodeCollector(
        node=args.node or socket.gethostname(),
        nvml=NvmlSource(),
        job_counts=store.count_by_state,
        live_ranks=lambda: len(ranks.live()),
        disk_paths=("/", str(state_dir)),
    )
    app = create_app(jobs=jobs, ranks=ranks, registry=build_registry(collector), token=token)
    server = DaemonServer(
        app, bind=args.bind, port=args.port, token=token, web_config=web,
        agent_socket=agent_socket, host_names=names,
    )
    jobs.start()
    log.info(
        "ddpmon daemon on %s://%s:%d (agent socket %s; state %s, token file %s, "
        "entry points: %s)",
        "https" if tls else "http",
        args.bind,
        args.port,
        agent_socket,
        state_dir,
        token_file,
        ", ".join(sorted(settings.entrypoints)),
    )
    try:
        server.run()
    except AgentSocketError as exc:
        print(f"ddpmon daemon: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ddpmon daemon: cannot listen on {args.bind}:{args.port}: {exc}", file=sys.stderr)
        return 2
    finally:
        jobs.close()
        store.close()
    return 0
