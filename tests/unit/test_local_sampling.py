"""The one local-norm sampler the DDP and FSDP2 sources share."""

import torch

from ddpmon.strategies.local_sampling import LocalNormSampler


def test_cpu_takes_every_nth_step_and_accelerators_every_step():
    sampler = LocalNormSampler(every=3)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU
    due_cpu, due_gpu = [], []
    for _ in range(7):
        due_cpu.append(sampler.due(cpu))
        due_gpu.append(sampler.due(gpu))
        sampler.step_done()
    assert due_cpu == [True, False, False, True, False, False, True]
    assert all(due_gpu)
    assert sampler.steps == 7


def test_every_below_one_means_every_step():
    sampler = LocalNormSampler(every=0)
    assert sampler.every == 1 and sampler.due(torch.device("cpu"))
