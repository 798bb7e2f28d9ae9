"""The alert contract of docs/alerts.md, copied by hand so a rename in the generator cannot pass."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"

CONTRACT_ALERTS = {
    "DdpmonLossScaleAtFloor": "critical",
    "DdpmonLossScaleCollapsing": "warning",
    "DdpmonNonFiniteGradients": "critical",
    "DdpmonNonFiniteLoss": "critical",
    "DdpmonGradNormSpike": "warning",
    "DdpmonLossSpike": "critical",
    "DdpmonGradDesync": "critical",
    # Added with the agent's identical-batch check.
    "DdpmonDuplicateDataShards": "warning",
    "DdpmonTrainingStalled": "critical",
    # Issue 48: the rank the others wait for, named live.
    "DdpmonHangHolder": "critical",
    "DdpmonCollectiveMismatch": "critical",
    "DdpmonRankDown": "critical",
    "DdpmonRanksMissing": "critical",
    "DdpmonRankDesync": "warning",
    "DdpmonStraggler": "warning",
    "DdpmonCollectiveSlow": "warning",
    "DdpmonGpuMemoryNearlyFull": "warning",
    # Issue 15: an OOM is critical; retries are their own warning.
    "DdpmonCudaOOM": "critical",
    "DdpmonCudaAllocRetries": "warning",
    # Issue 15: data starvation, no first step, the agent's own health; the integrations
    # issue's norm cross-check.
    "DdpmonDataStarved": "warning",
    "DdpmonNoFirstStep": "warning",
    "DdpmonAgentUnhealthy": "warning",
    "DdpmonGradNormMismatch": "warning",
    # Issue 33: replica checksums.
    "DdpmonReplicaDiverged": "critical",
    # Issue 16: checkpoints.
    "DdpmonCheckpointStale": "warning",
    "DdpmonCheckpointSlow": "warning",
    # Issue 50: goodput.
    "DdpmonGoodputLow": "warning",
}
"""Alert name -> severity."""
