"""The cost model every plan is priced with: the terms that dominate real weight syncs.

A weight sync is not only bytes on a wire. Published syncs spend most of their time in per-tensor
work (gathering, packing, an engine's ``load_weights`` call per tensor), per-bucket handshakes,
host copies (memcpy, H2D, D2H), the receiver's apply and control-plane round trips; the wire itself
runs below line rate (protocol efficiency). `CostModel` holds one number per term:

* ``per_tensor_s``: one process handling one tensor (pack on the sender, unpack/apply on a receiver);
* ``per_bucket_s``: one bucket through one step (stream sync, header, event);
* ``memcpy_bytes_per_s`` / ``h2d_bytes_per_s`` / ``d2h_bytes_per_s``: host copy, host to device,
  device to host;
* ``load_bytes_per_s``: a receiver applying bytes into its own weights (a device copy on a GPU);
* ``control_round_trip_s``: one control message and its answer (an RPC, a ZMQ round trip);
* ``protocol_efficiency``: the fraction of a link's line rate a transport reaches on large buckets;
* ``intra_node_bytes_per_s``: one process to another on the same node (NVLink per direction on a
  GPU node, shared memory or loopback on a CPU node); ``inter_node_bytes_per_s``: one NIC, per
  direction; ``nics_per_node``: NICs a node has (NCCL spreads channels over them);
* ``latency_s``: one hop;
* ``delta_encode_bytes_per_s``: a sender comparing a version with its base, per byte of the full
  version (the encoding, the base's update, the digest); ``delta_apply_bytes_per_s``: a receiver
  rebuilding a delta in its standby copy, per byte of the full version (its base copied there,
  the changes written, the digest checked). A delta step moves ``delta_bytes`` on the wire and
  pays both per full byte: it wins where the wire, not memory, is the limit.

A step runs its stages (pack, wire, land) bucket by bucket, so a bucket's stage overlaps the next
bucket's previous stage: ``pipeline_seconds`` gives ``sum(stages) / n + (n - 1) / n * max(stages)``
for ``n`` buckets (one bucket through every stage, then the slowest stage for the rest).

Rates are nominal (line rate); only predictions multiply them by ``protocol_efficiency``. Lower
bounds use nominal rates and no software term, so a bound holds for any implementation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.placement._errors import CostModelError
from rlfleet.placement._public import public

__all__ = ["DEFAULT_SOURCE", "LINEAR_PARAMS", "PHASES", "CostModel", "pipeline_seconds"]

#: Phases a step is priced (and measured) in.
PHASES: tuple[str, ...] = ("pack", "wire", "land", "control")

#: Parameters in which every phase is linear: times, and seconds per byte for the rates (the wire
#: ones already divided by the protocol efficiency). `fit_cost_model` solves for these.
LINEAR_PARAMS: tuple[str, ...] = (
    "per_tensor_s",
    "per_bucket_s",
    "memcpy_s_per_byte",
    "h2d_s_per_byte",
    "d2h_s_per_byte",
    "load_s_per_byte",
    "control_round_trip_s",
    "intra_s_per_byte",
    "inter_s_per_byte",
    "latency_s",
)

_RATES = (
    "delta_encode_bytes_per_s",
    "delta_apply_bytes_per_s",
    "memcpy_bytes_per_s",
    "h2d_bytes_per_s",
    "d2h_bytes_per_s",
    "load_bytes_per_s",
    "intra_node_bytes_per_s",
    "inter_node_bytes_per_s",
)
_TIMES = ("per_tensor_s", "per_bucket_s", "control_round_trip_s", "latency_s")
_COPY_RATES = {
    "memcpy_s_per_byte": "memcpy_bytes_per_s",
    "h2d_s_per_byte": "h2d_bytes_per_s",
    "d2h_s_per_byte": "d2h_bytes_per_s",
    "load_s_per_byte": "load_bytes_per_s",
}

DEFAULT_SOURCE = (
    "defaults (no calibration): placeholders for a CPU cluster on commodity Ethernet; "
    "calibrate with fit_cost_model(reports, plans) or pick a HARDWARE_PROFILES entry"
)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@public
@dataclass(frozen=True)
class CostModel:
    """Prices of the terms of a weight sync (see the module docstring); frozen, JSON round-trips."""

    per_tensor_s: float = 5e-6
    per_bucket_s: float = 2e-4
    memcpy_bytes_per_s: float = 5e9
    h2d_bytes_per_s: float = 25e9
    d2h_bytes_per_s: float = 25e9
    load_bytes_per_s: float = 5e9
    control_round_trip_s: float = 1e-3
    protocol_efficiency: float = 0.9
    intra_node_bytes_per_s: float = 10e9
    inter_node_bytes_per_s: float = 1.25e9
    latency_s: float = 5e-5
    source: str = DEFAULT_SOURCE
    nics_per_node: int = 1
    delta_encode_bytes_per_s: float = 2.5e9
    delta_apply_bytes_per_s: float = 2.5e9

    def __post_init__(self) -> None:
        for name in _RATES:
            value = getattr(self, name)
            if not _finite(value) or value <= 0:
                raise CostModelError(f"CostModel.{name} must be a positive finite number, got {value!r}")
        for name in _TIMES:
            value = getattr(self, name)
            if not _finite(value) or value < 0:
                raise CostModelError(f"CostModel.{name} must be a non-negative finite number, got {value!r}")
        eff = self.protocol_efficiency
        if not _finite(eff) or not 0 < eff <= 1:
            raise CostModelError(f"CostModel.protocol_efficiency must be in (0, 1], got {eff!r}")
        nics = self.nics_per_node
        if isinstance(nics, bool) or not isinstance(nics, int) or nics < 1:
            raise CostModelError(f"CostModel.nics_per_node must be a positive int, got {nics!r}")
        if not isinstance(self.source, str):
            raise CostModelError(f"CostModel.source must be a string, got {self.source!r}")

    # ------------------------------------------------------------------ terms
    def wire_rate(self, *, cross_node: bool, gpu: bool, nics: int | None = None) -> float:
        """Bytes per second a transport reaches on one link class (line rate x efficiency).

        Across nodes a GPU transport (NCCL) spreads its channels over ``nics`` NICs (default
        ``nics_per_node``); a CPU transport (gloo, TCP) uses one connection, one NIC.
        """
        if not cross_node:
            return self.intra_node_bytes_per_s * self.protocol_efficiency
        links = (nics if nics is not None else self.nics_per_node) if gpu else 1
        return links * self.inter_node_bytes_per_s * self.protocol_efficiency

    def copy_seconds(self, nbytes: float, kind: str) -> float:
        """A copy of ``nbytes``: ``kind`` is "memcpy", "h2d", "d2h" or "load"."""
        rate = getattr(self, f"{kind}_bytes_per_s", None)
        if rate is None:
            raise CostModelError(f"unknown copy kind {kind!r} (memcpy, h2d, d2h, load)")
        return float(nbytes) / float(rate)

    def delta_seconds(
        self, full_bytes: float, delta_bytes: float, wire_bytes_per_s: float, buckets: int = 1
    ) -> float:
        """One delta step: each bucket encoded against the sender's base (per full byte), its
        delta on the wire, rebuilt on the receiver (per full byte), the three stages pipelined
        over `buckets` buckets (`pipeline_seconds`)."""
        if not _finite(full_bytes) or not _finite(delta_bytes) or full_bytes < 0 or delta_bytes < 0:
            raise CostModelError(f"delta_seconds needs byte counts >= 0, got {full_bytes!r}, {delta_bytes!r}")
        if not _finite(wire_bytes_per_s) or wire_bytes_per_s <= 0:
            raise CostModelError(f"delta_seconds needs a positive wire rate, got {wire_bytes_per_s!r}")
        stages = (
            float(full_bytes) / self.delta_encode_bytes_per_s,
            float(delta_bytes) / float(wire_bytes_per_s),
            float(full_bytes) / self.delta_apply_bytes_per_s,
        )
        return pipeline_seconds(stages, buckets) + max(1, buckets) * self.per_bucket_s

    def linear_values(self) -> dict[str, float]:
        """This model in `LINEAR_PARAMS` form (what every phase is linear in)."""
        out: dict[str, float] = {name: 1.0 / float(getattr(self, rate)) for name, rate in _COPY_RATES.items()}
        out.update({name: float(getattr(self, name)) for name in _TIMES})
        out["intra_s_per_byte"] = 1.0 / self.wire_rate(cross_node=False, gpu=False)
        out["inter_s_per_byte"] = 1.0 / (self.inter_node_bytes_per_s * self.protocol_efficiency)
        return out

    def with_linear(self, values: Mapping[str, float], source: str) -> CostModel:
        """A copy with the given `LINEAR_PARAMS` replaced (rates back from seconds per byte).

        A wire term changes the protocol efficiency, not the line rate: the inter-node one (when
        given) sets ``protocol_efficiency`` (or, when the measured rate beats the assumed line rate,
        raises the line rate instead), and the intra-node rate absorbs the rest of its own.
        """
        unknown = sorted(set(values) - set(LINEAR_PARAMS))
        if unknown:
            raise CostModelError(f"unknown linear parameter(s) {unknown}; known: {list(LINEAR_PARAMS)}")
        changes: dict[str, Any] = {"source": source}
        for name, rate in _COPY_RATES.items():
            if name in values:
                changes[rate] = 1.0 / max(values[name], 1e-18)
        for name in _TIMES:
            if name in values:
                changes[name] = max(0.0, values[name])
        eff = self.protocol_efficiency
        if "inter_s_per_byte" in values:
            measured = 1.0 / max(values["inter_s_per_byte"], 1e-18)  # line rate x efficiency
            if measured <= self.inter_node_bytes_per_s:
                eff = measured / self.inter_node_bytes_per_s
                changes["protocol_efficiency"] = eff
            else:  # faster than the assumed line rate: the line rate was wrong, not the efficiency
                changes["inter_node_bytes_per_s"] = measured / eff
        if "intra_s_per_byte" in values:
            changes["intra_node_bytes_per_s"] = 1.0 / (max(values["intra_s_per_byte"], 1e-18) * eff)
        return dataclasses.replace(self, **changes)

    def replace(self, **changes: Any) -> CostModel:
        """A copy with some fields changed (validated like the constructor)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise CostModelError(f"unknown CostModel field(s) {unknown}")
        return dataclasses.replace(self, **changes)

    def topology_overrides(self) -> dict[str, float]:
        """`Topology.from_ray_nodes` overrides with this model's rates, so a topology built for a
        calibrated model prices links as the model does."""
        return {
            "nic_bandwidth": self.inter_node_bytes_per_s,
            "nic_latency": self.latency_s,
            "host_bandwidth": self.intra_node_bytes_per_s,
        }

    # ------------------------------------------------------------------ calibration
    def with_measured_terms(
        self,
        *,
        control_round_trip_s: float,
        memcpy_bytes_per_s: float,
        per_tensor_s: float,
        per_bucket_s: float,
        broadcast_bytes_per_s: float | None = None,
    ) -> CostModel:
        """A copy with the terms measured on their own (the prior `fit_cost_model` refines): a host copy
        rate stands for the load rate too; a measured broadcast rate is the protocol's rate with
        its efficiency in it, on either link class. ``source`` lists what was measured."""
        changes: dict[str, Any] = {
            "control_round_trip_s": control_round_trip_s,
            "memcpy_bytes_per_s": memcpy_bytes_per_s,
            "load_bytes_per_s": memcpy_bytes_per_s,
            "per_tensor_s": per_tensor_s,
            "per_bucket_s": per_bucket_s,
        }
        rate = broadcast_bytes_per_s
        if rate is not None:
            changes.update(inter_node_bytes_per_s=rate, intra_node_bytes_per_s=rate, protocol_efficiency=1.0)
        source = (
            f"calibrate(): control round trip {control_round_trip_s * 1e3:.3g} ms, "
            f"memcpy {memcpy_bytes_per_s / 1e9:.3g} GB/s, "
            f"{per_tensor_s * 1e6:.3g} us/tensor, {per_bucket_s * 1e6:.3g} us/bucket"
            + ("" if rate is None else f", broadcast {rate / 1e9:.3g} GB/s")
        )
        return self.replace(source=source, **changes)

    # ------------------------------------------------------------------ data
    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        if not isinstance(data, Mapping):
            raise CostModelError(f"CostModel.from_dict needs a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise CostModelError(f"unknown CostModel field(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))


@public
def pipeline_seconds(stages: Sequence[float], buckets: int) -> float:
    """Time for ``buckets`` buckets through stages whose totals are ``stages``, overlapped.

    One bucket crosses every stage (``sum / n``), then the slowest stage sets the pace for the
    other ``n - 1`` buckets. With one bucket it is the plain sum.
    """
    if not stages:
        return 0.0
    n = max(1, buckets)
    return sum(stages) / n + (n - 1) / n * max(stages)
