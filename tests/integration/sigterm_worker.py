"""A process the SIGTERM flush test stops (``test_sigterm_flush.py``). Modes:

- ``blocked``: rank 0 of a 2-rank gloo job runs 5 monitored steps, then waits in a barrier its
  peer never joins (inside C++, no Python runs); the test sends SIGTERM twice;
- ``fork``: one process runs 3 monitored steps, forks a child that the parent stops with SIGTERM,
  then runs 3 more steps and closes the monitor (the child must not take the parent with it);
- ``stuck``: a ``TermFlush`` whose flush never returns (deadline 0.5 s), the main thread asleep;
- ``own``: the program handles SIGTERM itself (exit code 3); ``TermFlush`` must stay out of it;
- ``later``: a graceful shutdown's handler, set after ``attach``, that calls the handler it
  replaced (as Lightning's does): it sets a flag, and the loop takes one more step and exits 3
  half a second later; nothing may cut that short.

``OUT/ready`` appears once the process waits for its signal; ``OUT/result.json`` holds what a
mode reports."""

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path


def ready(out: Path, **fields) -> None:
    (out / "result.json").write_text(json.dumps(fields))
    (out / "ready").write_text("")


def train(model, opt, steps: int) -> None:
    import torch

    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def monitored(out: Path, run_id: str):
    import torch

    import ddpmon

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(out / "runs"), run_id=run_id,
                        linger_seconds=0.0)
    assert mon.enabled, mon.error
    return model, opt, mon


def blocked(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    model, opt, _ = monitored(out, "blocked")
    train(model, opt, 5)
    if dist.get_rank() == 1:
        time.sleep(120)  # never joins: the test kills it
        return
    ready(out, steps=5)
    dist.barrier()  # rank 1 never comes: only the signal ends this


def forked(out: Path) -> None:
    model, opt, mon = monitored(out, "fork")
    train(model, opt, 3)
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    time.sleep(0.3)
    os.kill(child, signal.SIGTERM)
    _, status = os.waitpid(child, 0)
    train(model, opt, 3)
    mon.close()
    ready(out, child_signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
          child_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None, steps=mon.step)


def later(out: Path) -> None:
    model, opt, _ = monitored(out, "later")
    train(model, opt, 2)
    stop = []
    previous = signal.getsignal(signal.SIGTERM)

    def graceful(signum, frame):  # as Lightning's: note it, then call the handler replaced
        stop.append(1)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, graceful)
    ready(out)
    while not stop:  # the loop goes on to its next step, saves, and exits on its own terms
        time.sleep(0.01)
    train(model, opt, 1)
    time.sleep(0.5)
    os._exit(3)


def stuck(out: Path) -> None:
    from ddpmon.recorder.term_flush import TermFlush

    term = TermFlush(deadline=0.5)
    assert term.install()
    term.flush = lambda until: time.sleep(60)
    ready(out)
    time.sleep(60)


def own(out: Path) -> None:
    from ddpmon.recorder.term_flush import TermFlush

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    ready(out, installed=TermFlush().install())
    time.sleep(60)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", required=True, choices=("blocked", "fork", "stuck", "own", "later"))
    args = p.parse_args()
    out = Path(args.out)
    modes = {"blocked": blocked, "fork": forked, "stuck": stuck, "own": own, "later": later}
    modes[args.mode](out)


if __name__ == "__main__":
    main()
