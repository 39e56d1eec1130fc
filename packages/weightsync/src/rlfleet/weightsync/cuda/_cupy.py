"""CuPy, imported only when a GPU transport is used (importing rlfleet.weightsync never does)."""

from __future__ import annotations

from typing import Any

EXTRAS_HINT = (
    "install the CUDA extra matching your CUDA toolkit, rlfleet-weightsync[cuda12] (CUDA 12.x) or "
    "rlfleet-weightsync[cuda13] (CUDA 13.x): from a clone, pip install './packages/weightsync[cuda12]' "
    "(or pip install cupy-cuda12x / cupy-cuda13x)"
)


def import_cupy() -> Any:
    """The cupy module, or an ImportError that names the extras."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(f"this GPU transport needs CuPy, which is not installed; {EXTRAS_HINT}") from exc
    return cupy


def import_nccl() -> Any:
    """cupy.cuda.nccl, or an ImportError that names the extras."""
    import_cupy()
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ImportError(
            f"CuPy is installed but its NCCL bindings are not usable ({exc}); {EXTRAS_HINT}"
        ) from exc
    if not getattr(nccl, "available", True):
        # cupy.cuda.nccl swallows the ImportError and sets available=False when libnccl is absent
        raise ImportError(f"CuPy's NCCL bindings are unavailable (no NCCL library found); {EXTRAS_HINT}")
    return nccl
