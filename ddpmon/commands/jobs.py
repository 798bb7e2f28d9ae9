"""``ddpmon jobs submit|status|list|cancel|logs``: talk to a ``ddpmon daemon`` over HTTP(S).

A daemon behind TLS (``ddpmon daemon --web-config``) is reached with ``--ca FILE`` (the CA that
signed its certificate) or ``--client-config FILE``: the same Prometheus-style client config as
``ddpmon top --scrape-config`` (``tls_config`` with ``ca_file``, a client certificate for mTLS,
``server_name``; ``basic_auth`` for reads when the daemon asks for it). Without either, Python's
default trust store is used, which ``SSL_CERT_FILE`` still overrides.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from ddpmon.terminal import SafeConsole as Console

from ..config import DEFAULT_PORT
from ..export.scrape_config import ScrapeConfig, TlsConfig
from ..terminal import shown
from .daemon import default_state_dir

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "LOST"}
STATE_STYLE = {
    "PENDING": "yellow",
    "RUNNING": "cyan",
    "COMPLETED": "green",
    "FAILED": "bold red",
    "CANCELLED": "magenta",
    "LOST": "red",
}


def _default_url(tls: bool = False) -> str:
    scheme = "https" if tls else "http"
    return os.environ.get("DDPMON_DAEMON_URL") or f"{scheme}://127.0.0.1:{DEFAULT_PORT - 1}"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("jobs", help="submit, inspect and cancel jobs on a ddpmon daemon")
    p.add_argument("--url", default=None, help="daemon URL (default: $DDPMON_DAEMON_URL or :7469)")
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="bearer token for submit/cancel (default: $DDPMON_DAEMON_TOKEN_FILE, "
        "else the daemon's default state dir)",
    )
    tls = p.add_mutually_exclusive_group()
    tls.add_argument(
        "--ca",
        type=Path,
        default=None,
        metavar="FILE",
        help="PEM CA bundle that signed the daemon's TLS certificate (default URL becomes https)",
    )
    tls.add_argument(
        "--client-config",
        "--scrape-config",
        dest="client_config",
        type=Path,
        default=None,
        metavar="FILE",
        help="client config as for `ddpmon top --scrape-config`: tls_config (ca_file, "
        "cert_file/key_file for mTLS, server_name), basic_auth for reads; metrics_path unused",
    )
    p.add_argument("--json", action="store_true", help="print the raw JSON answer")
    sub = p.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)

    s = sub.add_parser("submit", help="launch an allow-listed entry point under torchrun")
    s.add_argument("job_id")
    s.add_argument("entrypoint")
    s.add_argument("--nproc", type=int, default=1)
    s.add_argument("--wait", action="store_true", help="poll until the job ends")
    s.add_argument(
        "job_args",
        nargs=argparse.REMAINDER,
        help="[--nproc N] [--wait] -- ARGS for the entry point",
    )

    st = sub.add_parser("status", help="one job in detail")
    st.add_argument("job_id")
    st.add_argument("--wait", action="store_true", help="poll until the job ends")

    ls = sub.add_parser("list", help="all jobs")
    ls.add_argument("--state", default=None)

    c = sub.add_parser("cancel", help="SIGTERM the job, SIGKILL after the grace period")
    c.add_argument("job_id")

    lg = sub.add_parser("logs", help="tail of one rank's stdout/stderr")
    lg.add_argument("job_id")
    lg.add_argument("--rank", type=int, default=0)
    lg.add_argument("--stream", choices=("stdout", "stderr"), default="stderr")
    p.set_defaults(func=run)


def _token(args: argparse.Namespace) -> str | None:
    path = args.token_file or os.environ.get("DDPMON_DAEMON_TOKEN_FILE")
    path = Path(path) if path else default_state_dir() / "token"
    try:
        return path.read_text().strip()
    except OSError:
        return None


def run(args: argparse.Namespace) -> int:
    import httpx  # optional: ddpmon[daemon]

    logging.getLogger("httpx").setLevel(logging.WARNING)

    console = Console()
    err = Console(stderr=True)
    try:
        client_config = _client_config(args)
        verify = _verify(client_config)
    except ValueError as exc:  # ScrapeConfigError: names the file and key
        print(f"ddpmon jobs: {exc}", file=sys.stderr)
        return 2
    tls = client_config is not None and client_config.scheme == "https"
    url = (args.url or _default_url(tls)).rstrip("/")
    headers = {}
    if client_config is not None and client_config.basic_auth is not None:
        try:
            headers["Authorization"] = client_config.basic_auth.header()
        except OSError as exc:  # ScrapeError: an unreadable password_file
            print(f"ddpmon jobs: {exc}", file=sys.stderr)
            return 2
    if args.jobs_command in ("submit", "cancel"):
        token = _token(args)
        if token is None:
            err.print("[red]no token: pass --token-file (the daemon's STATE_DIR/token)[/]")
            return 2
        headers["Authorization"] = f"Bearer {token}"
    try:
        hooks = _server_name_hooks(client_config)
        with httpx.Client(
            base_url=url, headers=headers, timeout=10.0, verify=verify, event_hooks=hooks
        ) as client:
            return _dispatch(args, client, console, err)
    except httpx.TransportError as exc:
        err.print(f"[red]cannot reach the ddpmon daemon at {shown(url)}: {shown(exc)}[/]")
        return 3


def _client_config(args: argparse.Namespace) -> Any:
    """The client config from ``--client-config``, or one made of ``--ca`` alone, or None."""

    if args.client_config is not None:
        return ScrapeConfig.load(args.client_config)
    if args.ca is not None:
        return ScrapeConfig(scheme="https", tls_config=TlsConfig(ca_file=args.ca), source="--ca")
    return None


def _verify(config: Any) -> Any:
    """What httpx verifies the daemon with: the config's SSL context, else the default."""
    if config is None or config.tls_config is None:
        return True
    return config.tls_config.context(config.source)


def _server_name_hooks(config: Any) -> dict[str, list]:
    """``tls_config.server_name``: the name checked in the daemon's certificate (and sent as
    SNI) when it differs from the URL's host, as for the scrape client."""
    name = config.tls_config.server_name if config and config.tls_config else None
    if not name:
        return {}

    def sni(request: Any) -> None:
        request.extensions["sni_hostname"] = name

    return {"request": [sni]}


def _check(resp: Any, err: Any) -> dict[str, Any] | None:
    try:
        body = resp.json()
    except ValueError:
        body = {"error": resp.text}
    if resp.status_code >= 400:
        error = body.get("error", body) if isinstance(body, dict) else body
        err.print(f"[red]HTTP {resp.status_code}: {shown(error)}[/]")
        return None
    return body


def _dispatch(args: argparse.Namespace, client: Any, console: Any, err: Any) -> int:
    cmd = args.jobs_command
    if cmd == "logs":
        resp = client.get(
            f"/api/v1/jobs/{args.job_id}/logs", params={"rank": args.rank, "stream": args.stream}
        )
        if resp.status_code >= 400:
            return 0 if _check(resp, err) else 1
        sys.stdout.write(resp.text)
        return 0
    if cmd == "submit":
        job_args = _split_submit_options(args, list(args.job_args))
        body = {"id": args.job_id, "entrypoint": args.entrypoint, "nproc": args.nproc}
        body["args"] = job_args
        job = _check(client.post("/api/v1/jobs", json=body), err)
        if job is None:
            return 1
    elif cmd == "cancel":
        job = _check(client.delete(f"/api/v1/jobs/{args.job_id}"), err)
        if job is None:
            return 1
    elif cmd == "list":
        params = {"state": args.state} if args.state else {}
        found = _check(client.get("/api/v1/jobs", params=params), err)
        if found is None:
            return 1
        if args.json:
            console.print_json(json.dumps(found))
        else:
            console.print(_list_table(found["jobs"]))
        return 0
    else:
        job = _check(client.get(f"/api/v1/jobs/{args.job_id}"), err)
        if job is None:
            return 1
    if getattr(args, "wait", False):
        while job["state"] not in FINAL:
            time.sleep(1.0)
            job = _check(client.get(f"/api/v1/jobs/{job['id']}"), err)
            if job is None:
                return 1
    if args.json:
        console.print_json(json.dumps(job))
    else:
        _print_job(console, job)
    if getattr(args, "wait", False):
        return 0 if job["state"] == "COMPLETED" else 1
    return 0


def _split_submit_options(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """REMAINDER keeps ``--nproc``/``--wait`` written after the positionals; take them back."""
    head, tail = (
        (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else ([], rest)
    )
    opts = argparse.ArgumentParser(prog="ddpmon jobs submit", add_help=False)
    opts.add_argument("--nproc", type=int, default=args.nproc)
    opts.add_argument("--wait", action="store_true", default=args.wait)
    parsed = opts.parse_args(head)
    args.nproc, args.wait = parsed.nproc, parsed.wait
    return tail


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _list_table(jobs: list[dict[str, Any]]) -> Any:
    from rich.table import Table  # rich loads only when used: a light CLI start

    table = Table(title="ddpmon jobs")
    for col in ("id", "state", "entrypoint", "nproc", "created", "step", "reason"):
        table.add_column(col)
    for j in jobs:
        style = STATE_STYLE.get(j["state"], "")
        step = j.get("summary", {}).get("max_step")
        table.add_row(
            shown(j["id"]),
            f"[{style}]{shown(j['state'])}[/]",
            shown(j["entrypoint"]),
            shown(j["nproc"]),
            _when(j["created_at"]),
            "-" if step is None else shown(int(step)),
            shown(j.get("reason") or ""),
        )
    return table


def _print_job(console: Any, job: dict[str, Any]) -> None:
    from rich.table import Table  # rich loads only when used: a light CLI start

    style = STATE_STYLE.get(job["state"], "")
    console.print(
        f"[bold]{shown(job['id'])}[/]  [{style}]{shown(job['state'])}[/]  "
        f"{shown(job.get('reason') or '')}"
    )
    args = " ".join(shown(a) for a in job["args"]) or "-"
    console.print(f"entrypoint {shown(job['entrypoint'])} x{shown(job['nproc'])}  args {args}")
    console.print(
        f"created {_when(job['created_at'])}  started {_when(job['started_at'])}  "
        f"ended {_when(job['ended_at'])}  ports {shown(job['ports'])}"
    )
    console.print(f"run dir {shown(job['run_path'])}  logs {shown(job['job_dir'])}/logs")
    first = job.get("first_failure")
    if first:
        what = (
            f"signal {first['signal']} ({first.get('signal_name') or ''})"
            if first.get("signal")
            else first.get("kind")
        )
        step = f" at step {first['step']}" if first.get("step") is not None else ""
        console.print(
            f"[red]first failure: rank {shown(first.get('rank'))} {shown(what)}{shown(step)} "
            f"(from {shown(first.get('source'))})[/]"
        )
    summary_ranks = job.get("summary", {}).get("ranks", {})
    ranks = sorted(set(job.get("ranks", {})) | set(summary_ranks), key=int)
    if not ranks:
        return
    table = Table()
    for col in ("rank", "exit", "step", "loss", "grad norm", "loss scale", "skipped", "up"):
        table.add_column(col)
    for r in ranks:
        st = job.get("ranks", {}).get(r, {})
        sm = summary_ranks.get(r, {})
        if st.get("signal"):
            exit_text = f"signal {st['signal']} {st.get('signal_name') or ''}"
        elif st.get("exit_code") is not None:
            exit_text = str(st["exit_code"])
        else:
            exit_text = st.get("note", "-") if st else "-"
        table.add_row(
            shown(r),
            shown(exit_text),
            _fmt(sm.get("step")),
            _fmt(sm.get("loss")),
            _fmt(sm.get("grad_norm")),
            _fmt(sm.get("loss_scale")),
            _fmt(sm.get("skipped_steps_total")),
            "yes" if sm.get("up") else "no",
        )
    console.print(table)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return f"{value:.4g}" if isinstance(value, float) else shown(value)
