"""Dense peak FLOP/s of known accelerators by dtype, from the vendors' datasheets (without
structured sparsity; the figures the datasheets mark "with sparsity" are halved here).

Sources:
- NVIDIA H100 Tensor Core GPU datasheet (SXM5 and PCIe columns), nvidia.com/en-us/data-center/h100
- NVIDIA H200 Tensor Core GPU datasheet (SXM column), nvidia.com/en-us/data-center/h200
- NVIDIA A100 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/a100
- NVIDIA DGX B200 datasheet (8-GPU figures divided by 8),
  nvidia.com/en-us/data-center/dgx-b200
- AMD Instinct MI300X accelerator datasheet,
  amd.com/en/products/accelerators/instinct/mi300/mi300x
"""

from __future__ import annotations

from dataclasses import dataclass

T = 1e12


@dataclass(frozen=True, slots=True)
class Peak:
    device: str
    match: tuple[str, ...]
    """Lower-case substrings of ``torch.cuda.get_device_name()`` that name this device (all
    must be present)."""
    flops: dict[str, float]
    """dtype (``bf16``, ``fp16``, ``fp8``, ``tf32``, ``fp32``) -> dense peak FLOP/s."""
    source: str


PEAKS: tuple[Peak, ...] = (
    Peak("H100 SXM", ("h100", "hbm3"), {"fp8": 1978.9 * T, "bf16": 989.4 * T, "fp16": 989.4 * T,
                                       "tf32": 494.7 * T, "fp32": 66.9 * T},
         "NVIDIA H100 datasheet, SXM5"),
    Peak("H100 PCIe", ("h100", "pcie"), {"fp8": 1513 * T, "bf16": 756 * T, "fp16": 756 * T,
                                        "tf32": 378 * T, "fp32": 51.2 * T},
         "NVIDIA H100 datasheet, PCIe"),
    Peak("H200", ("h200",), {"fp8": 1978.9 * T, "bf16": 989.4 * T, "fp16": 989.4 * T,
                             "tf32": 494.7 * T, "fp32": 66.9 * T},
         "NVIDIA H200 datasheet, SXM"),
    Peak("A100", ("a100",), {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T,
                             "fp32": 19.5 * T},
         "NVIDIA A100 datasheet"),
    Peak("B200", ("b200",), {"fp8": 4500 * T, "bf16": 2250 * T, "fp16": 2250 * T,
                             "tf32": 1100 * T, "fp32": 75 * T},
         "NVIDIA DGX B200 datasheet, per GPU"),
    Peak("MI300X", ("mi300x",), {"fp8": 2614.9 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T,
                                 "tf32": 653.7 * T, "fp32": 163.4 * T},
         "AMD Instinct MI300X datasheet"),
)

DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8",
          "float8_e5m2": "fp8", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "tf32": "tf32",
          "fp8": "fp8"}


def lookup(device_name: str, dtype: str) -> tuple[float, Peak] | None:
    """The dense peak FLOP/s of ``device_name`` in ``dtype`` (``bf16``, ``torch.bfloat16``...),
    and its table entry; None for a device or dtype the table does not know."""
    name = device_name.lower()
    key = DTYPES.get(str(dtype).removeprefix("torch."))
    for p in PEAKS:
        if all(m in name for m in p.match) and key in p.flops:
            return p.flops[key], p
    return None


def dtype_of_precision(precision: str | None) -> str | None:
    """The compute dtype of ddpmon's precision label (``amp-bf16+gradscaler`` -> ``bf16``)."""
    if not precision:
        return None
    core = precision.removeprefix("deepspeed-").removeprefix("amp-").split("+")[0]
    return DTYPES.get(core)
