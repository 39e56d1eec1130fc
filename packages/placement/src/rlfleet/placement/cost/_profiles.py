"""Documented hardware profiles: `CostModel`s of 8-GPU Hopper nodes with their NICs.

Every constant names its source. Hardware rates are vendor figures or public measurements;
software terms (per tensor, per bucket, control round trip) are either a published measurement of
an RL framework's refit path or marked as an assumption, to be replaced by `fit_cost_model` on the
cluster itself. Nominal rates are per direction.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from rlfleet.placement.cost._model import CostModel

__all__ = ["HARDWARE_PROFILES", "Profiles"]

# --- shared by the three Hopper nodes ------------------------------------------------------------
# NVLink 4: "900 gigabytes per second (GB/s) bidirectional per GPU" (nvidia.com, Hopper
# architecture page; NVIDIA HGX H100/H200 and the H20 spec sheets quote the same), 450 GB/s each way.
_NVLINK4 = 450e9
# ConnectX-7 NDR 400 Gb/s = 50 GB/s per port; one per GPU, eight per node (DGX H100 User Guide,
# "Network Modules": eight ConnectX-7 ports, one per GPU; DGX H200 has the same compute fabric;
# H20: an 8 x 400G RoCE H20 cluster in NVIDIA/nccl-tests issue #367).
_NIC_400G = 50e9
_NICS = 8
# NCCL reaches 46-48 GB/s per 400 Gb/s NIC (an NVIDIA NCCL engineer in NVIDIA/nccl-tests issue #290):
# 47 / 50.
_NCCL_EFFICIENCY = 0.94
# PCIe Gen5 x16 (64 GB/s nominal): nvbandwidth measured 52.8 GB/s device-to-host per H100 GPU, and
# reports "similar results with H20 and H800" (NVIDIA/nvbandwidth issue #24); used both ways.
_PCIE5 = 52e9
# An engine applying one tensor: NeMo RL measured 0.18 ms per CUDA-IPC handle in its vLLM refit
# (NeMo RL refit-performance blog, 2025-08-12; /work/shared/notes/published-syncs.md).
_PER_TENSOR = 0.18e-3
# Assumptions (no published figure; calibrate with fit_cost_model): a stream synchronisation and a
# header per bucket; one control-plane round trip (an actor call); one NIC hop; one process copying
# through host DRAM.
_PER_BUCKET = 50e-6
_ROUND_TRIP = 1e-3
_LATENCY = 5e-6
_HOST_MEMCPY = 10e9


def _profile(name: str, hbm_bytes_per_s: float, hbm_source: str) -> CostModel:
    return CostModel(
        per_tensor_s=_PER_TENSOR,
        per_bucket_s=_PER_BUCKET,
        memcpy_bytes_per_s=_HOST_MEMCPY,
        h2d_bytes_per_s=_PCIE5,
        d2h_bytes_per_s=_PCIE5,
        # a device copy reads and writes every byte: half the HBM bandwidth
        load_bytes_per_s=hbm_bytes_per_s / 2,
        control_round_trip_s=_ROUND_TRIP,
        protocol_efficiency=_NCCL_EFFICIENCY,
        intra_node_bytes_per_s=_NVLINK4,
        inter_node_bytes_per_s=_NIC_400G,
        latency_s=_LATENCY,
        nics_per_node=_NICS,
        source=(
            f"profile {name}: 8 GPUs per node, NVLink 4 450 GB/s each way, 8 x ConnectX-7 400 Gb/s, "
            f"NCCL at 94% of line rate, PCIe Gen5 52 GB/s, {hbm_source}; 0.18 ms per tensor applied "
            "(NeMo RL's vLLM refit); per-bucket, round-trip and host-copy terms are assumptions"
        ),
    )


class Profiles(Mapping[str, CostModel]):
    """A read-only mapping whose missing key names the profiles there are (and a near miss)."""

    def __init__(self, profiles: Mapping[str, CostModel]) -> None:
        self._profiles = dict(profiles)

    def __getitem__(self, name: str) -> CostModel:
        try:
            return self._profiles[name]
        except KeyError:
            known = ", ".join(repr(k) for k in self._profiles)
            near = [k for k in self._profiles if k.lower() == str(name).lower()]
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise KeyError(f"unknown hardware profile {name!r}; known: {known}{hint}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._profiles)

    def __len__(self) -> int:
        return len(self._profiles)

    def __repr__(self) -> str:
        return f"HARDWARE_PROFILES({', '.join(self._profiles)})"


#: "H100": HBM3 3.35 TB/s (NVIDIA H100 SXM datasheet); "H200": HBM3e 4.8 TB/s (NVIDIA H200
#: datasheet); "H20": HBM3 4.0 TB/s (96 GB; NVIDIA's H20 figures as reported publicly). All three
#: with NVLink 4 and eight 400 Gb/s NICs per node.
HARDWARE_PROFILES = Profiles(
    {
        "H100": _profile("H100", 3.35e12, "HBM3 3.35 TB/s"),
        "H200": _profile("H200", 4.8e12, "HBM3e 4.8 TB/s"),
        "H20": _profile("H20", 4.0e12, "HBM3 4.0 TB/s"),
    }
)
