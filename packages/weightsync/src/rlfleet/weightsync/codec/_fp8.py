"""FP8 weights for FP8 engines: e4m3 with one scale per 128x128 block, made by the sender.

The layout vLLM and SGLang load from FP8 checkpoints (DeepSeek-V3's, ``quant_method: fp8``,
``weight_block_size: [128, 128]``): a linear layer's ``weight`` in ``float8_e4m3fn`` and its
``weight_scale_inv`` in float32, one value per block, such that the block's weight is
``weight.float() * weight_scale_inv``. The sender quantizes once per version from the trainer's
weights (fp32 or bf16) and sends those tensors like any others, so every transport, consumer and
transform carries them unchanged, and the engine receives ready-made FP8 tensors instead of
re-quantizing. Quantizing is elementwise float32 arithmetic, bit-reproducible on one machine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from rlfleet.weightsync.layout._dtypes import dtype_name
from rlfleet.weightsync.layout._layout import Entry, Layout

__all__ = [
    "FP8_BLOCK",
    "FP8_DTYPE",
    "SCALE_SUFFIX",
    "dequantize_fp8_blocks",
    "fp8_error",
    "fp8_layout",
    "fp8_names",
    "quantize_fp8_blocks",
    "quantize_state_dict",
]

FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
#: A quantized weight ``w`` travels with ``w + SCALE_SUFFIX`` (``layer.weight_scale_inv``).
SCALE_SUFFIX = "_scale_inv"
_SKIP = ("embed", "lm_head", "norm")


def _check_weight(weight: torch.Tensor, block: int) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"FP8 block quantization takes a 2-D floating tensor, got {_describe(weight)}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def scale_shape(shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, int]:
    """The shape of a weight's ``weight_scale_inv``: one value per (partial) block."""
    return math.ceil(shape[0] / block), math.ceil(shape[1] / block)


def _blocks(weight: torch.Tensor, block: int) -> torch.Tensor:
    """`weight` in float32, zero-padded to whole blocks, as (rows, block, cols, block)."""
    rows, cols = scale_shape(tuple(weight.shape), block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=weight.device)
    padded[: weight.shape[0], : weight.shape[1]] = weight.detach()
    return padded.view(rows, block, cols, block)


def quantize_fp8_blocks(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight_fp8, weight_scale_inv)``: e4m3 values and a float32 scale per block.

    Each block is scaled so that its largest magnitude maps to 448 (e4m3's largest); an all-zero
    block gets scale 1. Rounding is to nearest even, as torch casts.
    """
    _check_weight(weight, block)
    blocks = _blocks(weight, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = (blocks / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    rows, cols = weight.shape
    quantized = scaled.view(scale_inv.shape[0] * block, -1)[:rows, :cols].to(FP8_DTYPE).contiguous()
    return quantized, scale_inv.contiguous()


def dequantize_fp8_blocks(
    quantized: torch.Tensor,
    scale_inv: torch.Tensor,
    block: int = FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight an engine computes with: ``quantized * scale_inv`` per block, as `dtype`."""
    if quantized.dim() != 2 or tuple(scale_inv.shape) != scale_shape(tuple(quantized.shape), block):
        raise ValueError(
            f"scale_inv {tuple(scale_inv.shape)} does not fit a {tuple(quantized.shape)} weight "
            f"in {block}x{block} blocks"
        )
    blocks = _blocks(quantized.to(torch.float32), block)
    rows, cols = quantized.shape
    out = (blocks * scale_inv.to(torch.float32)[:, None, :, None]).view(scale_inv.shape[0] * block, -1)
    return out[:rows, :cols].to(dtype)


def fp8_error(weight: torch.Tensor, block: int = FP8_BLOCK) -> float:
    """The largest reconstruction error of `weight`'s FP8 blocks, relative to each block's largest
    magnitude (an element's own relative error is unbounded where it rounds to zero)."""
    quantized, scale_inv = quantize_fp8_blocks(weight, block)
    back = _blocks(dequantize_fp8_blocks(quantized, scale_inv, block), block)
    original = _blocks(weight.to(torch.float32), block)
    amax = original.abs().amax(dim=(1, 3), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return float(((back - original).abs() / amax).max()) if weight.numel() else 0.0


def fp8_names(source: Mapping[str, torch.Tensor] | torch.nn.Module) -> list[str]:
    """What is quantized by default: linear layers' 2-D weights.

    From a module, the ``weight`` of every ``nn.Linear`` but ``lm_head``; from a state dict,
    every 2-D floating ``*.weight`` whose name mentions none of embed, lm_head, norm.
    """
    if isinstance(source, torch.nn.Module):
        return [
            f"{name}.weight"
            for name, module in source.named_modules()
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
        ]
    return [
        name
        for name, t in source.items()
        if name.endswith(".weight")
        and t.dim() == 2
        and t.is_floating_point()
        and not any(word in name for word in _SKIP)
    ]


def _selected(layout: Layout, names: Iterable[str] | None) -> set[str]:
    if names is None:
        return {
            s.name
            for s in layout.tensors
            if s.name.endswith(".weight") and len(s.shape) == 2 and not any(w in s.name for w in _SKIP)
        }
    chosen = set(names)
    for name in chosen:
        spec = layout[name]  # LayoutMismatchError naming an unknown one
        if len(spec.shape) != 2 or not spec.source_dtype.is_floating_point:
            raise ValueError(f"{name!r} is {spec.dtype} {spec.shape}; FP8 blocks need a 2-D floating weight")
        if name + SCALE_SUFFIX in layout:
            raise ValueError(f"{name!r} already has a {name + SCALE_SUFFIX!r} in the layout")
    return chosen


def fp8_layout(layout: Layout, names: Iterable[str] | None = None, block: int = FP8_BLOCK) -> Layout:
    """The layout an FP8 engine receives: each selected weight as e4m3, its scales right after it.

    `names` default: linear layers' 2-D weights (as `fp8_names` picks them from a state dict).
    Other tensors keep their entries (a cast to bf16 included).
    """
    chosen = _selected(layout, names)
    entries: list[Entry] = []
    for s in layout.tensors:
        if s.name in chosen:
            entries.append((s.name, s.shape, dtype_name(FP8_DTYPE)))
            entries.append((s.name + SCALE_SUFFIX, scale_shape(s.shape, block), "float32"))
        else:
            entries.append((s.name, s.shape, s.dtype, s.source))
    return Layout(entries, layout.bucket_bytes)


def quantize_state_dict(
    state_dict: Mapping[str, torch.Tensor], names: Iterable[str] | None = None, block: int = FP8_BLOCK
) -> dict[str, torch.Tensor]:
    """What the sender sends an FP8 engine: the selected weights quantized (once, here), each
    followed by its ``*_scale_inv``; the other tensors as they are (a cast layout casts them)."""
    chosen = set(fp8_names(state_dict) if names is None else names)
    unknown = sorted(chosen - set(state_dict))
    if unknown:
        raise ValueError(f"FP8: {unknown[0]!r} is not in the state dict")
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in state_dict.items():
            if name in chosen:
                out[name], out[name + SCALE_SUFFIX] = quantize_fp8_blocks(tensor, block)
            else:
                out[name] = tensor
    return out
