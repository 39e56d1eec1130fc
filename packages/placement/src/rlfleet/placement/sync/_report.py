"""`SyncReport`: what one executed sync measured, step by step, next to what its plan predicted.

Plain data an executor fills in (policygroup) and a calibration reads (`fit_cost_model`). Measured
phases use the names ``pack``, ``wire``, ``land``, ``commit``, ``control`` and ``wait_readers``.

The steps are not the whole sync: before them an executor checks its workers and wires what
changed, after them it collects the answers and applies the version (a rolling update drains,
swaps and undrains each rollout worker). ``wall_seconds`` is the whole sync as its caller saw it,
``wall_phases`` splits it into ``prepare``, ``steps``, ``collect`` and ``apply`` (they add up to
it), and ``predicted_wall_seconds`` is the prediction of all of it (`predict_sync_wall`).

Async RL reads two more: ``serving_stall_seconds``, the longest interval in which a rollout
worker admitted no request because of this sync (its swap, or its whole transfer when it
applies in place), and ``skipped_versions``, the versions committed by the trainers that this
sync superseded before they were sent (no rollout worker received them).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfleet.placement._errors import SyncPlanError
from rlfleet.placement._public import public

if TYPE_CHECKING:
    from rlfleet.placement.sync._plan import SyncPlan

__all__ = ["MEASURED_PHASES", "WALL_PHASES", "StepReport", "SyncReport"]

MEASURED_PHASES: tuple[str, ...] = ("pack", "wire", "land", "commit", "control", "wait_readers")
#: The parts of a whole sync, in order; they add up to `SyncReport.wall_seconds`.
WALL_PHASES: tuple[str, ...] = ("prepare", "steps", "collect", "apply")


def _seconds(value: object, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise SyncPlanError(f"{what} must be a non-negative finite number of seconds, got {value!r}")
    return float(value)


@public
@dataclass(frozen=True)
class StepReport:
    """One executed step: its measured time and phases, beside the plan's prediction for it.

    `index` is the step's index in the plan it ran (`SyncPlan.steps`)."""

    index: int
    measured_seconds: float
    predicted_seconds: float
    phases: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise SyncPlanError(f"step report index must be a non-negative int, got {self.index!r}")
        where = f"step report {self.index}"
        _seconds(self.measured_seconds, f"{where}: measured_seconds")
        _seconds(self.predicted_seconds, f"{where}: predicted_seconds")
        phases = dict(self.phases)
        unknown = sorted(set(phases) - set(MEASURED_PHASES))
        if unknown:
            raise SyncPlanError(f"{where}: unknown phase(s) {unknown}; known: {list(MEASURED_PHASES)}")
        for name, value in phases.items():
            phases[name] = _seconds(value, f"{where}: phase {name!r}")
        object.__setattr__(self, "phases", phases)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "measured_seconds": self.measured_seconds,
            "predicted_seconds": self.predicted_seconds,
            "phases": dict(self.phases),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepReport:
        return cls(
            int(data["index"]),
            float(data["measured_seconds"]),
            float(data["predicted_seconds"]),
            dict(data.get("phases", {})),
        )


@public
@dataclass(frozen=True)
class SyncReport:
    """One version's sync as executed: ok or the error, per-step reports, totals, the plan's digest."""

    version: int
    ok: bool
    error: str | None
    steps: tuple[StepReport, ...]
    measured_seconds: float
    predicted_seconds: float
    plan_digest: str
    wall_seconds: float | None = None
    wall_phases: Mapping[str, float] = field(default_factory=dict)
    predicted_wall_seconds: float | None = None
    serving_stall_seconds: float | None = None
    skipped_versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        self._check_async()
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise SyncPlanError(f"sync report version must be an int, got {self.version!r}")
        _seconds(self.measured_seconds, "sync report measured_seconds")
        _seconds(self.predicted_seconds, "sync report predicted_seconds")
        if not self.ok and not self.error:
            raise SyncPlanError("a failed sync report must carry its error")
        phases = {n: _seconds(v, f"sync report wall phase {n!r}") for n, v in self.wall_phases.items()}
        object.__setattr__(self, "wall_phases", phases)
        unknown = sorted(set(phases) - set(WALL_PHASES))
        if unknown:
            raise SyncPlanError(f"sync report: unknown wall phase(s) {unknown}; known: {list(WALL_PHASES)}")
        if self.predicted_wall_seconds is not None:
            _seconds(self.predicted_wall_seconds, "sync report predicted_wall_seconds")
        if self.wall_seconds is not None:
            wall = _seconds(self.wall_seconds, "sync report wall_seconds")
            if phases and not math.isclose(sum(phases.values()), wall, rel_tol=1e-6, abs_tol=1e-9):
                raise SyncPlanError(
                    f"sync report: wall phases add up to {sum(phases.values()):.6f} s, not the "
                    f"wall time {wall:.6f} s"
                )

    def _check_async(self) -> None:
        if self.serving_stall_seconds is not None:
            _seconds(self.serving_stall_seconds, "sync report serving_stall_seconds")
        skipped = tuple(self.skipped_versions)
        bad = [v for v in skipped if isinstance(v, bool) or not isinstance(v, int) or v >= self.version]
        if bad:
            raise SyncPlanError(
                f"sync report skipped_versions must be ints older than version {self.version}, got {bad}"
            )
        object.__setattr__(self, "skipped_versions", tuple(sorted(skipped)))

    def with_wall(
        self, phases: Mapping[str, float], predicted_wall_seconds: float | None = None
    ) -> SyncReport:
        """This report with the whole sync's phases (`WALL_PHASES`; their sum is the wall time)."""
        phases = {name: float(v) for name, v in phases.items()}
        return dataclasses.replace(
            self,
            wall_seconds=sum(phases.values()),
            wall_phases=phases,
            predicted_wall_seconds=predicted_wall_seconds,
        )

    @property
    def wall_ratio(self) -> float | None:
        """The whole sync's measured over predicted time (None when either is unknown)."""
        if self.wall_seconds is None or not self.predicted_wall_seconds:
            return None
        return self.wall_seconds / self.predicted_wall_seconds

    @property
    def ratio(self) -> float:
        """Measured over predicted (inf when nothing was predicted)."""
        if self.predicted_seconds <= 0:
            return math.inf if self.measured_seconds > 0 else 1.0
        return self.measured_seconds / self.predicted_seconds

    def summary(self) -> str:
        """One line: ``v3 ok 0.41 s measured / 0.38 s predicted (1.08x), 4 steps``."""
        state = "ok" if self.ok else f"FAILED ({self.error})"
        ratio = f"{self.ratio:.2f}x" if math.isfinite(self.ratio) else "n/a"
        n = len(self.steps)
        line = (
            f"v{self.version} {state} {self.measured_seconds:.3g} s measured / "
            f"{self.predicted_seconds:.3g} s predicted ({ratio}), {n} step{'s' if n != 1 else ''}"
        )
        if self.wall_seconds is not None:
            predicted = self.predicted_wall_seconds
            tail = "" if predicted is None else f" / {predicted:.3g} s predicted"
            line += f"; whole sync {self.wall_seconds:.3g} s{tail}"
        if self.serving_stall_seconds is not None:
            line += f"; serving stall {self.serving_stall_seconds * 1e3:.3g} ms"
        if self.skipped_versions:
            line += f"; skipped {', '.join(f'v{v}' for v in self.skipped_versions)}"
        return line

    def matches(self, plan: SyncPlan) -> bool:
        """True when exactly the plan's steps were executed: same plan digest, same step indices."""
        if self.plan_digest != plan.digest:
            return False
        return sorted(s.index for s in self.steps) == [s.index for s in plan.steps]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "ok": self.ok,
            "error": self.error,
            "steps": [s.to_dict() for s in self.steps],
            "measured_seconds": self.measured_seconds,
            "predicted_seconds": self.predicted_seconds,
            "plan_digest": self.plan_digest,
            "wall_seconds": self.wall_seconds,
            "wall_phases": dict(self.wall_phases),
            "predicted_wall_seconds": self.predicted_wall_seconds,
            "serving_stall_seconds": self.serving_stall_seconds,
            "skipped_versions": list(self.skipped_versions),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyncReport:
        try:
            return cls(
                int(data["version"]),
                bool(data["ok"]),
                data.get("error"),
                tuple(StepReport.from_dict(s) for s in data["steps"]),
                float(data["measured_seconds"]),
                float(data["predicted_seconds"]),
                str(data["plan_digest"]),
                None if data.get("wall_seconds") is None else float(data["wall_seconds"]),
                dict(data.get("wall_phases") or {}),
                None if data.get("predicted_wall_seconds") is None else float(data["predicted_wall_seconds"]),
                None if data.get("serving_stall_seconds") is None else float(data["serving_stall_seconds"]),
                tuple(int(v) for v in data.get("skipped_versions") or ()),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, SyncPlanError):
                raise
            raise SyncPlanError(f"malformed sync report data: {type(exc).__name__}: {exc}") from None
