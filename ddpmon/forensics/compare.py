"""Compare the numerics of two runs step by step: where do they first part, and in which group?

The standard way to debug distributed numerics is a single-card baseline compared with the
multi-card run, step by step and layer by layer, before blaming communication. Runs are aligned
by optimizer step (the ``step`` column of each rank's history). Series compared:

- ``loss``: the mean over ranks of each rank's loss (equal shards: the global-batch loss);
- ``grad_norm`` and ``group:<name>``: reduced (post all-reduce) norms, the same on every rank
  of a data-parallel run, taken from the lowest rank that has the step;
- ``loss_scale`` and ``skipped`` (a GradScaler that skips in one run and not the other).

Tolerance, from the runs themselves: two runs of the same model, data and global batch over a
different number of ranks differ only by reduction order (summing in another order rounds
differently), which shows from the very first step where the CPU's kernels round differently at
all (with AVX-512 ones the demo's 1-rank and 2-rank runs can be bit-identical: noise 0, the
tolerance then ``TOL_FLOOR``). For each series the noise is the largest
relative difference ``|a - b| / max(|a|, |b|)`` over the first ``NOISE_STEPS`` common steps;
the tolerance is ``NOISE_FACTOR`` (100) times that, never below ``TOL_FLOOR`` and never above
``TOL_CAP``. The factor leaves room for the drift: the difference grows as the trajectories part
(over 60 steps of the demo, 1 rank vs 2, up to 12x the first steps' noise), so comparisons are
sharpest over the first hundreds of steps. The bugs this is for are far above it: a rank's
gradients x2 moves the norms by ~34%, a duplicated data shard by 10-30% from its first step.
A series whose first steps already differ by more than the cap is not noise: it diverges at its
first step above the cap. A step diverges when any series exceeds its
tolerance; one non-finite value against a finite one always diverges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..recorder.annotations import load_annotations
from ..recorder.history_read import History, iter_histories
from ..rundir.damage import ReadWarnings
from ..rundir.layout import HISTORY_RE, RunDir
from .run_facts import Resume, load_manifest, ranks_present, resumes
from .step_values import value_series
from .timeline import RunDirError, resolve_run_path
from .update_views import both_sampled, ratio_series

NOISE_STEPS = 8
NOISE_FACTOR = 100.0
TOL_FLOOR = 1e-3
TOL_CAP = 5e-2


class CompareError(Exception):
    """A run cannot be read for comparison; the message says which and why, and ``damaged``
    the damaged files that left nothing to compare."""

    def __init__(self, message: str, damaged: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.damaged = damaged or []


@dataclass(slots=True)
class RunNumerics:
    """What one run contributes: per-step series aligned on ``steps`` plus its facts."""

    path: Path
    steps: np.ndarray
    series: dict[str, np.ndarray]
    groups: list[str]
    facts: dict[str, Any]
    loss_complete: np.ndarray | None = None
    """Per step: every rank of the run contributed a loss (False where a killed rank lost its
    last unflushed rows): the cross-rank mean is comparable only there."""
    ranks_used: list[int] = field(default_factory=list)
    """Ranks whose history the series rest on."""
    ranks_expected: int = 0
    """Ranks the run had: the manifest's world size, else every rank that left any file."""
    damage: ReadWarnings = field(default_factory=ReadWarnings)

    def basis(self) -> dict[str, Any]:
        """What this run's answers rest on: ranks used of the run's, and steps."""
        return {"ranks_used": len(self.ranks_used), "ranks_expected": self.ranks_expected,
                "ranks": self.ranks_used, "steps": int(len(self.steps))}


@dataclass(slots=True)
class SeriesResult:
    name: str
    noise: float
    tolerance: float
    first_step: int | None
    value_a: float | None = None
    value_b: float | None = None
    rel_diff: float | None = None
    max_rel_before: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {k: _clean(getattr(self, k)) for k in self.__slots__}  # type: ignore[attr-defined]


@dataclass(slots=True)
class Comparison:
    run_a: Path
    run_b: Path
    comparable: bool
    reasons: list[str]
    warnings: list[str]
    facts: dict[str, dict[str, Any]]
    common_steps: int
    first_step: int | None
    first_group: str | None
    first_series: list[str] = field(default_factory=list)
    series: list[SeriesResult] = field(default_factory=list)
    basis: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per run (``a``, ``b``): ranks used of the run's, and steps (:meth:`RunNumerics.basis`)."""
    resumes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per run: each resume from a checkpoint (attempt, step, states it did not restore)."""
    damaged: list[dict[str, str]] = field(default_factory=list)
    """Every damaged file of both runs (:class:`~ddpmon.rundir.damage.Damage` records)."""

    @property
    def diverged(self) -> bool:
        return self.first_step is not None

    def basis_line(self) -> str:
        """``A rests on 2 of 2 ranks, 60 steps; B ...; compared on 60 common steps``."""
        parts = [
            f"{tag.upper()} rests on {b['ranks_used']} of {b['ranks_expected']} ranks, "
            f"{b['steps']} steps" for tag, b in self.basis.items() if tag in ("a", "b")
        ]
        return "; ".join(parts) + f"; compared on {self.common_steps} common steps"

    def damage_lines(self) -> list[str]:
        """One line per damaged file, ``run B: history.rank0.arrow: ...`` (also in warnings)."""
        return run_damage_lines(self.damaged)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_a": str(self.run_a),
            "run_b": str(self.run_b),
            "comparable": self.comparable,
            "reasons": self.reasons,
            "warnings": self.warnings,
            "facts": self.facts,
            "common_steps": self.common_steps,
            "basis": self.basis,
            "resumes": self.resumes,
            "damaged": self.damaged,
            "diverged": self.diverged,
            "first_divergent_step": self.first_step,
            "first_divergent_group": self.first_group,
            "first_divergent_series": self.first_series,
            "tolerance": {
                "noise_steps": NOISE_STEPS,
                "noise_factor": NOISE_FACTOR,
                "floor": TOL_FLOOR,
                "cap": TOL_CAP,
            },
            "series": [s.to_json() for s in self.series],
        }


def load_run(path: Path | str) -> RunNumerics:
    """Read a run's histories (one rank at a time) and facts; :class:`CompareError` when no
    rank's history is usable. Damaged files are skipped and named in the result's ``damage``."""

    try:
        run_path = resolve_run(path)
    except RunDirError as exc:
        raise CompareError(str(exc)) from exc
    run = RunDir(run_path)
    damage = ReadWarnings(run_path)
    got = _series(run, damage)
    if got is None:
        if damage.items:
            raise CompareError(
                f"{run_path}: no usable numerics history: " + "; ".join(damage.lines()),
                [d.to_json() for d in damage.items])
        raise CompareError(
            f"{run_path}: no numerics history (history.rank<R>.arrow); was the run made with "
            "pyarrow installed and a writable run dir?"
        )
    steps, series, groups, ranks, complete = got
    facts = run_facts(run_path, len(ranks), damage)
    ws = facts.get("world_size")
    expected = ws if isinstance(ws, int) and ws > 0 else len(ranks_present(run))
    return RunNumerics(
        run_path, steps, series, groups, facts=facts, loss_complete=complete,
        ranks_used=ranks, ranks_expected=max(expected, len(ranks)), damage=damage,
    )


def resolve_run(path: Path | str) -> Path:
    """``path`` when it holds histories (a run dir copied without its event logs still
    compares), else what ``ddpmon timeline`` accepts (a run dir, or a parent of exactly one)."""

    if Path(path).is_dir() and RunDir(Path(path)).ranked(HISTORY_RE):
        return Path(path)
    return resolve_run_path(path)


def _series(
    run: RunDir, damage: ReadWarnings
) -> tuple[np.ndarray, dict[str, np.ndarray], list[str], list[int], np.ndarray] | None:
    """Series on the lowest usable rank's steps: reduced values from that rank, the loss
    averaged over every usable rank (NaN at a step where any rank's loss is not finite).
    Memory: one rank at a time; a damaged rank is skipped and named in ``damage``."""
    first: History | None = None
    total = count = nonfinite = None
    ranks: list[int] = []
    for rank, h in iter_histories(run, damage):
        ranks.append(rank)
        if first is None:
            first = h
            n = len(h.columns["step"])
            total, count, nonfinite = np.zeros(n), np.zeros(n), np.zeros(n, dtype=bool)
        steps = first.columns["step"]
        idx = np.searchsorted(steps, h.columns["step"])
        hit = idx < len(steps)
        hit[hit] = steps[idx[hit]] == h.columns["step"][hit]
        idx, loss = idx[hit], h.columns["loss"][hit]
        ok = np.isfinite(loss)
        np.add.at(total, idx[ok], loss[ok])
        np.add.at(count, idx[ok], 1)
        nonfinite[idx[~ok]] = True
    if first is None:
        return None
    with np.errstate(all="ignore"):
        loss = np.where((count > 0) & ~nonfinite, total / np.maximum(count, 1), np.nan)
    complete = nonfinite | (count == len(ranks))
    c = first.columns
    series = {
        "loss": loss,
        "grad_norm": c["grad_norm"],
        "loss_scale": c["loss_scale"],
        # any skip: the loss scaler's, DeepSpeed's, the loop's or the policy's (older files
        # have no skipped_by column set for a scaler skip, so amp_skipped still counts)
        "skipped": (c["amp_skipped"] | (c["skipped_by"] > 0)).astype(float),
    }
    for g in first.groups:
        series[f"group:{g}"] = first.group(g)
    series.update(ratio_series(first))  # update/weight ratios, sampled steps (update_views)
    series.update(value_series(first))  # declared step fields and per-step metrics
    return c["step"], series, first.groups, ranks, complete


def run_facts(
    run_path: Path, ranks_seen: int, damage: ReadWarnings | None = None
) -> dict[str, Any]:
    """Effective batch, seed and model facts from ``annotations.json`` and ``manifest.json``;
    a damaged file counts as not recorded and is named in ``damage``."""
    damage = damage if damage is not None else ReadWarnings(run_path)
    facts: dict[str, Any] = {"ranks_with_history": ranks_seen}
    manifest = load_manifest(run_path, damage) or {}
    extra = _dict(manifest.get("extra"))
    ws = _dict(manifest.get("topology")).get("world_size")
    facts["world_size"] = ws if isinstance(ws, int) and not isinstance(ws, bool) else None
    facts["precision"] = manifest.get("precision")
    facts["data_version"] = manifest.get("data_version")
    facts["param_count"] = extra.get("param_count")
    facts["group_names"] = extra.get("group_names")
    ann = load_annotations(run_path, damage)
    for key in ("global_batch", "micro_batch", "accumulation", "seed"):
        facts[key] = ann.get(key)
    return facts


def comparability(fa: dict[str, Any], fb: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(reasons the runs are not comparable, warnings)."""
    reasons, warnings = [], []
    for key, label in (
        ("global_batch", "global batch"),
        ("seed", "seed"),
        ("precision", "precision"),
        ("param_count", "parameter count"),
        ("data_version", "data version"),
    ):
        a, b = fa.get(key), fb.get(key)
        if a is None or b is None:
            if key in ("global_batch", "seed"):
                which = "A" if a is None else "B"
                warnings.append(
                    f"{label} not recorded for run {which} (mon.annotate({key}=...)); "
                    "comparability assumed"
                )
        elif a != b:
            reasons.append(f"{label} differs: {a} vs {b}")
    for tag, f in (("A", fa), ("B", fb)):
        parts = [f.get(k) for k in ("micro_batch", "accumulation", "world_size", "global_batch")]
        if all(isinstance(p, int) for p in parts) and parts[0] * parts[1] * parts[2] != parts[3]:
            reasons.append(
                f"run {tag}: micro batch {parts[0]} x accumulation {parts[1]} x world size "
                f"{parts[2]} = {parts[0] * parts[1] * parts[2]}, not the global batch {parts[3]}"
            )
    ga, gb = fa.get("group_names"), fb.get("group_names")
    if ga and gb and ga != gb:
        reasons.append(f"parameter groups differ: {ga} vs {gb}")
    return reasons, warnings


def compare_runs(path_a: Path | str, path_b: Path | str) -> Comparison:
    runs = []
    for tag, path in (("a", path_a), ("b", path_b)):
        try:
            runs.append(load_run(path))
        except CompareError as exc:
            exc.damaged = [{"run": tag, **d} for d in exc.damaged]
            raise
    a, b = runs
    reasons, warnings = comparability(a.facts, b.facts)
    steps = np.intersect1d(a.steps, b.steps)
    if not len(steps):
        raise CompareError(f"{a.path} and {b.path} have no optimizer step in common")
    for tag, run in (("A", a), ("B", b)):
        if len(run.ranks_used) < run.ranks_expected:
            warnings.append(
                f"run {tag} rests on {len(run.ranks_used)} of {run.ranks_expected} ranks "
                f"(ranks {run.ranks_used}): the loss is the mean over those ranks only")
    only = len(a.steps) + len(b.steps) - 2 * len(steps)
    if only:
        warnings.append(f"{only} step(s) are in one run only; compared the {len(steps)} common")
    ia, ib = np.searchsorted(a.steps, steps), np.searchsorted(b.steps, steps)
    results = []
    names = [n for n in a.series if n in b.series]
    both = np.ones(len(steps), dtype=bool)
    for run, idx in ((a, ia), (b, ib)):
        if run.loss_complete is not None:
            both &= run.loss_complete[idx]
    if not both.all():
        warnings.append(
            f"loss compared on {int(both.sum())} of {len(steps)} steps: at the others a rank's "
            "history ends early (killed before its last flush), so the mean over ranks differs"
        )
    for name in names:
        keep = both if name == "loss" else both_sampled(name, a.series[name][ia],
                                                         b.series[name][ib])
        x, y = a.series[name][ia][keep], b.series[name][ib][keep]
        results.append(_compare_series(name, steps[keep], x, y))
    hits = [r for r in results if r.first_step is not None]
    first = min((r.first_step for r in hits), default=None)
    at_first = [r for r in hits if r.first_step == first]
    groups = [r for r in at_first if r.name.startswith("group:")]
    worst = max(groups, key=lambda r: _excess(r), default=None)
    resumed = {tag: resumes(run.path, run.damage) for tag, run in (("a", a), ("b", b))}
    for tag, found in resumed.items():
        warnings += resume_notes(tag.upper(), found, first)
    result = Comparison(
        run_a=a.path,
        run_b=b.path,
        comparable=not reasons,
        reasons=reasons,
        warnings=warnings,
        facts={"a": a.facts, "b": b.facts},
        common_steps=len(steps),
        first_step=first,
        first_group=worst.name.split(":", 1)[1] if worst else None,
        first_series=sorted((r.name for r in at_first), key=lambda n: -_excess(
            next(r for r in at_first if r.name == n))),
        series=results,
        basis={"a": a.basis(), "b": b.basis(), "common_steps": int(len(steps))},
        resumes={tag: [r.to_json() for r in found] for tag, found in resumed.items()},
        damaged=[{"run": tag, **d.to_json()} for tag, run in (("a", a), ("b", b))
                 for d in run.damage.items],
    )
    result.warnings += result.damage_lines()
    return result


def run_damage_lines(damaged: list[dict[str, str]]) -> list[str]:
    """``run B: <file>: <problem>; <kept>`` for each damaged-file record of a comparison."""
    return [f"run {d['run'].upper()}: {d['file']}: {d['problem']}; {d['kept']}" for d in damaged]


def resume_notes(tag: str, found: list[Resume], first_step: int | None) -> list[str]:
    """One warning per resume that did not restore every state, tied to the divergence."""
    notes = []
    for r in found:
        if not r.missing:
            continue
        at = "an unstated step" if r.step is None else f"step {r.step}"
        note = f"{tag} resumed at {at} without {', '.join(r.missing)} state"
        if first_step is not None and r.step is not None and first_step >= r.step:
            if first_step == r.step:
                note += "; divergence begins at the first resumed step"
            elif first_step == r.step + 1:  # norms are of the gradients before the update
                note += (f"; divergence begins at the first resumed step (step {first_step} is "
                         "the first whose gradients follow a resumed update)")
            else:
                note += f"; divergence begins {first_step - r.step} steps after it"
        elif first_step is None:
            note += "; no divergence found after it"
        notes.append(note)
    return notes


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def relative_diff(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``|x - y| / max(|x|, |y|)``: 0 where both are the same non-finite value (NaN and NaN,
    inf and inf), inf where only one of them is finite."""
    with np.errstate(all="ignore"):
        scale = np.maximum(np.abs(x), np.abs(y))
        rel = np.abs(x - y) / np.where(scale > 0, scale, 1.0)
    fx, fy = np.isfinite(x), np.isfinite(y)
    same_nonfinite = (~fx & ~fy) & ((np.isnan(x) & np.isnan(y)) | (x == y))
    rel = np.where(fx & fy, rel, np.inf)
    return np.where(same_nonfinite, 0.0, rel)


def _compare_series(name: str, steps: np.ndarray, x: np.ndarray, y: np.ndarray) -> SeriesResult:
    rel = relative_diff(x, y)
    window = rel[:NOISE_STEPS]
    finite = window[np.isfinite(window)]
    noise = float(finite.max()) if len(finite) else 0.0
    tol = min(TOL_CAP, max(TOL_FLOOR, NOISE_FACTOR * noise))
    over = np.nonzero(rel > tol)[0]
    result = SeriesResult(name, noise, tol, None)
    if len(over):
        i = int(over[0])
        result.first_step = int(steps[i])
        result.value_a, result.value_b, result.rel_diff = float(x[i]), float(y[i]), float(rel[i])
        result.max_rel_before = float(rel[:i].max()) if i else 0.0
    else:
        result.max_rel_before = float(rel.max()) if len(rel) else 0.0
    return result


def _excess(r: SeriesResult) -> float:
    if r.rel_diff is None:
        return 0.0
    return math.inf if not math.isfinite(r.rel_diff) else r.rel_diff / r.tolerance


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
