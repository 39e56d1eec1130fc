"""`fit_cost_model`: calibrate a cost model from measured `SyncReport`s by non-negative least squares.

Every measured phase of every executed step is one equation: the phase's coefficients over
`LINEAR_PARAMS` (from the plan, as `_sync_cost.step_features` prices it) times the unknowns equals
the measured seconds. Rows are divided by the measured value (relative error, so a 2 ms control
phase weighs as much as a 2 s wire phase), columns by their norm (conditioning), and the
Lawson-Hanson active-set method solves for non-negative unknowns. Pure Python: the systems have
at most ten unknowns.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlfleet.placement._errors import CostModelError
from rlfleet.placement._public import public
from rlfleet.placement.cost._model import DEFAULT_SOURCE, LINEAR_PARAMS, CostModel
from rlfleet.placement.sync._cost import PlanContext, step_features

if TYPE_CHECKING:
    from rlfleet.placement.sync._plan import SyncPlan
    from rlfleet.placement.sync._report import SyncReport

__all__ = ["fit_cost_model", "nnls"]

# measured phase -> priced phase it is compared with (commit is part of the control phase)
_PHASE_OF = {"pack": "pack", "wire": "wire", "land": "land", "control": "control", "commit": "control"}
_FLOOR_S = 1e-6


def _solve(m: list[list[float]], v: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small square system (ridge-stabilised)."""
    n = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for i in range(n):
        a[i][i] += 1e-12
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        if abs(a[col][col]) < 1e-300:
            continue
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        if abs(a[i][i]) < 1e-300:
            continue
        x[i] = (a[i][n] - sum(a[i][c] * x[c] for c in range(i + 1, n))) / a[i][i]
    return x


def _lstsq(rows: list[list[float]], b: list[float], cols: list[int]) -> list[float]:
    """Least squares over the columns ``cols`` (normal equations)."""
    ata = [[sum(r[i] * r[j] for r in rows) for j in cols] for i in cols]
    atb = [sum(r[i] * y for r, y in zip(rows, b, strict=True)) for i in cols]
    return _solve(ata, atb)


def nnls(rows: list[list[float]], b: list[float], tol: float = 1e-10) -> list[float]:
    """argmin ||A x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    n = len(rows[0]) if rows else 0
    x = [0.0] * n
    passive: list[int] = []

    def gradient() -> list[float]:
        resid = [y - sum(r[j] * x[j] for j in range(n)) for r, y in zip(rows, b, strict=True)]
        return [sum(r[j] * e for r, e in zip(rows, resid, strict=True)) for j in range(n)]

    for _ in range(3 * n + 10):
        w = gradient()
        free = [j for j in range(n) if j not in passive and w[j] > tol]
        if not free:
            break
        passive.append(max(free, key=lambda j: w[j]))
        while passive:
            z = dict(zip(passive, _lstsq(rows, b, passive), strict=True))
            if all(z[j] > 0 for j in passive):
                x = [z.get(j, 0.0) for j in range(n)]
                break
            steps = [x[j] / (x[j] - z[j]) for j in passive if z[j] <= 0 and x[j] - z[j] > 0]
            alpha = min(steps, default=0.0)
            x = [x[j] + alpha * (z.get(j, 0.0) - x[j]) if j in passive else 0.0 for j in range(n)]
            passive = [j for j in passive if x[j] > tol]
    return x


def _pairs(
    reports: Sequence[SyncReport], plans: Sequence[SyncPlan]
) -> list[tuple[int, SyncReport, SyncPlan]]:
    by_digest = {p.digest: p for p in plans}
    out = []
    for i, report in enumerate(reports):
        plan = plans[i] if len(plans) == len(reports) and plans[i].digest == report.plan_digest else None
        plan = plan or by_digest.get(report.plan_digest)
        if plan is not None and report.ok:
            out.append((i, report, plan))
    if not out:
        raise CostModelError("fit: no successful report matches a plan (compare SyncReport.plan_digest)")
    return out


def _bound_holds(plan: SyncPlan) -> bool:
    """Whether the plan's lower bound rests on rates of the cluster, not guesses.

    A bound holds for any system on the rates the plan was priced on. Where those are the
    documented fallback or `CostModel()`'s placeholders, a sync faster than the bound says the
    guesses were low (the fit then raises them), not that the measurement is wrong.
    """
    return "fallback" not in plan.topology_source and not plan.cost.source.startswith(DEFAULT_SOURCE)


def _impossible(seconds: float) -> str | None:
    if math.isnan(seconds) or math.isinf(seconds):
        return "not finite"
    if seconds < 0:
        return "negative"
    return "zero" if seconds == 0 else None


@dataclass
class _Rows:
    """The equations of a fit, and the measurements left out of it (each saying why)."""

    rows: list[list[float]] = field(default_factory=list)
    targets: list[float] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def add_report(self, where: str, report: SyncReport, plan: SyncPlan, base: CostModel) -> None:
        if _bound_holds(plan) and report.measured_seconds < plan.lower_bound_seconds:
            self.ignored.append(
                f"{where}: measured {report.measured_seconds:.3g} s, faster than its plan's lower bound "
                f"{plan.lower_bound_seconds:.3g} s (priced on {plan.topology_source[:60]})"
            )
            return
        feats = step_features(PlanContext.of(plan, base), plan.steps)
        for step_report in report.steps:
            if not 0 <= step_report.index < len(feats):
                raise CostModelError(f"fit: report step {step_report.index} is not a step of its plan")
            measured: dict[str, float] = {}
            for name, seconds in step_report.phases.items():
                if name in _PHASE_OF:
                    phase = _PHASE_OF[name]
                    measured[phase] = measured.get(phase, 0.0) + seconds
            for phase, seconds in measured.items():
                coefs = feats[step_report.index][phase]
                if not any(coefs.values()):
                    continue
                why = _impossible(seconds)
                if why is not None:
                    self.ignored.append(f"{where} step {step_report.index} {phase}={seconds!r} ({why})")
                    continue
                self.rows.append([coefs.get(p, 0.0) for p in LINEAR_PARAMS])
                self.targets.append(seconds)

    def listed(self, most: int = 8) -> str:
        more = len(self.ignored) - most
        return "; ".join(self.ignored[:most]) + (f"; and {more} more" if more > 0 else "")


@public
def fit_cost_model(
    reports: Sequence[SyncReport],
    plans: Sequence[SyncPlan],
    prior: CostModel | None = None,
    *,
    anchors: Mapping[str, float] | None = None,
) -> CostModel:
    """Calibrate ``prior`` (default `CostModel()`) from measured syncs: non-negative least squares.

    ``reports[i]`` is a `SyncReport` of executing ``plans[i]`` (a report may also be matched to its
    plan by digest when ``plans`` holds each plan once). Each measured step phase (pack, wire, land;
    control plus commit) is a linear function of `LINEAR_PARAMS` with coefficients from the plan
    (bytes, buckets, tensors, round trips per phase); the parameters minimising the squared relative
    error over all phases, constrained to be non-negative, replace the prior's. Parameters no phase
    depends on keep their values. ``source`` names a given prior's source first, then the fit.

    Measurements that cannot be right are left out with a warning naming each: a phase of zero,
    negative or not finite seconds, and a report faster than its plan's lower bound (when the plan
    was priced on the cluster's rates, not on fallback guesses). Raises CostModelError when no
    report matches a plan, no phase was measured, or no measurement can be right.

    ``anchors`` are `LINEAR_PARAMS` measured directly (a probe's host copy rate, in seconds per
    byte): each is one more equation of the fit (the parameter equals its measurement, weighed
    like any phase), so a direct measurement is not thrown away when a few syncs of a small model
    (copies that stay in cache) would pull the parameter elsewhere.
    """
    base = CostModel() if prior is None else prior
    eq = _Rows()
    for i, report, plan in _pairs(reports, plans):
        eq.add_report(f"report {i} (v{report.version})", report, plan, base)
    if eq.ignored:
        if not eq.rows:
            refused = f"{len(eq.ignored)} refused: {eq.listed()}"
            raise CostModelError(f"fit: no measurement can be right ({refused})")
        warnings.warn(
            f"fit_cost_model ignored {len(eq.ignored)} measurement(s) that cannot be right: {eq.listed()}",
            UserWarning,
            stacklevel=2,
        )
    if not eq.rows:
        raise CostModelError("fit: the reports hold no measured phase the plans can explain")
    anchors = dict(anchors or {})
    unknown = sorted(set(anchors) - set(LINEAR_PARAMS))
    if unknown:
        raise CostModelError(f"fit: unknown anchor(s) {unknown}; known: {list(LINEAR_PARAMS)}")
    rows, targets = list(eq.rows), list(eq.targets)
    for name, value in anchors.items():
        if not math.isfinite(value) or value <= 0:
            raise CostModelError(f"fit: anchor {name} must be a positive finite measurement, got {value!r}")
        rows.append([1.0 if p == name else 0.0 for p in LINEAR_PARAMS])
        targets.append(float(value))
    used = [j for j in range(len(LINEAR_PARAMS)) if any(r[j] for r in rows)]
    weights = [1.0 / max(t, _FLOOR_S) for t in targets]
    scaled = [[r[j] * w for j in used] for r, w in zip(rows, weights, strict=True)]
    norms = [math.sqrt(sum(r[k] ** 2 for r in scaled)) or 1.0 for k in range(len(used))]
    scaled = [[r[k] / norms[k] for k in range(len(used))] for r in scaled]
    solution = nnls(scaled, [t * w for t, w in zip(targets, weights, strict=True)])
    values = {LINEAR_PARAMS[j]: solution[k] / norms[k] for k, j in enumerate(used)}
    fitted = [sum(r[j] * values[LINEAR_PARAMS[j]] for j in used) for r in rows]
    errors = [((f - t) * w) ** 2 for f, t, w in zip(fitted, targets, weights, strict=True)]
    kept = f", anchored on measured {', '.join(anchors)}" if anchors else ""
    rms = math.sqrt(sum(errors) / len(rows))
    skipped = f", {len(eq.ignored)} impossible measurement(s) ignored" if eq.ignored else ""
    fit = (
        f"fit_cost_model: NNLS over {len(eq.rows)} measured phases of {len(reports)} report(s), "
        f"relative rms residual {rms:.1%}{skipped}{kept}"
    )
    source = f"{fit} (unfitted terms: defaults)" if prior is None else f"{prior.source}; then {fit}"
    return base.with_linear(values, source)
