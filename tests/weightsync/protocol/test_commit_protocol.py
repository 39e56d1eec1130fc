"""The commit protocol over real gloo: nothing is reported applied that a receiver did not apply,
bad input is refused before anything is sent, and one version is assembled from two senders."""

from __future__ import annotations

from typing import Any

import commit_workers as cw
import pytest
import weightsync_dist_workers as w

from rlfleet.weightsync import checksum


def _expected(version: int) -> str:
    return checksum(w.make_state(version))


# -- a commit that fails is refused before the vote ---------------------------------------------
@pytest.fixture(scope="module")
def stuck() -> dict[int, Any]:
    return w.run_ranks(cw.scenario_stuck_request, 3, timeout=150.0)


@pytest.mark.timeout(200)
def test_a_commit_that_cannot_happen_fails_the_version_and_names_the_rank(stuck: dict[int, Any]) -> None:
    sent = stuck[0]["v2"]
    assert not sent["ok"], "the sender must not report a version a receiver did not apply"
    assert sent["type"] == "SyncAbortedError"
    assert "rank 2 could not prepare its commit" in sent["message"]
    stuck_rank = stuck[2]["v2"]
    assert stuck_rank["type"] == "SyncTimeoutError"
    assert "in-flight requests" in stuck_rank["message"]
    assert stuck[1]["v2"]["type"] == "SyncAbortedError"
    assert "rank 2" in stuck[1]["v2"]["message"]
    for rank in (1, 2):
        assert stuck[rank]["v2"]["applied"] == 1  # every receiver keeps the previous version
        assert stuck[rank]["v2"]["checksum"] == _expected(1)
        assert stuck[rank]["pending_after_v2"] is None  # the prepared commit was released


@pytest.mark.timeout(200)
def test_the_group_stays_usable_after_a_failed_commit(stuck: dict[int, Any]) -> None:
    assert stuck[0]["v1"]["ok"], stuck[0]
    assert stuck[0]["v3"]["ok"], stuck[0]
    assert stuck[0]["broken"] is None
    for rank in (1, 2):
        assert stuck[rank]["v3"]["ok"], stuck[rank]["v3"]
        assert stuck[rank]["v3"]["applied"] == 3
        assert stuck[rank]["v3"]["checksum"] == _expected(3)
        assert stuck[rank]["broken"] is None


# -- the sender checks first, and sends views exactly --------------------------------------------
@pytest.fixture(scope="module")
def checks() -> dict[int, Any]:
    return w.run_ranks(cw.scenario_sender_checks, 3, timeout=150.0)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("label", ["float", "bool", "huge", "negative"])
def test_a_bad_version_is_refused_before_anything_is_sent(checks: dict[int, Any], label: str) -> None:
    got = checks[0][label]
    assert got["type"] == "VersionError", got
    for rank in (1, 2):
        assert checks[rank]["first_call"] == ("begin", 1)  # the receivers saw only the good version
    assert checks[0]["broken"] is None


@pytest.mark.timeout(200)
def test_conjugate_and_negative_views_travel_bit_exact(checks: dict[int, Any]) -> None:
    assert checks[0]["views"]["ok"], checks[0]["views"]
    expected = checksum(cw.resolved(cw.tricky_state(1)))
    for rank in (1, 2):
        assert checks[rank]["views"]["ok"], checks[rank]["views"]
        assert checks[rank]["views"]["checksum"] == expected


@pytest.mark.timeout(200)
def test_a_layout_mismatch_carries_a_quoted_name_as_data(checks: dict[int, Any]) -> None:
    got = checks[2]["quoted"]
    assert got["type"] == "LayoutMismatchError"
    assert got["parameter"] == "it's.w"  # the first differing parameter, as data, quote and all
    assert "layers.3.w" in got["message"]
    assert checks[0]["quoted"]["type"] == "LayoutMismatchError"
    assert checks[1]["quoted"]["type"] == "SyncAbortedError"
    assert checks[1]["broken"] is None
    assert checks[2]["broken"] is None


# -- one version from two senders ----------------------------------------------------------------
@pytest.fixture(scope="module")
def two() -> dict[int, Any]:
    return w.run_ranks(cw.scenario_two_senders, 4, timeout=240.0, expect_dead=(1,))


@pytest.mark.timeout(300)
def test_two_senders_each_send_half_and_every_receiver_is_bit_exact(two: dict[int, Any]) -> None:
    assert two[0]["v1"]["ok"], two[0]["v1"]
    for rank in cw.RECEIVERS:
        got = two[rank]["v1"]
        assert got["a"]["ok"], got
        assert got["b"]["ok"], got
        assert got["applied"] == 1
        assert got["checksum"] == _expected(1)


@pytest.mark.timeout(300)
def test_a_bucket_missing_from_one_sender_names_that_sender(two: dict[int, Any]) -> None:
    assert not two[0]["v2"]["ok"]  # sender a is told too: nobody applied version 2
    assert "rank 1" in two[0]["v2"]["message"]  # (whether a's part was still taking buckets
    assert "rank 2" in two[0]["v2"]["message"]  # or already preparing when b's part failed)
    for rank in cw.RECEIVERS:
        got = two[rank]["v2"]
        assert got["b"]["type"] == "IncompleteSyncError", got
        assert "sender 'b'" in got["b"]["message"]
        assert not got["a"]["ok"]
        assert "sender 'b'" in got["a"]["message"]
        assert got["applied"] == 1
        assert got["checksum"] == _expected(1)
    for rank in cw.RECEIVERS:  # and the groups carry the next version
        assert two[rank]["v3"]["applied"] == 3
        assert two[rank]["v3"]["checksum"] == _expected(3)
    assert two[0]["v3"]["ok"], two[0]["v3"]


@pytest.mark.timeout(300)
def test_a_sender_killed_mid_version_leaves_the_previous_version_everywhere(two: dict[int, Any]) -> None:
    assert not two[0]["v4"]["ok"], "sender a must not report version 4 applied"
    for rank in cw.RECEIVERS:
        got = two[rank]["v4"]
        assert got["b"]["type"] in ("PeerLostError", "SyncTimeoutError"), got
        assert not got["a"]["ok"]
        assert got["applied"] == 3
        assert got["checksum"] == _expected(3)
        assert two[rank]["v4_seconds"] < 20.0 + 5.0
        assert two[rank]["broken"]["a"] is None  # sender a's group is still in step


# -- senders that announce different versions ------------------------------------------------------
@pytest.mark.timeout(300)
def test_shares_of_different_versions_commit_nothing_and_every_sender_is_told() -> None:
    """Sender a announces version 2 and sender b version 3, each its own share: no receiver
    commits either (a "v3" holding a's v2 share must never exist), both senders are told the
    version failed, and the groups carry the next version from both."""
    mixed = w.run_ranks(cw.scenario_mixed_versions, 4, timeout=240.0)
    for rank in (0, 1):
        assert mixed[rank]["v1"]["ok"], mixed[rank]["v1"]
        assert not mixed[rank]["mixed"]["ok"], f"sender {rank} was told a mixed version committed"
        assert mixed[rank]["v4"]["ok"], mixed[rank]["v4"]
        assert mixed[rank]["broken"] is None
    for rank in cw.RECEIVERS:
        got = mixed[rank]
        assert got["v1"]["applied"] == 1
        assert got["mixed"]["type"] == "VersionError", got["mixed"]
        assert "sender 'a'" in got["mixed"]["message"]
        assert "sender 'b'" in got["mixed"]["message"]
        assert got["mixed"]["applied"] == 1
        assert got["mixed"]["checksum"] == _expected(1)
        assert got["v4"]["ok"], got["v4"]
        assert (got["v4"]["applied"], got["v4"]["checksum"]) == (4, _expected(4))
        assert got["broken"] == {"a": None, "b": None}
