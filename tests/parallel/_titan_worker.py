"""One rank of torchtitan's real ``Trainer`` (0.3.0, the llama3 debug model) on CPU, with the one
attach line a torchtitan user writes at the end of ``Trainer.__init__``. Writes what it saw to
--out; the assertions live in tests/parallel/test_torchtitan.py.

The trainer is torchtitan's own, changed only by the patches marked ``CPU PATCH`` below (each is
torchtitan's or torch's, none is ddpmon's) and by a tiny tokenizer and corpus this script makes
(no download). Per step the harness keeps an fp64 reference of the global norm from the full
gradients (``.full_tensor()`` in float64, after backward, before the clip and the optimizer
step) and the loss the trainer's forward returned (a DTensor under TP); on the step asked for, one
rank puts a NaN into the gradient of one layer's output.

Run as: ``python _titan_worker.py --out DIR --mode fsdp|tp --steps N --nan-step S --nan-rank R
--nan-layer L`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (tests/support/ranks.py),
2 ranks.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import sys
import types
from pathlib import Path

import torch
import torch._utils


def _stub_triton_kernels() -> None:
    """CPU PATCH 0 (torchtitan): torchtitan 0.3.0 imports its GPU expert-parallel kernels
    (``minimal_async_ep.kernels``, written in triton) whenever a model is imported; a CPU
    machine has no triton. Those kernels never run here (no MoE, no EP): stand in for the
    module, each kernel a function that says so."""
    if importlib.util.find_spec("triton") is not None:
        return
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def missing(*_a, **_k):
        raise RuntimeError("triton kernels are not available on this CPU test machine")

    stub.__file__ = __file__

    def kernel(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return missing

    stub.__getattr__ = kernel  # type: ignore[method-assign]
    sys.modules[name] = stub


_stub_triton_kernels()

# CPU PATCH 1 (torchtitan): its device type is read once at import, from the accelerator found
# ("cuda" when there is none); say "cpu" before torchtitan is imported.
torch._utils._get_available_device_type = lambda: "cpu"

import torch.distributed as dist  # noqa: E402
from torch.distributed import distributed_c10d  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.components import metrics as titan_metrics  # noqa: E402
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402
from torchtitan.distributed import utils as titan_dist  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models import llama3  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

import ddpmon  # noqa: E402
from tests.parallel._worker import destroy_process_group_now  # noqa: E402


class _CPUMemoryMonitor:
    """CPU PATCH 4 (torchtitan): its memory monitor asks the device module for a name, a
    capacity and peak statistics, which torch.cpu does not have; report none."""

    device_name = "cpu"
    device_capacity_gib = 0.0

    def get_peak_stats(self):
        return titan_metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


titan_metrics.build_device_memory_monitor = _CPUMemoryMonitor


def _set_pg_timeouts(timeout, parallel_dims) -> None:
    """CPU PATCH 2 (torchtitan, torch): after the first step torchtitan shortens every group's
    timeout: a barrier with ``device_ids=[device_module.current_device()]`` (on CPU the string
    "cpu", which the barrier refuses), then ``torch.distributed.set_timeout``, which this torch
    names ``_set_pg_timeout``. The same, on CPU."""
    dist.barrier()
    groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, None]:
        distributed_c10d._set_pg_timeout(timeout, group)


titan_dist.set_pg_timeouts = _set_pg_timeouts

SEQ_LEN = 32
WORDS = [f"w{i}" for i in range(200)]


def tiny_assets(folder: Path) -> tuple[Path, Path]:
    """A word-level tokenizer (tokenizer.json + tokenizer_config.json) and a small json corpus,
    made here: the test machine downloads nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokens = ["<unk>", "<s>", "</s>", *WORDS]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assets = folder / "tokenizer"
    assets.mkdir(parents=True, exist_ok=True)
    tok.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    corpus = folder / "corpus"
    corpus.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    with (corpus / "train.json").open("w") as f:
        for _ in range(256):
            ids = torch.randint(len(WORDS), (48,), generator=gen).tolist()
            f.write(json.dumps({"text": " ".join(WORDS[i] for i in ids)}) + "\n")
    return assets, corpus


def config(mode: str, folder: Path, steps: int) -> Trainer.Config:
    """torchtitan's llama3 debug config, shortened (few steps, short sequences, no checkpoint,
    no validation), on the tiny assets."""
    assets, corpus = tiny_assets(folder)
    cfg = llama3_debugmodel()
    # CPU PATCH 3 (torchtitan): SDPA in place of FlexAttention, which has no CPU backward
    # (torchtitan 0.3.0 keeps SDPA but refuses it by name for language models; causal SDPA is
    # the same attention for these unpacked sequences).
    original = llama3.get_attention_config
    llama3.get_attention_config = lambda backend: (
        ScaledDotProductAttention.Config() if backend == "sdpa" else original(backend)
    )
    cfg.model_spec = model_registry("debugmodel", attn_backend="sdpa")
    cfg.loss = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(cfg.model_spec))
    )
    cfg.hf_assets_path = str(assets)
    cfg.dump_folder = str(folder / "outputs")
    cfg.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(corpus))
    cfg.training.steps = steps
    cfg.training.seq_len = SEQ_LEN
    cfg.training.local_batch_size = 2
    cfg.checkpoint.enable = False
    cfg.validator.enable = False
    cfg.metrics.log_freq = 1
    cfg.debug.seed = 0
    # torchtitan's classic path: DTensor for the model-parallel axes, fully_shard on its dp mesh
    # (size 1 beside TP). Its default, spmd_types, wants every parameter a DTensor on the whole
    # mesh and does not get there on CPU.
    cfg.parallelism.spmd_backend = "partial_dtensor"
    if mode == "tp":
        cfg.parallelism.data_parallel_shard_degree = 1
        cfg.parallelism.tensor_parallel_degree = 2
    else:
        cfg.parallelism.data_parallel_shard_degree = 2
    return cfg


def full_norm64(params) -> float:
    """The global gradient norm in float64 from the full gradients (a collective per DTensor:
    the harness's reference, every rank calls it in the same order)."""
    total = 0.0
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        total += float(g.double().pow(2).sum())
    return math.sqrt(total)


class MonitoredTrainer(Trainer):
    """torchtitan's Trainer with the attach line at the end of ``__init__``; the rest is the
    harness's (references, the loss handed over, the NaN)."""

    def __init__(self, config: Trainer.Config, run_dir: str, nan: tuple[int, int, str]) -> None:
        super().__init__(config)
        # CPU PATCH 5 (torchtitan): it sets FSDP's gradient divide factor (its loss is already
        # divided by the global token count), which FSDP reduces with PREMUL_SUM, an op gloo
        # lacks; a plain SUM then the scaling is the same sum.
        for module in self.model_parts[0].modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        # --- the user's one line (docs/integrations.md, torchtitan) ---
        self.mon = ddpmon.attach(self.model_parts[0], self.optimizers, run_dir=run_dir, port=0)
        # --- the harness ---
        self.references: list[float] = []
        self.losses: list[float] = []
        self.loss_types: list[str] = []
        self.loss_placements: list[list[str]] = []
        self._install_nan(*nan)

    def _install_nan(self, nan_step: int, nan_rank: int, nan_layer: str) -> None:
        """On step ``nan_step`` (0-based; torchtitan counts from 1) rank ``nan_rank`` puts a
        NaN into the gradient of ``nan_layer``'s output."""
        layer = self.model_parts[0].get_submodule(nan_layer)

        def poison(module, args, output):
            if self.step - 1 == nan_step and dist.get_rank() == nan_rank and output.requires_grad:
                output.register_hook(lambda g: torch.full_like(g, math.nan))

        layer.register_forward_hook(poison)

    def forward_backward_step(self, *args, **kwargs):
        loss = super().forward_backward_step(*args, **kwargs)
        self.mon.observe_loss(loss)  # a DTensor under TP
        self.loss_types.append(type(loss).__name__)
        self.loss_placements.append([str(p) for p in getattr(loss, "placements", ())])
        value = loss.detach()
        self.losses.append(float(value.full_tensor() if hasattr(value, "full_tensor") else value))
        self.references.append(full_norm64(self.model_parts[0].parameters()))
        return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("fsdp", "tp"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--nan-step", type=int, required=True)
    parser.add_argument("--nan-rank", type=int, required=True)
    parser.add_argument("--nan-layer", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    folder = out / f"work{rank}"
    os.environ["HF_HOME"] = str(folder / "hf")  # the corpus's cache stays in the test's folder
    trainer = MonitoredTrainer(
        config(args.mode, folder, args.steps), str(out / "run"),
        (args.nan_step, args.nan_rank, args.nan_layer),
    )
    error = None
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - the trainer's own stop is reported, not hidden
        error = f"{type(exc).__name__}: {exc}"
    mon = trainer.mon
    records = mon.recent_steps()
    result = {
        "rank": rank,
        "mode": args.mode,
        "enabled": mon.enabled,
        "strategy": getattr(mon, "strategy", None),
        "error": error,
        "references": trainer.references,
        "losses": trainer.losses,
        "loss_types": trainer.loss_types,
        "loss_placements": trainer.loss_placements,
        "errors": {k: v for k, v in mon.state.agent_errors.items() if v},
        "steps": [
            {
                "step": r.step,
                "grad_norm": r.grad_norm,
                "grad_local_norm": r.grad_local_norm,
                "loss": r.loss,
                "origin": r.origin,
                "grad_nonfinite_param": r.grad_nonfinite_param,
                "local_nonfinite_param": r.local_nonfinite_param,
                "entry_block": r.entry_block,
            }
            for r in records
        ],
    }
    result["precision"] = mon.state.precision
    mon.close()
    manifests = sorted((out / "run").glob("*/manifest.json"))  # rank 0 writes the run's
    result["manifest"] = json.loads(manifests[0].read_text()) if manifests else None
    trainer.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_seconds"] = usage.ru_utime + usage.ru_stime
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    del trainer, mon
    destroy_process_group_now()


if __name__ == "__main__":
    main()
