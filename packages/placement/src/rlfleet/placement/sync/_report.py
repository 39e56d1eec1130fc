"""`SyncReport`: what one executed sync measured, step by step, next to what its plan predicted.

Plain data an executor fills in (policygroup) and a calibration reads (`fit_cost_model`). Measured
phases use the names ``pack``, ``wire``, ``land``, ``commit``, ``control`` and ``wait_readers``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfleet.placement._errors import SyncPlanError
from rlfleet.placement._public import public

if TYPE_CHECKING:
    from rlfleet.placement.sync._plan import SyncPlan

__all__ = ["MEASURED_PHASES", "StepReport", "SyncReport"]

MEASURED_PHASES: tuple[str, ...] = ("pack", "wire", "land", "commit", "control", "wait_readers")


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise SyncPlanError(f"sync report version must be an int, got {self.version!r}")
        _seconds(self.measured_seconds, "sync report measured_seconds")
        _seconds(self.predicted_seconds, "sync report predicted_seconds")
        if not self.ok and not self.error:
            raise SyncPlanError("a failed sync report must carry its error")

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
        return (
            f"v{self.version} {state} {self.measured_seconds:.3g} s measured / "
            f"{self.predicted_seconds:.3g} s predicted ({ratio}), {n} step{'s' if n != 1 else ''}"
        )

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
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, SyncPlanError):
                raise
            raise SyncPlanError(f"malformed sync report data: {type(exc).__name__}: {exc}") from None
