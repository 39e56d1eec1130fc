"""`stand_down_refit_watchdog()` (NeMo RL): a refit blocked on a stalled peer, in real processes.

A generation worker's `nccl_reshard_refit(refit_timeout_s=5)` waits on a trainer that is alive
but silent and exits 10 s into the refit. Stood down at 2 s, the refit outlives its deadline
and ends by the peer's exit (PeerLostError); left alone it ends at its 5 s deadline
(SyncTimeoutError). Either way the previous weights and version stay.
"""

from __future__ import annotations

from typing import Any

import pytest
import refit_watchdog_procs as procs

STOOD, PLAIN = ("eval", True), ("eval", False)


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, bool], dict[str, Any]]:
    return procs.run()


@pytest.mark.timeout(300)
def test_both_sides_refit_version_one_first(results: dict[tuple[str, bool], dict[str, Any]]) -> None:
    for stand_down in (True, False):
        assert results[("train", stand_down)]["v1_version"] == 1
        gen = results[("eval", stand_down)]
        assert gen["v1_version"] == 1
        assert gen["v1_exact"]


@pytest.mark.timeout(300)
def test_stand_down_returns_at_once_with_the_armed_refit(
    results: dict[tuple[str, bool], dict[str, Any]],
) -> None:
    gen = results[STOOD]
    assert gen["stood_down"] >= 1
    # it returned while the refit it stood down was still blocked: it waited for nothing
    assert gen["refit_running_after_stand_down"]
    assert gen["stand_down_s"] < 1.0, gen["stand_down_s"]


@pytest.mark.timeout(300)
def test_stood_down_refit_outlives_its_deadline_and_ends_by_peer_loss(
    results: dict[tuple[str, bool], dict[str, Any]],
) -> None:
    gen = results[STOOD]
    assert gen["refit_running_past_deadline"]  # the 5 s deadline did not fire
    assert gen["v2"]["type"] == "PeerLostError", gen["v2"]
    assert gen["peer_had_exited"]  # it ended because the peer went, not by a clock
    assert gen["fired"] == 0
    assert gen["watch_stood_down"] == 1
    assert gen["v2_seconds"] >= procs.PEER_EXITS_AT_S
    assert gen["version_after"] == 1
    assert gen["intact"]


@pytest.mark.timeout(300)
def test_without_the_stand_down_the_refit_ends_at_its_deadline(
    results: dict[tuple[str, bool], dict[str, Any]],
) -> None:
    gen = results[PLAIN]
    assert gen["v2"]["type"] == "SyncTimeoutError", gen["v2"]
    assert "5.000s deadline" in gen["v2"]["message"]
    assert not gen["peer_had_exited"]
    assert gen["v2_seconds"] >= procs.REFIT_TIMEOUT_S
    assert gen["fired"] == 1
    assert gen["version_after"] == 1
    assert gen["intact"]


@pytest.mark.timeout(300)
def test_reshard_transport_state_is_json_safe(results: dict[tuple[str, bool], dict[str, Any]]) -> None:
    import json

    state = results[PLAIN]["state"]
    assert json.loads(json.dumps(state)) == state
    assert state["version"] == 1  # the last refit that landed
    assert state["role"] == "gen"
    assert state["groups"] == {"0": {"rank": 1, "size": 2}}
    assert state["last"]["version"] == 1
