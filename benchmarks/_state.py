"""The synthetic state dicts the weightsync benchmarks move, defined once.

Imported by `weightsync.py`, `_weightsync_dist.py` and `gpu_check.py` (each run as
``python benchmarks/<name>.py``, so this directory is on ``sys.path``, in spawned workers too).
torch is imported inside the functions: `gpu_check.py` answers ``--help`` and reports a missing
GPU without loading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MiB = 1024 * 1024
GiB = 1024 * MiB

#: (name, shape, dtype name) per tensor, in state-dict order.
Spec = list[tuple[str, tuple[int, ...], str]]


def model_spec(total: int, small: int = 2000) -> Spec:
    """A ~`total`-byte model: 70% large bf16 matrices, `small` fp32 vectors, four int64 buffers."""
    large_bytes = int(total * 0.70)
    int_bytes = int(total * 0.02)
    small_bytes = total - large_bytes - int_bytes
    entries: Spec = []
    per_large = 32 * MiB if total >= 512 * MiB else 8 * MiB
    n_large = max(1, large_bytes // per_large)
    for i in range(n_large):
        entries.append((f"layers.{i}.mlp.weight", (per_large // 2 // 4096, 4096), "bfloat16"))
    per_small = max(4, small_bytes // small // 4)
    for i in range(small):
        entries.append((f"layers.{i % max(1, n_large)}.norm{i}.weight", (per_small,), "float32"))
    for i in range(4):
        entries.append((f"buffers.step{i}", (max(1, int_bytes // 4 // 8),), "int64"))
    return entries


def gpu_model_spec(total: int) -> Spec:
    """~`total` bytes for the GPU check: 85% large bf16 matrices, 512 small fp32, one int64."""
    entries: Spec = []
    large = int(total * 0.85)
    per = 64 * MiB if total >= 2 * GiB else 16 * MiB
    for i in range(max(1, large // per)):
        entries.append((f"layers.{i}.weight", (per // 2 // 8192, 8192), "bfloat16"))
    rest = total - large - 8 * MiB
    for i in range(512):
        entries.append((f"layers.{i}.norm", (max(1, rest // 512 // 4),), "float32"))
    entries.append(("step", (MiB,), "int64"))
    return entries


def build_state(spec: Spec, seed: int = 0, fill: bool = True, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors of `spec` on `device`: contents a function of `seed` alone (a receiver regenerates
    them to check bit for bit), or zeros when not `fill` (a receiver's live tensors)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape, dtype in spec:
        dt = getattr(torch, dtype)
        if not fill:
            out[name] = torch.zeros(shape, dtype=dt, device=device)
        elif dt.is_floating_point:
            out[name] = torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dt)
        else:
            out[name] = torch.randint(0, 1 << 30, shape, generator=g, device=device, dtype=dt)
    return out


def bump(state: dict[str, torch.Tensor]) -> None:
    """Make the next version differ from the last (cheaply: one element per tensor)."""
    import torch

    with torch.no_grad():
        for t in state.values():
            if t.numel():
                t.view(-1)[0] += 1
