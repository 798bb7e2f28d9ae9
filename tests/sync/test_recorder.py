"""``SyncAudit`` itself, in one process: what it counts as a host sync, what not, and on which
side (training or ddpmon's own threads)."""

from __future__ import annotations

import threading

import torch

from tests.support.sync_audit import SyncAudit, added_ops


def _audited(body) -> dict:
    with SyncAudit() as audit:
        audit.recording = True
        body()
    return audit.report()


def test_host_reads_and_data_dependent_ops_are_counted():
    t = torch.arange(6.0)

    def body():
        t.sum().item()
        bool(t[0] > 1)
        float(t.max())
        t.nonzero()
        t[t > 2]
        torch.unique(t)
        t.tolist()
        t.numpy()
        t.cpu()
        t.to("cpu")
        torch.tensor([1.0], device="cpu")

    counts = _audited(body)["training"]
    assert counts["aten._local_scalar_dense"] == 3
    assert counts["aten.nonzero"] >= 1 and counts["aten.index[bool mask]"] == 1
    assert counts["aten._unique2"] + counts.get("aten._unique", 0) >= 1
    for name in ("Tensor.tolist", "Tensor.numpy", "Tensor.cpu", "Tensor.to(cpu)",
                 "torch.tensor(device=...)"):
        assert counts[name] == 1, (name, counts)


def test_device_side_work_is_not_counted():
    t = torch.randn(8)

    def body():
        n = torch.linalg.vector_norm(t)
        torch.where(torch.isfinite(n), n, torch.zeros_like(n))
        t.to(torch.float64, non_blocking=True)
        t.to(t.device)  # a device object: the tensor's own device on a GPU
        torch._foreach_norm([t, t])
        t[torch.tensor([0, 2])]  # integer indices: no size from the data

    assert _audited(body)["training"] == {}


def test_ddpmon_threads_are_listed_apart_and_the_window_is_respected():
    t = torch.ones(3)
    with SyncAudit() as audit:
        t.sum().item()  # before the window
        audit.recording = True
        worker = threading.Thread(target=lambda: (t.tolist(), t.sum().item()),
                                  name="ddpmon-records")
        worker.start()
        worker.join()
        other = threading.Thread(target=lambda: bool(t.sum() > 0), name="gloo-callback")
        other.start()
        other.join()
        audit.recording = False
        t.sum().item()  # after it
    report = audit.report()
    assert report["ddpmon_threads"] == {"Tensor.tolist": 1, "Tensor.item": 1}
    assert report["training"] == {"Tensor.__bool__": 1}


def test_wrappers_are_removed_on_exit():
    before = (torch.Tensor.tolist, torch.Tensor.to, torch.tensor)
    with SyncAudit():
        assert torch.Tensor.tolist is not before[0]
    assert (torch.Tensor.tolist, torch.Tensor.to, torch.tensor) == before


def test_added_ops_is_the_positive_difference():
    assert added_ops({"a": 3, "b": 1, "c": 2}, {"a": 3, "b": 2}) == {"c": 2}
