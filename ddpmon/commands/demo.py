"""``ddpmon demo``: a monitored multi-rank CPU training run with live progress and a summary.

Runs ``torch.distributed.run`` (torchrun) with the gloo backend on 127.0.0.1, polls every rank's
/metrics endpoint while it trains, and prints a per-rank summary from the files the ranks leave.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddpmon.terminal import SafeConsole as Console

from .. import metrics
from ..config import DEFAULT_PORT
from ..demo import AUTOCAST_DTYPES, OPTIONAL_STATES
from ..export.scrape import ScrapeClient, ScrapeConfigError, ScrapeError

DEMO_LINGER_SECONDS = 6.0
"""The demo's ranks wait at most this long at close for the store (``ddpmon stack`` scrapes
every 5 s); shorter than the agent's default, so a demo without a stack ends promptly."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a monitored multi-rank CPU training (gloo)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--step-delay", type=float, default=0.05, help="sleep per step, seconds")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="N",
        help="global batch split over the ranks (default 8 per rank); the same N and --seed "
        "make --nproc 1 and --nproc 2 runs comparable (`ddpmon compare`)",
    )
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="base port (rank r: port+r)")
    p.add_argument("--run-dir", default="ddpmon-runs")
    p.add_argument("--run-id", default=None)
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="fault, e.g. nan@rank1:step20, scale-collapse@step40, segv@rank1:step25, "
        "grad-scale@rank1:step20, dup-data@rank1:step0, bad-batch@rank1:step30, "
        "bitflip@rank2:step40",
    )
    p.add_argument(
        "--sd-dir",
        default=None,
        help="file_sd directory the ranks publish into (default RUN_DIR/sd, where "
        "`ddpmon stack` looks); 'none' to publish nothing",
    )
    p.add_argument("--daemon-url", default=None, help="register ranks with a ddpmon daemon")
    p.add_argument("--on-nonfinite", default=None, choices=("record", "skip", "raise", "rerun"),
                   help="rerun: each step is handed over as optimizer.step(closure), in fp32, "
                   "and a non-finite one is run again to tell a transient fault from a "
                   "deterministic one")
    p.add_argument("--replica-check-every", type=int, default=None, metavar="N",
                   help="the ranks' replica_check_every (default 100)")
    p.add_argument("--no-amp", action="store_true", help="fp32, no GradScaler")
    p.add_argument("--autocast", choices=AUTOCAST_DTYPES, default="none",
                   help="the ranks' compute dtype under torch.autocast (default none: fp32, "
                   "with the GradScaler still scaling; fp16 and bf16 matmuls are slow on CPUs "
                   "without units for them)")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--hold", type=float, default=0.0, help="keep serving N s after training")
    p.add_argument("--linger", type=float, default=DEMO_LINGER_SECONDS, metavar="S",
                   help="the ranks' linger_seconds: at close, wait up to S s for a store's "
                   f"scraper to take the last step (default {DEMO_LINGER_SECONDS:g}: a little "
                   "over the 5 s scrape interval of `ddpmon stack`; 0: never wait)")
    p.add_argument("--no-progress", action="store_true", help="plain output, no live table")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="rank 0 saves a checkpoint after every K-th step (0: never)")
    p.add_argument("--resume", action="store_true",
                   help="each attempt resumes from the newest checkpoint in "
                   "RUN_DIR/RUN_ID/checkpoints (if any)")
    p.add_argument("--resume-without", action="append", default=[],
                   choices=OPTIONAL_STATES,
                   help="leave this state out when resuming, to see ddpmon name it (repeatable)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="torchrun restarts all ranks up to N times after a failure "
                   "(injected faults fire on the first attempt only)")
    p.add_argument(
        "--scrape-config",
        metavar="FILE",
        default=None,
        help="client config for the live table when the ranks serve TLS/basic auth "
        "(DDPMON_WEB_CONFIG); same format as `ddpmon top --scrape-config`",
    )
    p.set_defaults(func=run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_command(args: argparse.Namespace, run_id: str, master_port: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.nproc}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={master_port}",
        f"--max-restarts={args.max_restarts}",
        "--monitor-interval=0.5",
        "-m",
        "ddpmon.demo.train",
        "--steps",
        str(args.steps),
        "--step-delay",
        str(args.step_delay),
        "--port",
        str(args.port),
        "--run-dir",
        args.run_dir,
        "--run-id",
        run_id,
        "--pg-timeout",
        str(args.pg_timeout),
        "--hold",
        str(args.hold),
        "--linger",
        str(args.linger),
        "--seed",
        str(args.seed),
    ]
    if args.global_batch:
        cmd += ["--global-batch", str(args.global_batch)]
    for spec in args.inject:
        cmd += ["--inject", spec]
    if args.checkpoint_every:
        cmd += ["--checkpoint-every", str(args.checkpoint_every)]
    if args.resume:
        cmd.append("--resume")
    for state in args.resume_without:
        cmd += ["--resume-without", state]
    for flag, value in (
        ("--sd-dir", args.sd_dir),
        ("--daemon-url", args.daemon_url),
        ("--on-nonfinite", args.on_nonfinite),
        ("--replica-check-every", None if args.replica_check_every is None
         else str(args.replica_check_every)),
    ):
        if value:
            cmd += [flag, value]
    if args.no_amp:
        cmd.append("--no-amp")
    if args.autocast != "none":
        cmd += ["--autocast", args.autocast]
    return cmd


def scrape(client: ScrapeClient, port: int) -> dict[str, float]:
    """The values the progress table shows, from one rank's /metrics."""
    return client.samples(f"127.0.0.1:{port}", timeout=0.5)


def run(args: argparse.Namespace) -> int:
    # loaded when the command runs: a light CLI start
    from ..demo.faults import Fault, FaultSpecError

    # Without a terminal (CI logs, a pipe) rich would assume 80 columns and cut numbers to "…":
    # the tables below are laid out to fit 80 columns, and lines never wrap mid-command.
    console = Console(highlight=False)
    try:
        for spec in args.inject:
            Fault.parse(spec)
    except FaultSpecError as exc:
        console.print(f"[red]{exc}")
        return 2
    if args.nproc < 1:
        console.print("[red]--nproc must be >= 1")
        return 2
    if args.checkpoint_every < 0 or args.max_restarts < 0:
        console.print("[red]--checkpoint-every and --max-restarts must be >= 0")
        return 2
    if args.global_batch is not None and (
        args.global_batch < 1 or args.global_batch % args.nproc
    ):
        console.print(f"[red]--global-batch {args.global_batch} must be a positive multiple of "
                      f"--nproc {args.nproc}")
        return 2
    try:
        client = ScrapeClient.from_file(args.scrape_config)
    except ScrapeConfigError as exc:
        console.print(f"[red]{exc}")
        return 2
    run_id = args.run_id or time.strftime("demo-%Y%m%d-%H%M%S")
    if args.sd_dir is None:
        args.sd_dir = str(Path(args.run_dir) / "sd")
    elif args.sd_dir == "none":
        args.sd_dir = None
    run_path = Path(args.run_dir) / run_id
    ports = [args.port + r for r in range(args.nproc)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.setdefault("DDPMON_STALL_SECONDS", "30")
    cmd = rank_command(args, run_id, free_port())
    console.print(
        f"[bold]ddpmon demo[/] run [cyan]{run_id}[/]: {args.nproc} ranks, gloo, "
        f"{args.steps} steps"
    )
    if args.inject:  # its own line: the run line stays under 80 columns in CI logs
        console.print(f"  faults: {', '.join(args.inject)}")
    for rank, port in enumerate(ports):
        console.print(f"  rank {rank}: http://127.0.0.1:{port}/metrics")
    console.print(f"  run dir: {run_path}")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        code = (
            proc.wait() if args.no_progress else _progress(proc, client, ports, args.steps, console)
        )
    except KeyboardInterrupt:
        code = 130
    finally:
        _stop(proc)
    _print_summary(run_path, args.nproc, console)
    console.print(("[green]" if code == 0 else "[red]") + f"training exited with code {code}")
    _print_next_steps(args, run_path, console)
    return code


def next_steps(args: argparse.Namespace, run_path: Path) -> list[tuple[str, str]]:
    """The commands to run next on the run just made: ``(command, what it shows)``."""
    report = run_path / "report.html"
    steps = [
        (f"ddpmon timeline {run_path}", "what happened, every rank on one clock"),
        (f"ddpmon report {run_path} -o {report}", "every step's numbers as one HTML page"),
    ]
    live = f"--sd-dir {args.sd_dir}" if args.sd_dir else "--targets " + " ".join(
        f"127.0.0.1:{args.port + r}" for r in range(args.nproc)
    )
    run_filter = f" --run {run_path.name}" if args.sd_dir else ""
    steps.append((f"ddpmon top {live}{run_filter}",
                  "every rank live (while a run trains; --hold N keeps one serving)"))
    if args.sd_dir:
        steps.append((f"ddpmon stack --sd-dir {args.sd_dir}",
                      "Prometheus + Alertmanager with the shipped rules; run a demo beside it"))
    return steps


def _print_next_steps(args: argparse.Namespace, run_path: Path, console) -> None:
    console.print("\n[bold]Next[/], for this run:")
    for command, what in next_steps(args, run_path):
        console.print(f"  {command}", soft_wrap=True)
        console.print(f"      [dim]{what}[/]", soft_wrap=True)


LIVE_COLUMNS = (
    ("loss", metrics.LOSS, "{:.4g}"),
    ("grad\nnorm", metrics.GRAD_NORM, "{:.4g}"),
    ("local\nnorm", metrics.GRAD_LOCAL_NORM, "{:.4g}"),
    ("NaN\norigin", metrics.GRAD_NONFINITE_ORIGIN_STEPS, "{:.0f}"),
    ("loss\nscale", metrics.AMP_LOSS_SCALE, "{:.0f}"),
    ("skipped", metrics.STEPS_SKIPPED, "{:.0f}"),
)
"""Live-table columns after rank and step: (header, catalogue metric, format)."""


def _progress(
    proc: subprocess.Popen, client: ScrapeClient, ports: list[int], steps: int, console
) -> int:
    from rich.live import Live  # rich loads only when used: a light CLI start
    from rich.table import Table

    last: dict[int, dict[str, float]] = {}
    """Each rank's last answer, shown dimmed once it stops answering (it ended or died)."""

    def table() -> Table:
        t = Table(title="live (scraped from /metrics)", expand=False)
        for col in ("rank", "step", *(header for header, _, _ in LIVE_COLUMNS)):
            t.add_column(col, justify="right", overflow="fold")
        for rank, port in enumerate(ports):
            try:
                m, style = scrape(client, port), ""
                last[rank] = m
            except (ScrapeError, ValueError):
                if rank not in last:
                    t.add_row(str(rank), "[dim]waiting", *[""] * len(LIVE_COLUMNS))
                    continue
                m, style = last[rank], "dim"
            t.add_row(
                str(rank),
                f"{int(m.get(metrics.STEP.name, -1)) + 1}/{steps}",
                *(_fmt(m.get(metric.name), fmt) for _, metric, fmt in LIVE_COLUMNS),
                style=style,
            )
        return t

    if not console.is_terminal:  # CI logs and pipes: a line now and then, one table at the end
        next_line = time.monotonic() + 5.0
        while proc.poll() is None:
            time.sleep(0.5)
            table()  # keeps each rank's last answer
            if time.monotonic() >= next_line and last:
                next_line += 5.0
                done = [int(m.get(metrics.STEP.name, -1)) + 1 for m in last.values()]
                console.print(f"progress: step {min(done)}/{steps} on the slowest of "
                              f"{len(done)} ranks answering")
        console.print(table())
        return proc.returncode
    with Live(table(), console=console, refresh_per_second=4, transient=False) as live:
        while proc.poll() is None:
            time.sleep(0.5)
            live.update(table())
    console.print()
    return proc.returncode


def _fmt(value: float | None, fmt: str = "{:.4g}") -> str:
    return "-" if value is None else fmt.format(value)


def _stop(proc: subprocess.Popen) -> None:
    """Stop torchrun and every rank. Ranks may sit in sessions of their own, so the whole
    process tree is collected first and anything still alive after a grace is SIGKILLed."""
    import psutil  # psutil loads only when used: a light CLI start

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    _, alive = psutil.wait_procs(tree, timeout=0.5)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    if proc.poll() is None:
        proc.wait(timeout=5)


def _print_summary(run_path: Path, nproc: int, console) -> None:
    from rich.table import Table  # rich loads only when used: a light CLI start

    t = Table(title=f"per-rank summary ({run_path})")
    for col in (
        "rank",
        "steps",
        "grad\nnorm",
        "NaN\norigin\nstep",
        "loss\nscale",
        "skipped",
        "collective\np50",
        "collective\np99",
    ):
        t.add_column(col, justify="right", overflow="fold")
    origins: list[str] = []
    for rank in range(nproc):
        path = run_path / f"summary.rank{rank}.json"
        try:
            s = json.loads(path.read_text())
        except (OSError, ValueError):
            t.add_row(str(rank), "[red]no summary (rank died?)", *[""] * 6)
            continue
        first = s.get("first_nonfinite")
        if first:
            origins.append(f"NaN origin: rank {rank}, step {first['step']}, "
                           f"{first['param']} ({first['kind']})")
        t.add_row(
            str(rank),
            str(s.get("steps")),
            _fmt(_num(s.get("grad_norm"))),
            str(first["step"]) if first else "-",
            _fmt(_num(s.get("loss_scale")), "{:.0f}"),
            str(s.get("skipped_steps", s.get("amp_skipped_steps"))),
            _ms(s.get("collective_p50_seconds")),
            _ms(s.get("collective_p99_seconds")),
        )
    console.print(t)
    for line in origins:
        console.print(line, soft_wrap=True)


def _num(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _ms(value: object) -> str:
    v = _num(value)
    return "-" if v is None else f"{v * 1000:.2f} ms"
