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

What travelled: each step says the bytes its sender put on its transport (``bytes_on_wire``)
beside the bytes of the full version of its buckets (``full_bytes``), the base version a delta
was sent against (``delta_base``; None: the full version) and which receivers got which
(``delta_receivers``, ``full_receivers``, and ``lacking_base``: those that did not hold the
offered base, so the step went full to all of them). The report sums them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfleet.placement._errors import SyncPlanError
from rlfleet.placement._format import human_bytes
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


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SyncPlanError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _pids(value: object, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise SyncPlanError(f"{what} must be a sequence of process ids, got {value!r}")
    bad = [p for p in value if not isinstance(p, str) or not p]
    if bad:
        raise SyncPlanError(f"{what} must be process ids (non-empty strings), got {bad}")
    return tuple(value)


def _names(pids: tuple[str, ...]) -> str:
    return ", ".join(pids)


@public
@dataclass(frozen=True)
class StepReport:
    """One executed step: its measured time and phases, beside the plan's prediction for it.

    `index` is the step's index in the plan it ran (`SyncPlan.steps`). What it moved (None:
    not reported): `bytes_on_wire` its sender sent, `full_bytes` the full version of its
    buckets; `delta_base` the version a delta was against (None: the full version went);
    `delta_receivers` / `full_receivers` which of its receivers got which; `lacking_base` the
    receivers that did not hold the base offered (the reason it went full)."""

    index: int
    measured_seconds: float
    predicted_seconds: float
    phases: Mapping[str, float] = field(default_factory=dict)
    bytes_on_wire: int | None = None
    full_bytes: int | None = None
    delta_base: int | None = None
    delta_receivers: tuple[str, ...] = ()
    full_receivers: tuple[str, ...] = ()
    lacking_base: tuple[str, ...] = ()

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
        self._check_moved(where)

    def _check_moved(self, where: str) -> None:
        for name in ("bytes_on_wire", "full_bytes", "delta_base"):
            if getattr(self, name) is not None:
                _count(getattr(self, name), f"{where}: {name}")
        for name in ("delta_receivers", "full_receivers", "lacking_base"):
            object.__setattr__(self, name, _pids(getattr(self, name), f"{where}: {name}"))
        if self.delta_base is None and self.delta_receivers:
            raise SyncPlanError(f"{where}: delta_receivers {list(self.delta_receivers)} without a delta_base")
        both = sorted(set(self.delta_receivers) & set(self.full_receivers))
        if both:
            raise SyncPlanError(f"{where}: {both} listed as receiving both the delta and the full version")

    @property
    def is_delta(self) -> bool:
        """Whether this step sent a delta (against `delta_base`) rather than the full version."""
        return self.delta_base is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "measured_seconds": self.measured_seconds,
            "predicted_seconds": self.predicted_seconds,
            "phases": dict(self.phases),
            "bytes_on_wire": self.bytes_on_wire,
            "full_bytes": self.full_bytes,
            "delta_base": self.delta_base,
            "delta_receivers": list(self.delta_receivers),
            "full_receivers": list(self.full_receivers),
            "lacking_base": list(self.lacking_base),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepReport:
        def count(name: str) -> int | None:
            value = data.get(name)
            return None if value is None else int(value)

        return cls(
            int(data["index"]),
            float(data["measured_seconds"]),
            float(data["predicted_seconds"]),
            dict(data.get("phases", {})),
            count("bytes_on_wire"),
            count("full_bytes"),
            count("delta_base"),
            tuple(data.get("delta_receivers") or ()),
            tuple(data.get("full_receivers") or ()),
            tuple(data.get("lacking_base") or ()),
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
    def bytes_on_wire(self) -> int | None:
        """What the steps' senders sent, in all (None: no step said)."""
        sent = [s.bytes_on_wire for s in self.steps if s.bytes_on_wire is not None]
        return sum(sent) if sent else None

    @property
    def full_bytes(self) -> int | None:
        """What the same steps would have sent as full versions (None: no step said)."""
        full = [s.full_bytes for s in self.steps if s.full_bytes is not None]
        return sum(full) if full else None

    @property
    def delta_receivers(self) -> tuple[str, ...]:
        """Receivers that got a delta in some step, in step order."""
        return tuple(dict.fromkeys(p for s in self.steps for p in s.delta_receivers))

    @property
    def full_receivers(self) -> tuple[str, ...]:
        """Receivers that got the full version (of their buckets) in some step, in step order."""
        return tuple(dict.fromkeys(p for s in self.steps for p in s.full_receivers))

    def moved(self) -> str:
        """What travelled, e.g. ``"1.2 MB on the wire of 4.8 MB full; delta from v3 to r1, r2;
        full to r0"`` (empty when no step said)."""
        sent, full = self.bytes_on_wire, self.full_bytes
        if sent is None:
            return ""
        text = f"{human_bytes(sent)} on the wire" + ("" if full is None else f" of {human_bytes(full)} full")
        bases = sorted({s.delta_base for s in self.steps if s.delta_base is not None})
        if self.delta_receivers:
            text += f"; delta from {', '.join(f'v{b}' for b in bases)} to {_names(self.delta_receivers)}"
        if self.full_receivers:
            text += f"; full to {_names(self.full_receivers)}"
        lacking = tuple(dict.fromkeys(p for s in self.steps for p in s.lacking_base))
        if lacking:
            text += f" ({_names(lacking)} lacked the base)"
        return text

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
        if moved := self.moved():
            line += f"; {moved}"
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
