"""Named shared-memory segments on one node (CPU), safe to create, share and clean up.

A segment is a file in ``/dev/shm`` created with ``O_CREAT | O_EXCL`` and mode 0600 (only
this user can map it), under a name no one can guess or reuse:
``{prefix}_{creator pid}_{creator start time}_{128 random bits}``. `attach` maps only a regular
file owned by this user with mode 0600 (`UnsafeSegmentError` otherwise): names in /dev/shm are
listable, so once a name is unlinked anyone could create a file under it.

Lifetime. The creator holds a lock on its segment for as long as it has it open (an
open-file-description lock, which the kernel drops when the process dies, whatever PID
namespace it runs in). `cleanup_stale_segments` reclaims a segment only when nobody holds that
lock (and, for segments made before the lock existed, no process here has the creator's pid and
start time); it takes the lock itself while it unlinks, so it cannot race a creator. It
reclaims only this user's segments. A process unlinks the segments it created when their owner
object is collected, at exit, and when SIGTERM or SIGHUP terminates it (see
`install_termination_cleanup`); a SIGKILLed or OOM-killed creator leaves its segments to the
next `cleanup_stale_segments` on the node (a new `SharedBuffer` runs one).

Tensors over a segment are zero-copy (`torch.frombuffer` over a memoryview that pins the
mapping: the mapping cannot be unmapped while a tensor still points into it). A read-only
mapping gives tensors whose storage the OS refuses to write: a reader cannot corrupt weights
that other processes share.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from rlfleet.weightsync._deadline import Backoff, Deadline
from rlfleet.weightsync._errors import UnsafeSegmentError, WeightSyncError
from rlfleet.weightsync.layout._lent import lend
from rlfleet.weightsync.shm._termination import add_cleanup, install_termination_cleanup

__all__ = [
    "SHM_DIR",
    "SharedSegment",
    "cleanup_stale_segments",
    "memory_fence",
    "process_alive",
    "process_identity",
    "segment_creator",
]

SHM_DIR = Path("/dev/shm")
PAGE = mmap.ALLOCATIONGRANULARITY
_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,63}$")
_NAME_RE = re.compile(
    r"^(?P<prefix>[A-Za-z][A-Za-z0-9-]{0,63})_(?P<pid>\d{1,10})_(?P<start>\d{1,20})_[0-9a-f]{32}$"
)


_log = logging.getLogger(__name__)


def page_align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


# -- processes ----------------------------------------------------------------------------------


def _stat_start_time(pid: int) -> int | None:
    """Start time (clock ticks after boot) of a live process; None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X", b"x"):  # zombie / dead: killed, not yet reaped
        return None
    return int(fields[19])


def process_identity(pid: int | None = None) -> tuple[int, int]:
    """(pid, start time) of a process: the pair stays unique when the OS reuses pids."""
    pid = os.getpid() if pid is None else pid
    return pid, _stat_start_time(pid) or 0


def process_alive(pid: int, start_time: int = 0) -> bool:
    """True if `pid` runs (not a zombie) and, when `start_time` is given, is the same process."""
    if pid <= 0:
        return False
    if not Path("/proc/self/stat").exists():  # pragma: no cover - non-Linux fallback
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    started = _stat_start_time(pid)
    if started is None:
        return False
    return not start_time or started == start_time


_fence_lock = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier, from Python.

    Lock acquire/release is an atomic read-modify-write (``lock cmpxchg`` on x86-64, acquire /
    release pairs on arm64): stores before it become visible before stores after it, which is
    what a shared-memory "data, then sequence number" publication needs.
    """
    with _fence_lock:
        pass


# -- segments -----------------------------------------------------------------------------------


def segment_creator(name: str) -> tuple[int, int] | None:
    """(pid, start time) encoded in a segment name of ours; None for foreign names."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    return int(match["pid"]), int(match["start"])


# struct flock (Linux, 64-bit): l_type, l_whence, l_start, l_len, l_pid
_FLOCK = struct.Struct("hhqqi4x")
_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)


def _try_lock(fd: int, kind: int) -> bool:
    """Take an open-file-description lock on byte 0 without waiting; False if a conflicting one is held.

    Independent of `locked`'s flock, released only when the last descriptor of this open file
    closes (so closing another descriptor of the file, as a reader in the same process does,
    keeps it), and dropped by the kernel when the holder dies.
    """
    if _OFD_SETLK is None:  # pragma: no cover - not Linux: liveness falls back to the pid
        return True
    try:
        fcntl.fcntl(fd, _OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, 0, 1, 0))
    except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held by someone else
        return False
    return True


#: Segments this process created and has not unlinked yet: path -> creator pid.
_owned: dict[str, int] = {}


def _unlink_if_creator(path: str, creator_pid: int) -> None:
    # Runs from a finalizer, at exit or from a signal handler: a forked child must not unlink
    # its parent's segment.
    if os.getpid() == creator_pid:
        _owned.pop(path, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _unlink_owned() -> None:
    for path, creator in list(_owned.items()):
        _unlink_if_creator(path, creator)


add_cleanup(_unlink_owned)  # a signal that ends the process unlinks its segments first


class SharedSegment:
    """A shared-memory file in /dev/shm, mapped into this process.

    `create` makes a new one (this process owns it and unlinks it); `attach` maps one that
    another process created. `tensor()` gives zero-copy torch views.
    """

    def __init__(self, name: str, fd: int, size: int, owner: bool, readonly: bool, map_whole: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self.readonly = readonly
        self._fd: int | None = fd
        self._maps: list[mmap.mmap] = []
        self._lent: dict[int, weakref.finalize[[], mmap.mmap]] = {}  # read-only mappings, by id
        self._views: list[memoryview] = []
        self._whole: memoryview | None = None
        self._unlinked = False
        self._thread_lock = threading.Lock()
        self._finalizer: weakref.finalize[[str, int], SharedSegment] | None = None
        if owner:
            self._finalizer = weakref.finalize(self, _unlink_if_creator, str(self.path), os.getpid())
        if map_whole:
            self._whole = self.map_region(0, size, readonly=readonly)

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name

    # -- construction -------------------------------------------------------------------
    @classmethod
    def create(cls, nbytes: int, prefix: str = "rlfleet", map_whole: bool = True) -> SharedSegment:
        """A new zero-filled segment of `nbytes`, mode 0600, with a fresh unguessable name."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"segment size must be a positive int, got {nbytes!r}")
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"segment prefix must match {_PREFIX_RE.pattern}, got {prefix!r}")
        pid, start = process_identity()
        for _ in range(3):
            name = f"{prefix}_{pid}_{start}_{secrets.token_hex(16)}"
            path = SHM_DIR / name
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            # the creator's lifetime lock; a reclaim that found the fresh file unlocked (another
            # PID namespace sees no creator pid) holds it now or already unlinked the name
            if not _try_lock(fd, fcntl.F_RDLCK) or os.fstat(fd).st_nlink == 0:
                os.close(fd)
                continue
            try:
                os.fchmod(fd, 0o600)
                os.ftruncate(fd, nbytes)
                segment = cls(name, fd, nbytes, owner=True, readonly=False, map_whole=map_whole)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                raise
            _owned[str(path)] = pid
            install_termination_cleanup()
            return segment
        raise WeightSyncError(f"could not create a segment in {SHM_DIR}: each was reclaimed as it was made")

    @classmethod
    def attach(cls, name: str, readonly: bool = False, map_whole: bool = True) -> SharedSegment:
        """Map a segment another process created; `readonly` maps it without write access."""
        if not isinstance(name, str) or _NAME_RE.match(name) is None:
            raise ValueError(f"not an rlfleet shared-memory segment name: {name!r:.120}")
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(SHM_DIR / name, flags)
        except FileNotFoundError:
            raise WeightSyncError(f"shared-memory segment {name!r} does not exist (creator gone?)") from None
        try:
            info = os.fstat(fd)
            mode, size = stat.S_IMODE(info.st_mode), info.st_size
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or mode != 0o600:
                raise UnsafeSegmentError(
                    f"shared-memory segment {name!r} is not private to this user (owner uid {info.st_uid}, "
                    f"mode {mode:o}; expected uid {os.geteuid()}, mode 600): refusing to map it"
                )
            if size < 1:
                raise WeightSyncError(f"shared-memory segment {name!r} is empty")
            return cls(name, fd, size, owner=False, readonly=readonly, map_whole=map_whole)
        except BaseException:
            os.close(fd)
            raise

    # -- mappings -----------------------------------------------------------------------
    def map_region(self, offset: int, nbytes: int, readonly: bool | None = None) -> memoryview:
        """Map `nbytes` at `offset` (page aligned); read-only when asked (or when attached so)."""
        if self._fd is None:
            raise WeightSyncError(f"segment {self.name!r} is closed")
        ro = self.readonly if readonly is None else readonly
        if not ro and self.readonly:
            raise ValueError(f"segment {self.name!r} was attached read-only")
        if offset % PAGE or offset < 0 or nbytes < 1 or offset + nbytes > self.size:
            raise ValueError(
                f"region [{offset}, {offset + nbytes}) of segment {self.name!r} (size {self.size}) "
                f"must be non-empty, inside it and start on a {PAGE}-byte page"
            )
        prot = mmap.PROT_READ if ro else mmap.PROT_READ | mmap.PROT_WRITE
        mapping = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED, prot=prot, offset=offset)
        if ro:  # lent memory while it is mapped: a consumer copies it before code that may write it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
            what = f"a read-only mapping of shared-memory segment {self.name!r}"
            self._lent[id(mapping)] = weakref.finalize(mapping, lend(start, nbytes, what))
        view = memoryview(mapping)
        self._maps.append(mapping)
        self._views.append(view)
        return view

    @property
    def buffer(self) -> memoryview:
        if self._whole is None:
            raise WeightSyncError(f"segment {self.name!r} has no whole-segment mapping")
        return self._whole

    def tensor(
        self,
        offset: int = 0,
        nbytes: int | None = None,
        dtype: torch.dtype = torch.uint8,
        region: memoryview | None = None,
    ) -> torch.Tensor:
        """A zero-copy 1-d tensor over bytes [offset, offset + nbytes) of a mapping.

        The tensor pins the mapping (it holds a memoryview of it), so the memory stays mapped
        as long as any tensor over it lives, whatever `close` is called.
        """
        source = self.buffer if region is None else region
        nbytes = len(source) - offset if nbytes is None else nbytes
        if offset < 0 or nbytes < 0 or offset + nbytes > len(source):
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside the mapping ({len(source)})")
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        if offset % dtype.itemsize or nbytes % dtype.itemsize:
            raise ValueError(f"offset/size not aligned to {dtype}")
        with warnings.catch_warnings():
            # Read-only mappings: torch warns that it cannot mark the tensor read-only; the OS does.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(source[offset : offset + nbytes], dtype=dtype)

    # -- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        """Drop this process's mappings (those still viewed by tensors unmap when they die)."""
        self._whole = None
        for view in self._views:
            with contextlib.suppress(BufferError):  # an array still exports it
                view.release()
        for mapping in self._maps:
            with contextlib.suppress(BufferError):  # tensors still point into it: GC unmaps later
                mapping.close()
                lent = self._lent.pop(id(mapping), None)
                if lent is not None:
                    lent()  # unmapped: no longer lent (else when the mapping is collected)
        self._views.clear()
        self._maps.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def unlink(self) -> None:
        """Remove the name (mappings stay valid until unmapped; the name is never reused)."""
        if not self._unlinked:
            self._unlinked = True
            _owned.pop(str(self.path), None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            if self._finalizer is not None:
                self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._fd is None

    def fileno(self) -> int:
        if self._fd is None:
            raise WeightSyncError(f"segment {self.name!r} is closed")
        return self._fd

    @contextlib.contextmanager
    def locked(self, deadline: Deadline, what: str) -> Iterator[None]:
        """An exclusive lock on the segment across processes (flock; freed if its holder dies)."""
        with self._thread_lock:  # flock is per open file: threads of one process need their own lock
            backoff = Backoff()
            while True:
                try:
                    fcntl.flock(self.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline.expired:
                        raise deadline.error(f"locking segment {self.name!r} for {what}") from None
                    backoff.sleep(deadline.remaining())
            try:
                yield
            finally:
                fcntl.flock(self.fileno(), fcntl.LOCK_UN)

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return (
            f"SharedSegment({self.name!r}, {self.size} bytes, {role}{', read-only' if self.readonly else ''})"
        )


def cleanup_stale_segments(prefix: str = "rlfleet", directory: Path | str = SHM_DIR) -> list[str]:
    """Unlink this user's segments whose creator is dead (killed before it could clean up).

    `prefix` selects segments created with that prefix or a ``prefix-...`` one: the default
    covers every rlfleet segment, whichever run or group made it, so the next run on a node
    reclaims what a killed run left (a new `SharedBuffer` does this itself). A segment is dead
    when nobody holds its creator's lock (any PID namespace sharing /dev/shm) and no process
    here has the pid and start time in its name; live segments, other users' files and names
    that are not ours are left alone. Returns the names removed.
    """
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"segment prefix must match {_PREFIX_RE.pattern}, got {prefix!r}")
    removed: list[str] = []
    base = Path(directory)
    try:
        entries = list(base.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = _NAME_RE.match(entry.name)
        if match is None:
            continue
        if match["prefix"] != prefix and not match["prefix"].startswith(prefix + "-"):
            continue  # "rlfleet" covers "rlfleet-ipc" too, not "rlfleetx"
        if _reclaim_if_dead(entry, int(match["pid"]), int(match["start"])):
            removed.append(entry.name)
    if removed:
        _log.info("reclaimed %d shared-memory segment(s) of dead creators: %s", len(removed), removed)
    return removed


def _reclaim_if_dead(path: Path, pid: int, start: int) -> bool:
    """Unlink `path` if it is ours (this user's regular file) and its creator is dead."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # gone, another user's, a link
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return False
        # the write lock conflicts with the creator's: held while we unlink, so a creator that
        # opened this very name a moment ago fails to lock it and takes another name
        if not _try_lock(fd, fcntl.F_WRLCK) or process_alive(pid, start):
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)
