"""Exceptions read for what they mean (``ddpmon.forensics.exceptions``), from real exceptions
raised by torch, Lightning Fabric and a DataLoader, formatted as the crash capture writes them."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ddpmon.forensics.exceptions import read_exception, user_frame
from ddpmon.forensics.failure import first_failure, read_exits


def caught(fn) -> tuple[str, str, str]:
    """(type name, message, traceback) as ``CrashCapture`` writes them to the exit event."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 (the point is to catch anything)
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return type(exc).__name__, str(exc)[:2000], text[-20000:]
    raise AssertionError("nothing raised")


def nan_grads() -> torch.nn.Module:
    model = torch.nn.Linear(4, 1)
    model(torch.tensor([[1.0, float("nan"), 0.0, 0.0]])).sum().backward()
    return model


def test_torch_clip_error_is_numerics():
    model = nan_grads()
    got = caught(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0,
                                                        error_if_nonfinite=True))
    assert read_exception(*got) == {"cause": "numerics"}


def test_fabric_clip_error_is_numerics():
    import lightning

    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    linear = torch.nn.Linear(4, 1)
    model, opt = fabric.setup(linear, torch.optim.SGD(linear.parameters(), lr=0.1))
    fabric.backward(model(torch.tensor([[1.0, float("nan"), 0.0, 0.0]])).sum())
    got = caught(lambda: fabric.clip_gradients(model, opt, max_norm=1.0))
    assert "non-finite" in got[1]
    assert read_exception(*got) == {"cause": "numerics"}


@pytest.mark.filterwarnings("ignore:Error detected in")
def test_anomaly_detection_names_the_backward_function():
    def run():
        with torch.autograd.detect_anomaly(check_nan=True):
            x = torch.tensor([0.0], requires_grad=True)
            (x / x).sum().backward()

    got = caught(run)
    read = read_exception(*got)
    assert read["cause"] == "numerics" and read["tensor"] == "DivBackward0", (got[1], read)


def test_loss_guard_is_numerics():
    def guard():
        loss = torch.tensor(float("nan"))
        if not torch.isfinite(loss):
            raise RuntimeError(f"Loss is {loss.item()}, stopping training")

    assert read_exception(*caught(guard)) == {"cause": "numerics"}


def test_out_of_memory_is_memory():
    got = caught(lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory.")))
    assert read_exception(*got) == {"cause": "memory"}
    assert read_exception("RuntimeError", "CUDA error: out of memory", "")["cause"] == "memory"


class Broken(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        raise ValueError(f"corrupt sample {i}")  # THE-FRAME


def the_line() -> int:
    return next(i for i, line in enumerate(open(__file__).read().splitlines(), 1)
                if "# THE-FRAME" in line and "raise" in line)


@pytest.mark.parametrize("workers", [0, 1])
def test_dataset_error_is_data_with_the_datasets_frame(workers):
    got = caught(lambda: next(iter(DataLoader(Broken(), batch_size=2, num_workers=workers))))
    read = read_exception(*got)
    assert read == {"cause": "data", "frame": f"__getitem__ ({__file__}:{the_line()})"}, got


def test_collate_error_is_data():
    def collate(batch):
        raise TypeError("cannot stack ragged samples")

    got = caught(lambda: next(iter(DataLoader(list(range(4)), batch_size=2, collate_fn=collate))))
    assert read_exception(*got)["cause"] == "data"
    assert read_exception(*got)["frame"].startswith("collate (")


def test_gloo_error_is_communication():
    message = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:21422")
    assert read_exception("RuntimeError", message, "")["cause"] == "communication"
    assert read_exception("DistBackendError", "NCCL watchdog", "")["cause"] == "communication"


def test_anything_else_is_process_and_damage_is_tolerated():
    assert read_exception("KeyError", "'lr'", "")["cause"] == "process"
    assert read_exception(None, 3, ["x"]) == {"cause": "process"}
    assert user_frame("no frames here") is None


def event(rank, t, **fields):
    return {"rank": rank, "t": t, "ts": t, "attempt": 0, **fields}


def test_the_first_failure_is_chosen_by_evidence_not_by_which_exception_came_first():
    clip = ("The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
            "cannot be clipped.")
    events = [
        event(0, 1.0, kind="nonfinite", step=10, param="w", origin=False, where="reduced",
              running=True),
        event(0, 1.1, kind="exit", reason="exception", step=10, exc_type="RuntimeError",
              message=clip, running=True),
        event(1, 1.5, kind="nonfinite", step=10, param="w", origin=True, running=True),
        event(1, 1.6, kind="exit", reason="exception", step=10, exc_type="RuntimeError",
              message=clip, running=True),
    ]
    read_exits(events)
    ff = first_failure(events, {})
    assert (ff["rank"], ff["kind"], ff["step"]) == (1, "nonfinite", 10), ff
    # without rank 1's evidence, rank 0's own gradients were still finite: it reacted
    ff = first_failure([e for e in events if not (e["kind"] == "nonfinite" and e["rank"] == 1)],
                       {})
    assert (ff["rank"], ff["kind"], ff["cause"]) == (1, "exit", "numerics"), ff


def test_a_sigterm_comes_before_the_peer_error_it_caused():
    events = [
        event(0, 1.0, kind="exit", reason="exception", step=10, exc_type="RuntimeError",
              message="Connection closed by peer"),
        event(1, 1.2, kind="signal", signal="SIGTERM", step=10, running=True),
    ]
    read_exits(events)
    ff = first_failure(events, {})
    assert (ff["rank"], ff["kind"]) == (1, "signal"), ff


def test_a_cause_claimed_by_the_file_is_replaced_by_what_the_exception_says():
    events = [event(1, 1.0, kind="exit", reason="exception", step=10, exc_type="RuntimeError",
                    message="Connection closed by peer", cause="numerics",
                    frame="__getitem__ (/etc/passwd:1)")]
    read_exits(events)
    assert events[0]["cause"] == "communication" and "frame" not in events[0]
    assert first_failure(events, {})["class"] == "consequence"


def test_the_daemons_job_outcome_orders_by_the_same_evidence(tmp_path):
    """The node daemon's job record names the same first failure as the timeline."""
    import json as _json

    from ddpmon.daemon import outcome

    clip = "The total norm of order 2.0 for gradients from `parameters` is non-finite"
    logs = {
        0: [{"ts": 1.0, "rank": 0, "step": 10, "kind": "nonfinite", "param": "w",
             "origin": False, "where": "reduced", "running": True},
            {"ts": 1.1, "rank": 0, "step": 10, "kind": "exit", "reason": "exception", "code": 1,
             "exc_type": "RuntimeError", "message": clip, "running": True}],
        1: [{"ts": 1.5, "rank": 1, "step": 10, "kind": "nonfinite", "param": "w",
             "origin": True, "running": True},
            {"ts": 1.6, "rank": 1, "step": 10, "kind": "exit", "reason": "exception", "code": 1,
             "exc_type": "RuntimeError", "message": clip, "running": True}],
    }
    for rank, events in logs.items():
        (tmp_path / f"events.rank{rank}.jsonl").write_text(
            "".join(_json.dumps(e) + "\n" for e in events))
    ff = outcome.first_failure(outcome.event_failures(tmp_path))
    assert (ff["rank"], ff["kind"], ff["step"]) == (1, "nonfinite", 10), ff
