"""``host_reads``: the one decision "is a host read free on this device", and
``DDPMON_SYNC_AUDIT`` turning the CPU's shortcuts off so that the accelerator's branches run."""

from __future__ import annotations

import pytest
import torch

from ddpmon import host_reads
from ddpmon.agent.readback import Readback
from ddpmon.strategies.local_sampling import LocalNormSampler

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def audit(monkeypatch):
    """``DDPMON_SYNC_AUDIT=1`` for one test, read again before and after it."""
    monkeypatch.setenv(host_reads.SYNC_AUDIT_ENV, "1")
    assert host_reads.reread_env()
    yield
    monkeypatch.delenv(host_reads.SYNC_AUDIT_ENV)
    assert not host_reads.reread_env()


def test_only_the_cpu_reads_for_free(monkeypatch):
    monkeypatch.delenv(host_reads.SYNC_AUDIT_ENV, raising=False)
    assert not host_reads.reread_env()
    assert host_reads.host_read_free(CPU)
    assert not host_reads.host_read_free(CUDA)
    assert not host_reads.host_read_free(torch.device("meta"))
    assert host_reads.host_read_free_all([torch.ones(1), None])


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_other_values_leave_the_shortcuts_on(monkeypatch, value):
    monkeypatch.setenv(host_reads.SYNC_AUDIT_ENV, value)
    assert not host_reads.reread_env()
    assert host_reads.host_read_free(CPU)
    monkeypatch.delenv(host_reads.SYNC_AUDIT_ENV)
    host_reads.reread_env()


def test_the_audit_takes_the_accelerators_branches_on_the_cpu(audit):
    assert host_reads.sync_audit()
    assert not host_reads.host_read_free(CPU)
    assert not host_reads.host_read_free_all([torch.ones(1)])
    sampler = LocalNormSampler(10)
    for _ in range(3):  # the local pass every step, as on a GPU
        assert sampler.due(CPU)
        sampler.step_done()


def test_the_cpu_shortcut_samples_local_passes(monkeypatch):
    monkeypatch.delenv(host_reads.SYNC_AUDIT_ENV, raising=False)
    host_reads.reread_env()
    sampler = LocalNormSampler(10)
    due = []
    for _ in range(12):
        due.append(sampler.due(CPU))
        sampler.step_done()
    assert due.count(True) == 2


def test_readback_packs_and_copies_under_the_audit(audit):
    """The step's slots are packed into one float64 vector and copied non-blocking (the CUDA
    path, with no event on the CPU), and read back with the same values."""
    rb = Readback()
    rb.push({"loss": torch.tensor([2.5]), "reduced_norms": torch.tensor([3.0, 4.0])}, "meta")
    pending = rb._pending[0]
    assert pending[2] is not None  # packed: a key, not CPU tensors queued as they are
    (arrived,) = rb.poll()
    assert arrived.parts() == {"reduced_norms": [3.0, 4.0], "loss": [2.5]}
