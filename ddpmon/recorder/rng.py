"""RNG seeds and fingerprints (torch CPU/CUDA, Python ``random``, NumPy) for manifest and evidence.

A fingerprint is a short SHA-256 of the generator state: equal fingerprints across two runs (or
two ranks that should agree) mean equal streams, without storing megabytes of state in JSON.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import sys
from typing import Any


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def rng_fingerprints() -> dict[str, Any]:
    """Seeds where known and state fingerprints of every generator that is loaded."""
    out: dict[str, Any] = {}
    try:
        out["python_random"] = _digest(pickle.dumps(random.getstate()))
    except Exception as exc:
        out["python_random_error"] = str(exc)
    try:
        import torch  # torch-free start of the CLI and the daemon

        out["torch_initial_seed"] = int(torch.initial_seed())
        out["torch_cpu"] = _digest(torch.get_rng_state().numpy().tobytes())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["torch_cuda"] = [
                _digest(s.cpu().numpy().tobytes()) for s in torch.cuda.get_rng_state_all()
            ]
    except Exception as exc:
        out["torch_error"] = str(exc)
    numpy = sys.modules.get("numpy")  # only if the program uses it; never import it for this
    if numpy is not None:
        try:
            state = numpy.random.get_state()
            out["numpy_legacy"] = _digest(state[1].tobytes() + repr(state[2:]).encode())
        except Exception as exc:
            out["numpy_error"] = str(exc)
    return out


def rng_states() -> dict[str, Any]:
    """Full generator states (for ``torch.save``), to replay the failing step's randomness."""
    out: dict[str, Any] = {}
    try:
        out["python_random"] = random.getstate()
        import torch  # torch-free start of the CLI and the daemon

        out["torch_cpu"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["torch_cuda"] = torch.cuda.get_rng_state_all()
    except Exception:
        pass
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            out["numpy_legacy"] = numpy.random.get_state()
        except Exception:
            pass
    return out
