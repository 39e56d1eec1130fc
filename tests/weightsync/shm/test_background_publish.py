"""`SharedBuffer.publish(..., wait=False)`: the copy into the free slot is the snapshot, taken on a
background thread; a reader process binds exactly what was published, though the trainer changed
its weights right after the fence; every version is committed in order (none skipped); a failed
background publish is raised by the next one and leaves the newest version readable."""

from __future__ import annotations

import pytest
import shm_workers as shm
import torch

from rlfleet.weightsync import LayoutMismatchError, SharedBuffer, SharedBufferReader, VersionError, checksum


def scribble(state: dict[str, torch.Tensor], version: int) -> None:
    """Overwrite every tensor in place with `version`'s values (what an optimizer step does)."""
    fresh = shm.make_state(version)
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(fresh[name])


@pytest.mark.timeout(120)
def test_a_reader_process_binds_the_snapshot_not_what_the_trainer_wrote_after_the_fence() -> None:
    state = {k: v.clone() for k, v in shm.make_state(1).items()}
    layout = shm.layout_of(state)
    queue, commands = shm.context().Queue(), shm.context().Queue()
    with SharedBuffer(layout, 1, slots=3) as writer, shm.processes() as procs:
        shm.start(procs, shm.shared_reader, writer.name, commands, queue)
        for version in (1, 2, 3):
            scribble(state, version)
            handle = writer.publish(state, version, wait=False)
            handle.snapshot_done()  # the fence: the trainer's next update may land now
            scribble(state, 100 + version)
            assert handle.result() == version
            commands.put(version)
            _, ok, (bound, digest, inside, _) = queue.get(timeout=shm.TIMEOUT)
            assert ok == "ok"
            assert (bound, inside) == (version, True)
            assert digest == checksum(shm.make_state(version))
        commands.put("stop")


def test_background_publishes_commit_every_version_in_order() -> None:
    state = shm.make_state(0)
    with SharedBuffer(shm.layout_of(state), 1, slots=3) as writer:
        handles = [writer.publish(shm.make_state(v), v, wait=False) for v in (1, 2, 3)]
        assert [h.result() for h in handles] == [1, 2, 3]
        assert not any(h.skipped for h in handles)
        assert writer.latest_version() == 3
        with pytest.raises(VersionError, match="does not fit"):
            writer.publish(state, -1, wait=False)  # refused at once, nothing started


def test_a_failed_background_publish_is_raised_by_the_next_and_the_newest_stays_readable() -> None:
    state = shm.make_state(1)
    layout = shm.layout_of(state)
    with SharedBuffer(layout, 1) as writer:
        writer.publish(state, 1)
        missing = {k: v for k, v in shm.make_state(2).items() if k != next(iter(state))}
        handle = writer.publish(missing, 2, wait=False)
        assert handle.wait(30)  # failed in the background; nobody looked
        with pytest.raises(LayoutMismatchError, match="missing"):
            writer.publish(shm.make_state(3), 3)
        assert writer.latest_version() == 1
        reader = SharedBufferReader.attach(writer.name)
        try:
            assert reader.refresh() == 1
            assert checksum(reader.tensors()) == checksum(state)
        finally:
            reader.close()
        writer.publish(shm.make_state(3), 3)  # raised once: the buffer goes on
        assert writer.latest_version() == 3
