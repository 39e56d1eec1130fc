"""Shared-memory segments: private, unguessable, never reused, cleaned up after crashes."""

from __future__ import annotations

import gc
import os
import re
import signal
import stat

import pytest
import shm_workers as w
import torch

from rlfleet.weightsync import SharedSegment, WeightSyncError, cleanup_stale_segments, process_alive
from rlfleet.weightsync._shm import SHM_DIR, process_identity, segment_creator


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
    with SharedSegment.create(4096) as mine, SharedSegment.create(4096, prefix="rlfleetx") as other:
        assert cleanup_stale_segments(prefix="rlfleet-ipc") == []
        removed = cleanup_stale_segments()
        assert other.path.exists()
        assert name in removed
        assert mine.name not in removed
        assert mine.path.exists()
    assert not (SHM_DIR / name).exists()


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
