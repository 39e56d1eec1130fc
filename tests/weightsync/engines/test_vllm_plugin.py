"""The vLLM backend's vLLM-free half: the infos that cross ``collective_rpc``, `run_together`,
and weightsync importing without vLLM. The backend itself runs against the real vLLM in
`tests/e2e/test_vllm.py` (``-m vllm``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import asdict

import pytest

from rlfleet.weightsync import SyncTimeoutError
from rlfleet.weightsync.engines import (
    VLLM_BACKEND,
    VllmInitInfo,
    VllmTrainerInitInfo,
    VllmUpdateInfo,
    run_together,
)


def test_weightsync_imports_without_vllm_and_the_backend_says_what_it_needs() -> None:
    code = (
        "import sys, rlfleet.weightsync, rlfleet.weightsync.engines as e\n"
        "assert 'vllm' not in sys.modules and 'sglang' not in sys.modules\n"
        "try:\n    e.register_vllm_backend()\nexcept ImportError as exc:\n    print(exc.name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() in ("vllm", "")  # "" where vLLM is installed: it registered


def test_infos_are_plain_json_and_survive_the_round_trip_vllm_makes() -> None:
    info = VllmInitInfo(layout_digest="abc", node_name="rlfleet_1", rename_prefix=["module.", ""])
    again = VllmInitInfo(**json.loads(json.dumps(asdict(info))))
    assert again == info
    assert again.prefix == ("module.", "")
    update = VllmUpdateInfo(**json.loads(json.dumps(asdict(VllmUpdateInfo(7, timeout_s=2.0)))))
    assert update.version == 7
    trainer = VllmTrainerInitInfo(workers=2, rank=1, rename_prefix=("module.", ""))
    assert trainer.backend == VLLM_BACKEND == "rlfleet"
    assert not trainer.is_sender


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"layout_digest": ""}, "layout_digest"),
        ({"layout_digest": "d", "transport": "carrier pigeon"}, "transport"),
        ({"layout_digest": "d"}, "node_name"),
        ({"layout_digest": "d", "node_name": "n", "timeout_s": float("inf")}, "timeout_s"),
        ({"layout_digest": "d", "node_name": "n", "rename_prefix": ["only one"]}, "rename_prefix"),
        ({"layout_digest": "d", "transport": "broadcast", "store_host": "h", "store_port": 0}, "store_port"),
        (
            {
                "layout_digest": "d",
                "transport": "broadcast",
                "store_host": "h",
                "store_port": 5,
                "group_size": 1,
            },
            "group_size",
        ),
    ],
)
def test_a_bad_init_info_field_is_named(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        VllmInitInfo(**kwargs)  # type: ignore[arg-type]


def test_bad_update_and_trainer_fields_are_named() -> None:
    for version in (True, -1, 2.0, 2**63):
        with pytest.raises(ValueError, match="version"):
            VllmUpdateInfo(version)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        VllmUpdateInfo(1, timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        VllmTrainerInitInfo(workers=0, rank=0)
    with pytest.raises(ValueError, match="wire"):
        VllmTrainerInitInfo(workers=1, wire="smoke", rank=0)
    with pytest.raises(TypeError):
        VllmTrainerInitInfo(workers=1)  # type: ignore[call-arg]  # rank is explicit, as vLLM's


def test_run_together_returns_every_result() -> None:
    assert run_together([lambda: 1, lambda: "two"], 10.0, "both") == [1, "two"]


@pytest.mark.timeout(60)
def test_run_together_raises_the_first_error_at_once_while_another_call_still_blocks() -> None:
    release = threading.Event()
    finished = threading.Event()

    def blocks() -> None:
        release.wait()  # until the test releases it: run_together must not wait for it
        finished.set()

    def fails() -> None:
        raise ValueError("the worker refused its options")

    with pytest.raises(ValueError, match="refused its options"):
        run_together([blocks, fails], 3600.0, "joining")
    assert not finished.is_set()
    release.set()


def test_run_together_is_bounded() -> None:
    release = threading.Event()
    with pytest.raises(SyncTimeoutError, match="joining"):
        run_together([lambda: release.wait(30)], 0.2, "joining")
    release.set()
