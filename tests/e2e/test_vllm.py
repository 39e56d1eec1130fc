"""rlfleet against the real vLLM (0.33) on the CPU: opt-in, ``-m vllm``; skipped without vLLM.

`examples/integrations/vllm_check.sh` builds the venv (vLLM's wheel is ~9.5 GB) and runs this module. The
workers are vLLM's own Worker processes (`vllm_workers`), the model a tiny Qwen2, driven the way
``collective_rpc`` reaches them (arguments through vLLM's msgpack hop). Checked:

- the "rlfleet" backend, registered by our ``vllm.general_plugins`` entry point and built by
  vLLM's factory, runs its four phases against the real model, bit-exact against vLLM's own
  ``load_weights`` over three versions, untied and tied, bf16 and fp32, and at tensor parallel 2;
- a failed transfer at each phase leaves vLLM's weights untouched and names the cause; finish is
  retryable; a rank that fails fails every rank;
- the loader-derived map reproduces ``load_weights`` bit-exactly and, at tensor parallel 2,
  gives each rank exactly its slice;
- the worker extension (examples/integrations) with msgpack-encoded arguments;
- every vLLM snippet of the READMEs.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed ('rlfleet-weightsync[vllm]'; integrations/vllm_check.sh)"
)

import torch
import vllm_workers as vw
from testkit import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "integrations"))

from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
from vllm_worker_extension import JoinOptions, VllmSync

from rlfleet.weightsync import Layout, LayoutMismatchError, SharedBuffer, host_store
from rlfleet.weightsync.engines import VllmTrainerInitInfo, register_vllm_backend

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [("untied", "bfloat16"), ("untied", "float32"), ("tied", "bfloat16"), ("tied", "float32")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, str]:
    root = str(tmp_path_factory.mktemp("vllm_models"))
    return {tied: vw.write_config(root, tied) for tied in (False, True)}


@pytest.fixture(scope="module")
def tp1(request: pytest.FixtureRequest, folders: dict[bool, str]) -> Iterator[vw.Ranks]:
    tied, dtype = request.param
    ranks = vw.Ranks(folders[tied == "tied"], dtype, tp=1, port=free_port())
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def tp2(folders: dict[bool, str]) -> Iterator[vw.Ranks]:
    ranks = vw.Ranks(folders[False], "bfloat16", tp=2, port=free_port())
    yield ranks
    ranks.close()


def trainer(ranks: vw.Ranks, **info: Any) -> tuple[Any, torch.nn.Module]:
    """The trainer's side through vLLM's own factory: rank 0 of one trainer process."""
    register_vllm_backend()  # the trainer's process; vLLM's workers register it through the plugin
    model = vw.trainer_model(ranks.model_dir)
    sync = WeightTransferTrainerFactory.trainer_init(
        VllmTrainerInitInfo(workers=ranks.tp, rank=0, **info),
        client=vw.Client(ranks),
        source=ModuleSource(model),
    )
    return sync, model


def assert_serves(ranks: vw.Ranks, version: int) -> None:
    for rank, result in enumerate(ranks.each("check", version=version)):
        assert result["exact"], (
            f"rank {rank} differs from load_weights of version {version}: {result['differs']}"
        )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp1", CONFIGS, indirect=True, ids=["-".join(c) for c in CONFIGS])
def test_backend_four_phases_bit_exact_over_three_versions(tp1: vw.Ranks) -> None:
    (status,) = tp1.each("status")
    assert status["registered"]  # by our vllm.general_plugins entry point
    assert status["engine"] == "VllmWeightTransferEngine"  # built by vLLM's factory in load_model
    sync, model = trainer(tp1)
    for version in (1, 2, 3):
        vw.load_version(model, tp1.model_dir, version)
        sync.send_weights()  # start, update, finish: through the Worker's own RPC methods
        assert_serves(tp1, version)
        (status,) = tp1.each("status")
        assert (status["applied"], status["active"], status["meta"]) == (version, False, [])
    assert sync.client.weight_version == "3"
    sync.shutdown()


@contextlib.contextmanager
def broken_load(ranks: vw.Ranks) -> Iterator[None]:
    """vLLM's own load_weights raises on every rank while inside (and is itself again after)."""
    ranks.each("break_load", on=True)
    try:
        yield
    finally:
        ranks.each("break_load", on=False)


def node_for(ranks: vw.Ranks, drop: str | None = None) -> tuple[SharedBuffer, Layout]:
    state = vw.checkpoint(ranks.model_dir, 0)
    layout = Layout([(n, tuple(t.shape), "float32") for n, t in state.items() if n != drop], 64 << 10)
    return SharedBuffer(layout, num_readers=ranks.tp, checksums=True), layout


def rpc(ranks: vw.Ranks, method: str, **kwargs: Any) -> list[Any]:
    return ranks.replies("rpc", method=method, kwargs=kwargs)


def one_error(results: list[Any]) -> str:
    errors = [r for r in results if isinstance(r, vw.WorkerError)]
    assert errors, results
    return str(errors[0])


def publish(ranks: vw.Ranks, node: SharedBuffer, version: int) -> None:
    state = vw.checkpoint(ranks.model_dir, version)
    node.publish({n: state[n] for n in node.layout.names}, version, 30)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp1", [CONFIGS[0]], indirect=True, ids=["untied-bfloat16"])
def test_a_failed_init_or_start_leaves_the_weights_untouched_and_names_the_cause(tp1: vw.Ranks) -> None:
    (before,) = tp1.each("digest")
    node, layout = node_for(tp1)
    good = {"layout_digest": layout.digest, "node_name": node.name, "timeout_s": 30.0}
    partial, partial_layout = node_for(tp1, drop="model.layers.0.self_attn.k_proj.weight")
    for init_info, cause in [
        (dict(good, bogus=1), "bogus"),
        (dict(good, layout_digest="f" * 64), "announced layout ffffffffffff"),
        (dict(good, node_name="rlfleet_no_such_segment"), "rlfleet_no_such_segment"),
        (dict(good, transport="smoke"), "transport"),
        ({"layout_digest": partial_layout.digest, "node_name": partial.name}, "qkv_proj"),
    ]:
        assert cause in one_error(rpc(tp1, "init_weight_transfer_engine", init_info=init_info))
        assert tp1.each("digest") == [before]
    partial.close()
    rpc(tp1, "init_weight_transfer_engine", init_info=good)
    tp1.each("rpc", method="start_weight_update")
    assert tp1.each("digest") == [before]  # start touches nothing
    assert tp1.each("status")[0]["meta"] == []
    assert "already active" in one_error(rpc(tp1, "start_weight_update"))  # vLLM's own bookkeeping
    tp1.each("rpc", method="finish_weight_update")  # nothing arrived: nothing to apply, no error
    assert tp1.each("digest") == [before]
    node.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp1", [CONFIGS[0]], indirect=True, ids=["untied-bfloat16"])
def test_a_failed_update_or_finish_leaves_the_weights_untouched_and_names_the_cause(tp1: vw.Ranks) -> None:
    node, layout = node_for(tp1)
    rpc(
        tp1, "init_weight_transfer_engine", init_info={"layout_digest": layout.digest, "node_name": node.name}
    )
    publish(tp1, node, 1)
    tp1.each("rpc", method="start_weight_update")
    for _ in range(2):  # update_weights may come in chunks: the same version again is a no-op
        tp1.each("rpc", method="update_weights", kwargs={"update_info": {"version": 1}})
    tp1.each("rpc", method="finish_weight_update")
    assert_serves(tp1, 1)
    (applied,) = tp1.each("digest")

    def failed_update(update_info: dict[str, Any], cause: str) -> None:
        tp1.each("rpc", method="start_weight_update")
        assert re.search(cause, one_error(rpc(tp1, "update_weights", update_info=update_info)))
        assert tp1.each("digest") == [applied]
        assert not tp1.each("status")[0]["active"]  # vLLM ended the update: the caller starts again

    failed_update({"version": 2, "timeout_s": 1.0}, r"version 2.*timed out")  # never published
    failed_update({"version": 1}, "not newer than the applied 1")
    failed_update({"version": "2"}, "version must be an int")
    failed_update({"version": 2, "chunk": 0}, "Invalid update_info.*chunk")
    publish(tp1, node, 2)
    slots = node._slots  # test only: flip a byte of the published version in shared memory
    for slot in slots:
        slot[100] ^= 0xFF
    failed_update({"version": 2}, "bucket 0 of version 2 fails its checksum")
    for slot in slots:
        slot[100] ^= 0xFF

    # finish: the verified version is gone from the node buffer before finish reads it
    tp1.each("rpc", method="start_weight_update")
    tp1.each("rpc", method="update_weights", kwargs={"update_info": {"version": 2}})
    publish(tp1, node, 3)
    publish(tp1, node, 4)
    assert "version 2 is no longer there" in one_error(rpc(tp1, "finish_weight_update"))
    assert tp1.each("digest") == [applied]
    assert tp1.each("status")[0]["active"]  # vLLM keeps the update open: a newer version completes it
    tp1.each("rpc", method="update_weights", kwargs={"update_info": {"version": 4}})
    tp1.each("rpc", method="finish_weight_update")
    assert_serves(tp1, 4)

    # finish: vLLM's own load_weights raises (the one failure that touches the model): retryable
    publish(tp1, node, 5)
    tp1.each("rpc", method="start_weight_update")
    tp1.each("rpc", method="update_weights", kwargs={"update_info": {"version": 5}})
    with broken_load(tp1):
        assert "injected load_weights failure" in one_error(rpc(tp1, "finish_weight_update"))
        assert tp1.each("status")[0]["active"]
    tp1.each("rpc", method="finish_weight_update")  # the retry applies version 5 again, whole
    assert_serves(tp1, 5)
    assert tp1.each("status")[0]["applied"] == 5
    node.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp1", [CONFIGS[3]], indirect=True, ids=["tied-float32"])
def test_a_tied_engine_takes_the_embedding_whatever_lm_head_the_trainer_sends(tp1: vw.Ranks) -> None:
    """vLLM's layerwise reload loads a separate lm_head.weight into the tied storage (the last one
    fed wins); plain load_weights ignores it. The loader map drops it: the plain semantics."""
    (result,) = tp1.each("map_check", versions=[1, 2, 3], lm_head=True)
    assert result["unused"] == ["lm_head.weight"]
    assert result["exact_full"] == result["exact_slices"] == [True] * 3
    assert result["recorders_agree"]
    state = vw.checkpoint(tp1.model_dir, 0)
    entries = [(n, tuple(t.shape), "float32") for n, t in state.items()] + [
        ("lm_head.weight", (256, 64), "float32")
    ]
    layout = Layout(entries, 64 << 10)
    with SharedBuffer(layout, num_readers=1, checksums=True) as node:
        rpc(
            tp1,
            "init_weight_transfer_engine",
            init_info={"layout_digest": layout.digest, "node_name": node.name},
        )
        for version in (1, 2):
            weights = vw.checkpoint(tp1.model_dir, version)
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1
            node.publish(weights, version, 30)
            tp1.each("rpc", method="start_weight_update")
            tp1.each("rpc", method="update_weights", kwargs={"update_info": {"version": version}})
            tp1.each("rpc", method="finish_weight_update")
            assert_serves(tp1, version)  # the embedding, not the lm_head sent last


@pytest.mark.timeout(900)
def test_tensor_parallel_2_bit_exact_and_a_failing_rank_fails_every_rank(tp2: vw.Ranks) -> None:
    sync, model = trainer(tp2)
    for version in (1, 2, 3):
        vw.load_version(model, tp2.model_dir, version)
        sync.send_weights()
        assert_serves(tp2, version)
    before = tp2.each("digest")
    vw.load_version(model, tp2.model_dir, 4)
    node: SharedBuffer = sync.node
    node.publish({n: p.detach() for n, p in model.named_parameters()}, 4, 30)
    try:
        tp2.replies("fail_update", ranks=[1], on=True)
        tp2.each("rpc", method="start_weight_update")
        errors = rpc(tp2, "update_weights", update_info={"version": 4})
    finally:
        tp2.replies("fail_update", ranks=[1], on=False)
    assert "failed on vLLM rank(s) [1]" in str(errors[0])
    assert "injected receive failure on rank 1" in str(errors[1])
    assert tp2.each("digest") == before
    vw.load_version(model, tp2.model_dir, 5)
    sync.send_weights(5)
    assert_serves(tp2, 5)
    sync.shutdown()


@pytest.mark.timeout(900)
def test_broadcast_transport_tensor_parallel_2_bit_exact_and_finish_retryable(tp2: vw.Ranks) -> None:
    """The trainer on "another node": a gloo broadcast group with both ranks; staged, then applied."""
    sync, model = trainer(tp2, transport="broadcast", finish_retries=0)
    for version in (1, 2, 3):
        vw.load_version(model, tp2.model_dir, version)
        sync.send_weights()  # the workers receive (update_weights) while the trainer broadcasts
        assert_serves(tp2, version)
    # a transfer that fails on the wire: the trainer's stream breaks mid-version, every worker aborts
    before = tp2.each("digest")
    broken = [
        (n, torch.zeros(3) if n == "model.norm.weight" else p.detach()) for n, p in model.named_parameters()
    ]
    sync.client.start_weight_update()
    with ThreadPoolExecutor(1) as pool:  # both sides to the end: the workers' error, then the sender's
        receiving = pool.submit(sync.client.update_weights, {"version": 4, "timeout_s": 60.0})
        with pytest.raises(LayoutMismatchError, match=r"model\.norm\.weight"):
            sync.sender.send(iter(broken), 4, 60.0)  # a stream: it fails where the wrong tensor comes
        with pytest.raises(Exception, match="SyncAbortedError"):
            receiving.result(timeout=120)
    assert tp2.each("digest") == before
    vw.load_version(model, tp2.model_dir, 4)
    with broken_load(tp2):
        with pytest.raises(Exception, match="injected load_weights failure"):
            sync.send_weights()
        assert all(s["active"] for s in tp2.each("status"))  # vLLM keeps the update open
    tp2.each("rpc", method="finish_weight_update")  # the retry re-applies the kept staging copy
    assert_serves(tp2, 4)
    vw.load_version(model, tp2.model_dir, 5)
    sync.send_weights(5)
    assert_serves(tp2, 5)
    sync.shutdown()


@pytest.mark.timeout(900)
def test_the_loader_map_is_load_weights_and_each_rank_needs_exactly_its_slice(tp2: vw.Ranks) -> None:
    results = tp2.each("map_check", versions=[1, 2, 3], timeout_s=600)
    for rank, result in enumerate(results):
        assert result["recorders_agree"], rank
        assert result["exact_full"] == [True] * 3, rank
        assert result["exact_slices"] == [True] * 3, rank
        assert result["uncovered"] == {}
        assert result["unused"] == []
    half = {0: [0, 32], 1: [32, 64]}
    for rank, result in enumerate(results):
        needed = result["needed"]
        assert needed["model.layers.0.self_attn.q_proj.weight"] == [half[rank], [0, 64]]
        assert needed["model.layers.0.self_attn.k_proj.weight"] == [[16 * rank, 16 * rank + 16], [0, 64]]
        assert needed["model.layers.0.self_attn.o_proj.weight"] == [[0, 64], half[rank]]
        assert needed["model.layers.0.mlp.down_proj.weight"] == [[0, 64], [64 * rank, 64 * rank + 64]]
        assert needed["model.embed_tokens.weight"] == [[128 * rank, 128 * rank + 128], [0, 64]]
        assert needed["model.norm.weight"] == [[0, 64]]


@pytest.mark.timeout(900)
def test_worker_extension_with_arguments_encoded_as_vllm_encodes_them(tp2: vw.Ranks) -> None:
    model = vw.trainer_model(tp2.model_dir)
    layout = Layout.from_state_dict({f"module.{n}": p for n, p in model.named_parameters()}, 64 << 10)
    llm = vw.RpcLLM(tp2)
    options = JoinOptions(timeout_s=3600.0, backend="gloo")  # no rename: the workers refuse "module.*"
    with pytest.raises(
        Exception, match=r"collective_rpc method failed.*no module or parameter named .module."
    ):
        VllmSync.connect(llm, host_store("127.0.0.1", 0), "127.0.0.1", layout, workers=2, options=options)
    options = JoinOptions(timeout_s=120.0, backend="gloo", rename_prefix=("module.", ""))
    session = VllmSync.connect(
        llm, host_store("127.0.0.1", 0), "127.0.0.1", layout, workers=2, options=options
    )
    for version in (11, 12, 13):
        vw.load_version(model, tp2.model_dir, version)
        session.push({f"module.{n}": p.detach() for n, p in model.named_parameters()}, version)
        assert_serves(tp2, version)


@pytest.mark.timeout(900)
def test_the_worker_extension_snippet_runs_against_vllm(tp2: vw.Ranks) -> None:
    code = snippet(ROOT / "examples/integrations/README.md", "vllm-extension")
    wrapped = torch.nn.Module()
    wrapped.module = vw.trainer_model(
        tp2.model_dir
    )  # state_dict names: "module.model.embed_tokens.weight", ...
    served: list[int] = []

    def train_step(m: torch.nn.Module) -> None:
        served.append(31 + len(served))
        vw.load_version(m.module, tp2.model_dir, served[-1])

    names = {
        "llm": vw.RpcLLM(tp2),
        "model": wrapped,
        "trainer_ip": "127.0.0.1",
        "tp": 2,
        "dp": 1,
        "wire": "gloo",
        "steps": 2,
        "train_step": train_step,
    }
    exec(compile(code, "examples/integrations/README.md", "exec"), names)
    assert served == [31, 32]
    assert_serves(tp2, 32)


def snippet(path: Path, marker: str) -> str:
    """The python block after ``<!-- marker -->`` in `path`."""
    text = path.read_text()
    found = re.search(rf"<!-- {marker}[^>]*-->\s*(?:<!--[^>]*-->\s*)?```python\n(.*?)```", text, re.DOTALL)
    assert found, f"{path}: no python block marked {marker}"
    return found.group(1)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "readme",
    ["examples/integrations/README.md", "packages/weightsync/README.md"],
    ids=["integrations", "weightsync"],
)
def test_the_readme_snippet_runs_against_vllm(readme: str, tp2: vw.Ranks) -> None:
    code = snippet(ROOT / readme, "vllm-backend")
    assert len(code.strip().splitlines()) <= 16
    model = vw.trainer_model(tp2.model_dir)
    steps = iter(range(21, 24))
    served: list[int] = []

    def train_step(m: torch.nn.Module) -> None:
        served.append(next(steps))
        vw.load_version(m, tp2.model_dir, served[-1])

    names = {
        "client": vw.Client(tp2),
        "model": model,
        "tp_size": 2,
        "rank": 0,
        "steps": 3,
        "train_step": train_step,
    }
    exec(compile(code, readme, "exec"), names)
    assert served == [21, 22, 23]
    assert_serves(tp2, 23)
    names["sync"].shutdown()
