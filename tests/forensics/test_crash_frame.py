"""The crashing frame is the training code's, in the current thread. A script attaches the agent
(its watchdog and writer threads idle beside it) and gets SIGSEGV inside backward (a gradient
hook), inside the optimizer's step, in the data loader and between steps; faulthandler lists
every thread, the current one among them, and the timeline must name the script's own function
each time, never a ddpmon thread's ``wait``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpmon.forensics.crash_files import top_frame
from ddpmon.forensics.timeline import build_timeline

SCRIPT = '''
import ctypes, sys
import torch
from torch import nn
import ddpmon

WHERE = sys.argv[2]

class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        if WHERE == "loader" and i == 3 * 4:
            ctypes.string_at(0)  # SIGSEGV
        return torch.randn(8)

class Stepping(torch.optim.SGD):
    def step(self, closure=None):
        if WHERE == "optimizer" and self.steps_taken == 3:
            ctypes.string_at(0)  # SIGSEGV
        self.steps_taken += 1
        return super().step(closure)

def poison_hook(grad):
    ctypes.string_at(0)  # SIGSEGV

def between_steps(step):
    if WHERE == "between" and step == 3:
        ctypes.string_at(0)  # SIGSEGV

def train():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = Stepping(model.parameters(), lr=0.01)
    opt.steps_taken = 0
    mon = ddpmon.attach(model, opt, port=0, bind="127.0.0.1", run_dir=sys.argv[1], run_id="r")
    loader = torch.utils.data.DataLoader(Batches(), batch_size=4)
    for step, x in enumerate(loader):
        loss = model(x).pow(2).mean()
        mon.observe_loss(loss)
        if WHERE == "backward" and step == 3:
            model[0].weight.register_hook(poison_hook)
        loss.backward()
        opt.step()
        opt.zero_grad()
        between_steps(step)
    mon.close()

train()
'''

EXPECTED = {
    "backward": "poison_hook",
    "optimizer": "step",
    "loader": "__getitem__",
    "between": "between_steps",
}
STEP_AND_PHASE = {  # the step that was running: steps 0-2 completed in each script
    "backward": (3, "in forward or backward"),
    "optimizer": (3, "in the optimizer step"),
    "loader": (3, "before its forward"),  # batch 3 is loaded before step 3's forward
    "between": (4, "before its forward"),  # step 3 completed at opt.step()
}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, str]]:
    """The four crashes, run at once (each is a fresh interpreter importing torch)."""
    root = tmp_path_factory.mktemp("frames")
    script = root / "train_script.py"
    script.write_text(SCRIPT)
    procs = {
        where: subprocess.Popen(
            [sys.executable, str(script), str(root / where), where],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for where in EXPECTED
    }
    out = {}
    for where, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == -11, err[-2000:]
        out[where] = (script, root / where / "r", err)
    return out


@pytest.mark.parametrize("where", sorted(EXPECTED))
def test_the_crash_names_the_training_codes_frame(crashed, where):
    script, run, _ = crashed[where]
    dump = (run / "crash.rank0.txt").read_text()
    assert "Current thread" in dump and dump.count("Thread 0x") >= 1, dump  # others listed too
    sig = [e for e in build_timeline(run).events if e["kind"] == "signal"]
    assert len(sig) == 1, sig
    assert sig[0]["frame"].startswith(f"{EXPECTED[where]} ({script}:"), (sig[0]["frame"], dump)
    assert (sig[0]["step"], sig[0]["phase"]) == STEP_AND_PHASE[where], (sig[0], dump)


def test_a_dump_without_thread_headers_and_one_of_library_frames_only():
    one = ('Fatal Python error: Aborted\n\nStack (most recent call first):\n'
           '  File "/t/a.py", line 3 in f\n')
    assert top_frame(one) == "f (/t/a.py:3)"
    lib = ('Current thread 0x1 (most recent call first):\n'
           '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n')
    assert top_frame(lib) == "wait (/usr/lib/python3.11/threading.py:331)"
    own_only = ('Current thread 0x1 (most recent call first):\n'
                f'  File "{Path(__file__).parents[2]}/ddpmon/agent/watchdog.py", line 9 in run\n')
    assert top_frame(own_only).startswith("run (")
