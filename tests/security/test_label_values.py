"""Run ids and labels that are not safe to print or serve (issue 51, findings 4 and 9): a run id
with ESC (later rendered through ``{{ $labels.run }}`` onto a terminal) or with a byte that is
not UTF-8 (``DDPMON_RUN_ID=$'run\\xff'``: every scrape of that rank answered 500 and ``report``
exited 1) is refused at ``attach``, from each source of a run id and of the node label. Each
refusal disables the agent with one clear message, and training goes on. One real process,
started with the non-UTF-8 byte in its environment; the other cases set ``os.environ`` in it
(the same strings Python makes of a real environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TRAIN = r"""
import json, logging, os, sys
import torch, ddpmon

messages = []
class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("ddpmon").addHandler(Keep())

def train(case=None):
    if case is not None:
        for key in [k for k in os.environ if k.startswith(("DDPMON_", "TORCHELASTIC_"))]:
            del os.environ[key]
        os.environ.update(case)
    messages.clear()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ddpmon.attach(model, opt, port=0, run_dir=sys.argv[1])
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    disabled = [m for m in messages if "ddpmon disabled" in m]
    mon.close()
    return {"enabled": mon.enabled, "disabled": disabled}

results = [train()]  # the environment as started: DDPMON_RUN_ID=b"run\xff"
results += [train(case) for case in json.loads(sys.argv[2])]
print(json.dumps(results, ensure_ascii=True))
"""

CASES = [
    ({"DDPMON_RUN_ID": "run\x1b]52;c;cm0=\x07"}, "must not contain control characters"),
    ({"DDPMON_RUN_ID": "r\u202eok"}, "must not contain control characters"),
    ({"DDPMON_NODE": "n\x1b[2J"}, "node='n\\x1b[2J': must not contain control"),
    ({"TORCHELASTIC_RUN_ID": "r\x1b[2J"},
     "TORCHELASTIC_RUN_ID (the run id) 'r\\x1b[2J': must not contain control"),
    ({"TORCHELASTIC_RUN_ID": "r\udcfe"}, "is not valid UTF-8"),
]


def test_attach_refuses_run_ids_and_labels_it_could_not_print_or_serve(tmp_path):
    env = {k: v for k, v in os.environb.items()
           if not k.startswith((b"DDPMON_", b"TORCHELASTIC_", b"SLURM"))}
    env[b"DDPMON_RUN_ID"] = b"run\xff"  # as a shell's $'run\xff' sets it
    cases = json.dumps([case for case, _ in CASES])  # JSON escapes keep the surrogates
    done = subprocess.run([sys.executable, "-c", TRAIN, str(tmp_path), cases], env=env,
                          capture_output=True, timeout=120)
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 0, err
    results = json.loads(done.stdout)
    whys = ["run_id='run\\udcff': is not valid UTF-8", *(why for _, why in CASES)]
    for (case, why), result in zip([({}, whys[0]), *CASES], results, strict=True):
        assert result["enabled"] is False, (case, result)  # the agent is off, training ran
        assert len(result["disabled"]) == 1 and why in result["disabled"][0], (case, result)
    assert "\x1b" not in err and "\u202e" not in err, err  # nothing raw reached the terminal
    assert not any(tmp_path.iterdir())  # no run dir was made under a bad name


def test_a_plain_run_id_still_attaches(tmp_path):
    cases = json.dumps([{"DDPMON_RUN_ID": "run-ünïcode.1"}])
    done = subprocess.run([sys.executable, "-c", TRAIN, str(tmp_path), cases],
                          capture_output=True, timeout=120)
    results = json.loads(done.stdout)
    assert results[1] == {"enabled": True, "disabled": []}, done.stderr.decode()
    assert (tmp_path / "run-ünïcode.1").is_dir()
