"""Shared-memory segments: private, unguessable, never reused, cleaned up after crashes."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import shm_workers as w
import torch

from rlfleet.weightsync import (
    SharedBuffer,
    SharedBufferReader,
    SharedSegment,
    ShmRingReceiver,
    ShmRingSender,
    UnsafeSegmentError,
    WeightSyncError,
    cleanup_stale_segments,
    process_alive,
)
from rlfleet.weightsync.shm._shm import SHM_DIR, process_identity, segment_creator

NOBODY = 65534


def test_segment_is_private_and_unguessable() -> None:
    with SharedSegment.create(10_000) as a, SharedSegment.create(10_000) as b:
        for seg in (a, b):
            mode = os.stat(seg.path).st_mode
            assert stat.S_IMODE(mode) == 0o600
            assert seg.path.parent == SHM_DIR
            match = re.fullmatch(r"rlfleet_(\d+)_(\d+)_([0-9a-f]{32})", seg.name)
            assert match is not None
            assert segment_creator(seg.name) == process_identity()
        assert a.name != b.name
        assert a.name.rsplit("_", 1)[1] != b.name.rsplit("_", 1)[1]
    assert not a.path.exists()
    assert not b.path.exists()


def test_views_are_zero_copy_across_mappings() -> None:
    with SharedSegment.create(8192) as seg:
        other = SharedSegment.attach(seg.name)
        mine = seg.tensor(4096, 4096, dtype=torch.int32)
        theirs = other.tensor(4096, 4096, dtype=torch.int32)
        mine[:10] = torch.arange(10, dtype=torch.int32)
        assert theirs[:10].tolist() == list(range(10))
        other.close()


def test_tensors_keep_their_mapping_alive_after_close() -> None:
    seg = SharedSegment.create(4096)
    view = seg.tensor()
    seg.close()
    seg.unlink()
    view[:4] = 7  # still mapped: the tensor pins the mapping
    assert view[:4].tolist() == [7, 7, 7, 7]
    del view
    gc.collect()


def test_owner_unlinks_when_collected() -> None:
    seg = SharedSegment.create(4096)
    path = seg.path
    assert path.exists()
    del seg
    gc.collect()
    assert not path.exists()


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "rlfleet_1_2_xyz", "", "a/b", "rlfleet_1_2_" + "0" * 31]
)
def test_attach_rejects_foreign_names(name: str) -> None:
    with pytest.raises(ValueError, match="not an rlfleet"):
        SharedSegment.attach(name)


def test_attach_after_unlink_is_a_clear_error() -> None:
    seg = SharedSegment.create(4096)
    name = seg.name
    seg.close()
    seg.unlink()
    with pytest.raises(WeightSyncError, match="does not exist"):
        SharedSegment.attach(name)


def test_bad_sizes_and_prefixes() -> None:
    with pytest.raises(ValueError, match="positive"):
        SharedSegment.create(0)
    with pytest.raises(ValueError, match="prefix"):
        SharedSegment.create(10, prefix="../x")
    with SharedSegment.create(4096 * 2, map_whole=False) as seg, pytest.raises(ValueError, match="page"):
        seg.map_region(100, 10)


def test_readonly_mapping_cannot_be_written() -> None:
    with SharedSegment.create(4096) as seg:
        seg.tensor()[0] = 1
        ro = SharedSegment.attach(seg.name, readonly=True)
        with pytest.raises(ValueError, match="read-only"):
            ro.map_region(0, 4096, readonly=False)
        ro.close()
        with w.processes() as procs:
            proc = w.start(procs, w.write_readonly, seg.name)
            proc.join(w.TIMEOUT)
        assert proc.exitcode == -signal.SIGSEGV
        assert int(seg.tensor()[0]) == 1


def test_stale_segments_of_dead_creators_are_cleaned_up() -> None:
    queue = w.context().Queue()
    with w.processes() as procs:
        proc = w.start(procs, w.create_segment_and_die, queue)
        name = queue.get(timeout=w.TIMEOUT)
        proc.join(w.TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL
    assert (SHM_DIR / name).exists(), "a killed creator cannot clean up"
    assert not process_alive(proc.pid or 0)
    mine = SharedSegment.create(4096, prefix=w.TEST_PREFIX)
    other = SharedSegment.create(4096, prefix=f"{w.TEST_PREFIX}x")
    with mine, other:
        assert cleanup_stale_segments(prefix=f"{w.TEST_PREFIX}-ipc") == []
        removed = cleanup_stale_segments(w.TEST_PREFIX)
        assert other.path.exists()
        assert name in removed
        assert mine.name not in removed
        assert mine.path.exists()
    assert not (SHM_DIR / name).exists()
    with pytest.raises(ValueError, match="prefix"):
        cleanup_stale_segments("../x")


def test_process_alive_sees_zombies_and_reused_pids() -> None:
    pid, start = process_identity()
    assert process_alive(pid, start)
    assert not process_alive(pid, start + 1), "same pid, other start time: another process"
    assert not process_alive(0)
    with w.processes() as procs:
        proc = w.start(procs, os.getpid)
        sentinel = proc.sentinel
        import multiprocessing.connection

        multiprocessing.connection.wait([sentinel], w.TIMEOUT)
        assert proc.pid is not None
        assert not process_alive(proc.pid), "an exited child not yet reaped is a zombie: dead"


# -- liveness across PID namespaces, owner checks, reclaim by the next run -----------------------
_NAMESPACED_CREATOR = """
import os, sys
from rlfleet.weightsync import SharedSegment
segment = SharedSegment.create(4096, prefix=sys.argv[1])
print(os.getpid(), segment.name, flush=True)
sys.stdin.readline()
os._exit(0)  # dies without cleaning up, as a killed process would
"""


@contextlib.contextmanager
def _creator_in_another_pid_namespace(prefix: str) -> Iterator[tuple[int, str, subprocess.Popen[str]]]:
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    unshare = ["unshare", "--pid", "--fork", "--mount-proc"]
    command = [*unshare, sys.executable, "-c", _NAMESPACED_CREATOR, prefix]
    pipe = subprocess.PIPE
    proc = subprocess.Popen(command, stdin=pipe, stdout=pipe, stderr=pipe, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        if len(line) != 2:
            proc.kill()
            _, err = proc.communicate(timeout=w.TIMEOUT)
            if "Operation not permitted" in err:
                pytest.skip(f"cannot create a PID namespace here: {err.strip()[:200]}")
            raise AssertionError(f"namespaced creator failed: {err}")
        yield int(line[0]), line[1], proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=w.TIMEOUT)


def test_cleanup_keeps_live_segments_of_a_creator_in_another_pid_namespace() -> None:
    """A container sharing /dev/shm (--ipc=host): its creator's pid means nothing here."""
    prefix = f"{w.TEST_PREFIX}-ns"
    with _creator_in_another_pid_namespace(prefix) as (inner_pid, name, proc):
        assert inner_pid == 1, "the creator runs in its own PID namespace"
        creator = segment_creator(name)
        assert creator is not None
        assert not process_alive(*creator), "its pid is not (that process) here"
        assert name not in cleanup_stale_segments(prefix)
        assert name not in cleanup_stale_segments(w.TEST_PREFIX)
        assert (SHM_DIR / name).exists()
        with SharedSegment.attach(name) as seen:  # still usable
            assert seen.size == 4096
        assert proc.stdin is not None
        proc.stdin.write("die\n")
        proc.stdin.flush()
        proc.wait(w.TIMEOUT)
        assert (SHM_DIR / name).exists(), "os._exit: no cleanup"
        assert cleanup_stale_segments(prefix) == [name]  # dead now: reclaimed


def _dead_name(prefix: str) -> Path:
    """A file named like a segment of a dead creator (pid 0 never runs)."""
    return SHM_DIR / f"{prefix}_0_1_{os.urandom(16).hex()}"


def test_cleanup_only_reclaims_this_users_segments() -> None:
    prefix = f"{w.TEST_PREFIX}-owner"
    theirs, ours = _dead_name(prefix), _dead_name(prefix)
    for path in (theirs, ours):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    try:
        os.chown(theirs, NOBODY, NOBODY)
        assert cleanup_stale_segments(prefix) == [ours.name]
        assert theirs.exists()
    finally:
        for path in (theirs, ours):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


@pytest.mark.parametrize("tamper", ["mode", "owner", "impostor"])
def test_attach_refuses_a_segment_that_is_not_private(tamper: str) -> None:
    """Names in /dev/shm are listable: an unlinked name can be re-created by anyone."""
    layout = w.layout_of(w.make_state(1), w.BUCKET)
    with SharedBuffer(layout, 1) as shared, ShmRingSender(layout, 1) as ring:
        attach = {
            shared.name: lambda n: SharedBufferReader.attach(n, timeout_s=5),
            ring.name: lambda n: ShmRingReceiver.attach(n, 0),
        }
        for name, open_as_reader in attach.items():
            path = SHM_DIR / name
            if tamper == "mode":
                os.chmod(path, 0o644)
            elif tamper == "owner":
                os.chown(path, NOBODY, NOBODY)
            else:  # the name unlinked, then made again by someone else
                path.unlink()
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.ftruncate(fd, 1 << 20)
                os.fchown(fd, NOBODY, NOBODY)
                os.close(fd)
            for attempt in (open_as_reader, SharedSegment.attach):
                with pytest.raises(UnsafeSegmentError, match="not private to this user"):
                    attempt(name)
            if tamper == "impostor":
                path.unlink()
            else:
                os.chmod(path, 0o600)
                os.chown(path, os.geteuid(), os.getegid())
                open_as_reader(name).close()  # private again: accepted


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("previous", ["default", "exit", "carry_on"])
def test_segments_are_unlinked_when_sigterm_or_sighup_ends_their_creator(sig: int, previous: str) -> None:
    ctx = w.context()
    queue, commands = ctx.Queue(), ctx.Queue()
    with w.processes() as procs:
        proc = w.start(procs, w.segment_owner, queue, commands, f"{w.TEST_PREFIX}-sig", previous)
        kind, names = queue.get(timeout=w.TIMEOUT)
        assert kind == "names"
        assert len(names) == 3
        assert all((SHM_DIR / n).exists() for n in names)
        os.kill(proc.pid or 0, sig)
        if previous != "default":
            assert queue.get(timeout=w.TIMEOUT) == ("handled", sig)  # the previous handler ran
        if previous == "carry_on":  # it chose to keep running: it keeps its segments
            assert proc.is_alive()
            assert all((SHM_DIR / n).exists() for n in names)
            commands.put("exit")
        proc.join(w.TIMEOUT)
    assert proc.exitcode == {"default": -sig, "exit": 3, "carry_on": 0}[previous]
    assert [n for n in names if (SHM_DIR / n).exists()] == []


def test_the_next_run_on_a_node_reclaims_what_a_killed_run_left() -> None:
    ctx = w.context()
    queue, commands = ctx.Queue(), ctx.Queue()
    with w.processes() as procs:
        killed = w.start(procs, w.create_buffer_and_die, queue, f"{w.TEST_PREFIX}-runa")
        left = queue.get(timeout=w.TIMEOUT)
        killed.join(w.TIMEOUT)
        assert killed.exitcode == -signal.SIGKILL
        assert all((SHM_DIR / n).exists() for n in left), "a SIGKILLed run cannot clean up"
        alive = w.start(procs, w.segment_owner, queue, commands, f"{w.TEST_PREFIX}-runc", "default")
        _, running = queue.get(timeout=w.TIMEOUT)
        w.start(procs, w.new_run_writer, queue, f"{w.TEST_PREFIX}-runb")  # its writer reclaims
        queue.get(timeout=w.TIMEOUT)
        assert [n for n in left if (SHM_DIR / n).exists()] == []
        assert all((SHM_DIR / n).exists() for n in running), "a live run's segments stay"
        commands.put("exit")
        alive.join(w.TIMEOUT)
