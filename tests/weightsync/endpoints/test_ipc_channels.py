"""A worker's IPC channels across versions (`IpcChannelWriter`/`IpcChannelReader` through
`WorkerWeights`): what policygroup's "cuda_ipc" step runs, in real processes, without Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import weightsync_dist_workers as w
from ipc_channel_workers import expected_sum, make_module, scenario_ipc_channels

from rlfleet.weightsync import IpcChannelReader, IpcChannelWriter, Layout, WeightSyncError


def check_run(results: dict[int, Any], readers: int) -> None:
    writer = results[0]
    for version in (1, 2, 3, 5):
        assert writer[f"v{version}"]["ok"], writer[f"v{version}"]
    assert writer["v4"]["type"] == "LayoutMismatchError", writer["v4"]
    assert writer["closed"]
    assert writer["new_channel"]
    for rank in range(1, readers + 1):
        got = results[rank]
        for version in (1, 2, 3):
            assert got[f"v{version}"]["ok"], got[f"v{version}"]
            assert got[f"v{version}"]["sum"] == expected_sum(version)  # bit-exact
        # the writer closed its channel: the readers learn it at once (not at their deadline)
        assert got["v4"]["type"] == "PeerLostError", got["v4"]
        assert "closed by its sender" in got["v4"]["message"]
        assert (got["v4"]["applied"], got["v4"]["sum"]) == (3, expected_sum(3))  # kept
        assert got["left"]
        assert got["v5"]["ok"], got["v5"]
        assert got["v5"]["sum"] == expected_sum(5)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["Double", "None"])
def test_channel_kept_across_versions_closed_on_failure_and_made_again(tmp_path: Path, strategy: str) -> None:
    results = w.run_ranks(scenario_ipc_channels, 3, str(tmp_path / "name"), "host", strategy, timeout=120.0)
    check_run(results, 2)


def test_bad_arguments_are_named() -> None:
    layout = Layout.from_state_dict(make_module("cpu").state_dict(), 4096)
    writer = IpcChannelWriter()
    with pytest.raises(ValueError, match="IPC backend must be one of"):
        writer.channel(["r0"], layout, "gpu")
    with pytest.raises(ValueError, match="at least one reader"):
        writer.channel([], layout, "host")
    with pytest.raises(WeightSyncError, match="not open on this writer"):
        writer.send("nope", make_module("cpu").state_dict(), 1, 1.0)  # type: ignore[arg-type]
    IpcChannelReader().close()  # nothing attached: nothing to do


@pytest.mark.gpu
@pytest.mark.timeout(240)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_channels_over_real_cuda_handles(tmp_path: Path) -> None:
    """On a GPU, the scenario above with backend "cuda": the writer's model and the slots on
    cuda:0, two reader processes mapping the slots by IPC handle into endpoints whose modules
    live on cuda:0 (device to device, no host copy of the weights); every version bit-exact,
    the failed version closing the channel and the next one made again. This is the endpoint
    level of policygroup's same-node GPU path (its Ray calls only wrap these)."""
    pytest.importorskip("cupy")
    for strategy in ("Double", "None"):
        path = str(tmp_path / f"name-{strategy}")
        results = w.run_ranks(scenario_ipc_channels, 3, path, "cuda", strategy, timeout=200.0)
        check_run(results, 2)
