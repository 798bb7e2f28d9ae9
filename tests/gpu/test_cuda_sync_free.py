"""GPU-only: the agent's hot path makes no GPU->CPU sync, and NVML values appear.

Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest -q tests/gpu``. These tests never stand in for the CPU tests of a feature.
"""

import threading
import urllib.request

import pytest
import torch
from torch import nn

import ddpmon
from tests.support.ports import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_model():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), nn.Linear(256, 256)
    ).cuda()


def scraper(port, stop, bodies):
    while not stop.is_set():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            bodies.append(r.read().decode())


@pytest.mark.parametrize("use_scaler", [False, True])
def test_fifty_steps_without_a_sync_under_concurrent_scrapes(tmp_path, use_scaler):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    scaler = torch.amp.GradScaler("cuda") if use_scaler else None
    port = free_port()
    mon = ddpmon.attach(model, opt, scaler, port=port, bind="127.0.0.1", run_dir=str(tmp_path))
    x = torch.randn(8, 64, 256, device="cuda")
    for _ in range(3):  # warm-up outside the checked region (allocator, cuBLAS handles)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    stop, bodies = threading.Event(), []
    thread = threading.Thread(target=scraper, args=(port, stop, bodies), daemon=True)
    thread.start()
    try:
        for _ in range(50):
            torch.cuda.set_sync_debug_mode("error")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            mon.observe_loss(loss)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                torch.cuda.set_sync_debug_mode("default")  # GradScaler.step itself syncs
                scaler.step(opt)
                torch.cuda.set_sync_debug_mode("error")
                scaler.update()
            opt.zero_grad()
            torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.cuda.set_sync_debug_mode("default")
        stop.set()
        thread.join(10)
        mon.close()
    assert bodies, "no scrape completed"
    assert mon.state.steps_total == 53
    assert sum(mon.state.agent_errors.values()) == 0, mon.state.agent_errors
    last = bodies[-1]
    assert "ddpmon_grad_norm{" in last and "ddpmon_cuda_memory_allocated_bytes{" in last


def test_nvml_values_appear(tmp_path):
    pytest.importorskip("pynvml")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    port = free_port()
    mon = ddpmon.attach(model, opt, port=port, bind="127.0.0.1", run_dir=str(tmp_path))
    try:
        model(torch.randn(2, 8, 256, device="cuda")).sum().backward()
        opt.step()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        mon.close()
    assert 'ddpmon_collector_success{collector="nvml"' in text
    assert "ddpmon_gpu_memory_used_bytes{" in text and "ddpmon_gpu_power_watts{" in text
    assert 'gpu_uuid="GPU-' in text
