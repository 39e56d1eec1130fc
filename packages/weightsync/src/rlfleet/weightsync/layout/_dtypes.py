"""Stable names for torch dtypes, so layouts travel as plain JSON."""

from __future__ import annotations

import torch

from rlfleet.weightsync._errors import MetadataError

_CANDIDATES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)

#: Every dtype this torch build has, by its stable name.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _CANDIDATES if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The stable name of `dtype` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise MetadataError(f"dtype {dtype} cannot be carried by a weight sync") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called `name`; a clear error for anything else."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise MetadataError(f"unknown dtype {name!r}; known: {sorted(DTYPES)}") from None


def element_size(name: str) -> int:
    return dtype_from_name(name).itemsize
