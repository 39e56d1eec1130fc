"""A faithful stand-in for ``cupy.cuda.nccl`` of CuPy 13 and 14: the suite's one replaced API.

CuPy's NCCL binding cannot run without a GPU, so the CPU suite checks our glue
(`rlfleet.weightsync.cuda._nccl_init`) against this stand-in. It reproduces exactly what the glue
depends on, read from ``cupy_backends/cuda/libs/nccl.pyx`` at the tags v13.6.0 and v14.2.0:

- ``get_unique_id()``. CuPy 14: ``uniqueId.internal[:NCCL_UNIQUE_ID_BYTES]``, i.e. ``bytes`` of
  128. CuPy 13: ``tuple([<char>uniqueId.internal[i] for i in range(128)])``, a tuple of C
  ``char`` values: signed (-128..127) on x86-64, unsigned (0..255) on aarch64.
- ``NcclCommunicator.__init__``. CuPy 14: ``(self, int ndev, bytes commId, int rank, NcclConfig
  config=None)``, ``ValueError`` when ``len(commId) != 128``. CuPy 13: ``(self, int ndev, tuple
  commId, int rank)``, ``assert len(commId) == 128``, then ``_uniqueId.internal[i] = commId[i]``
  per item (Cython's int -> ``char`` conversion: ``OverflowError`` out of range, ``TypeError`` for
  a non-int). Cython checks the typed arguments on entry, before anything runs: a wrong type is
  a ``TypeError`` with no side effect.
- ``ncclCommInitRank``: the constructor blocks until all ``ndev`` ranks joined with the same id,
  with no timeout (here: one file per rank in a directory named after the id); ``abort()`` and
  ``destroy()`` end the communicator.

The bytes a communicator was built from are kept (``comm.unique_id``), so a test can check that
every rank joined the id the source drew, byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

NCCL_UNIQUE_ID_BYTES = 128


class StandInNccl:
    """``cupy.cuda.nccl`` as CuPy `version` 13 or 14 has it (`char_signed`: x86-64 vs aarch64)."""

    available = True

    def __init__(self, version: int, root: str | os.PathLike[str], char_signed: bool = True) -> None:
        if version not in (13, 14):
            raise ValueError(f"the stand-in models CuPy 13 and 14, not {version}")
        self.version = version
        self.char_signed = char_signed
        self.root = Path(root)
        self.released = threading.Event()  # set: every blocked init gives up (test teardown)
        self.built: list[_Communicator] = []  # every communicator whose init returned
        outer = self

        class NcclCommunicator(_Communicator):
            _nccl = outer

        self.NcclCommunicator = NcclCommunicator

    def get_unique_id(self) -> bytes | tuple[int, ...]:
        raw = os.urandom(NCCL_UNIQUE_ID_BYTES)
        if self.version >= 14:
            return raw
        return tuple(b - 256 if self.char_signed and b >= 128 else b for b in raw)

    def _char(self, value: Any) -> int:
        """Cython's conversion of a Python object to C ``char`` (signedness of the platform)."""
        if not isinstance(value, int):
            raise TypeError(f"an integer is required, got {type(value).__name__}")
        low, high = (-128, 127) if self.char_signed else (0, 255)
        if value < low:
            raise OverflowError("can't convert negative value to char" if low == 0 else "value too small")
        if value > high:
            raise OverflowError("value too large to convert to char")
        return value & 0xFF


class _Communicator:
    _nccl: StandInNccl

    def __init__(self, ndev: int, commId: Any, rank: int, config: Any = None) -> None:
        nccl = self._nccl
        if not isinstance(ndev, int) or not isinstance(rank, int):
            raise TypeError("an integer is required")
        if nccl.version >= 14:
            if not isinstance(commId, bytes):
                raise TypeError(_wrong_type("bytes", commId))
            if len(commId) != NCCL_UNIQUE_ID_BYTES:
                raise ValueError(f"commId length {len(commId)} != {NCCL_UNIQUE_ID_BYTES}.")
            raw = bytes(commId)
        else:
            if config is not None:
                raise TypeError("__init__() takes exactly 3 positional arguments (4 given)")
            if not isinstance(commId, tuple):
                raise TypeError(_wrong_type("tuple", commId))
            assert len(commId) == NCCL_UNIQUE_ID_BYTES
            raw = bytes(nccl._char(x) for x in commId)
        self.unique_id = raw
        self.rank = rank
        self.ndev = ndev
        self.aborted = False
        self.destroyed = False
        self._init_rank(raw, ndev, rank)
        nccl.built.append(self)

    def _init_rank(self, raw: bytes, ndev: int, rank: int) -> None:
        """``ncclCommInitRank``: announce this rank under the id, block until all `ndev` are there."""
        nccl = self._nccl
        room = nccl.root / hashlib.sha256(raw).hexdigest()[:32]
        room.mkdir(parents=True, exist_ok=True)
        (room / f"rank{rank}").write_text(str(os.getpid()))
        while len(list(room.glob("rank*"))) < ndev:
            if nccl.released.is_set():
                raise RuntimeError("NCCL_ERROR_SYSTEM_ERROR: stand-in init released by the test")
            time.sleep(0.005)

    def abort(self) -> None:
        self.aborted = True

    def destroy(self) -> None:
        self.destroyed = True

    def check_async_error(self) -> None:
        return None


def _wrong_type(expected: str, value: object) -> str:
    """Cython's message for a typed argument of the wrong type."""
    return f"Argument 'commId' has incorrect type (expected {expected}, got {type(value).__name__})"
