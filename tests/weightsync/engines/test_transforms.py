"""Transforms between a trainer's weights and an engine's ``load_weights``: each one bit-exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.weightsync import (
    LLAMA_STACKED_PARAMS,
    Cast,
    Drop,
    Fuse,
    LayoutMismatchError,
    Rename,
    TransformChain,
    WeightTransform,
    apply_transforms,
    plan_transforms,
)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def llama_layer(prefix: str = "model.layers.0.", seed: int = 0) -> dict[str, torch.Tensor]:
    """One Llama-shaped decoder layer with grouped-query attention (8 q heads, 2 kv heads)."""
    g = torch.Generator().manual_seed(seed)
    hidden, head, inter = 32, 4, 48

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        f"{prefix}self_attn.q_proj.weight": w(8 * head, hidden),
        f"{prefix}self_attn.k_proj.weight": w(2 * head, hidden),
        f"{prefix}self_attn.v_proj.weight": w(2 * head, hidden),
        f"{prefix}self_attn.q_proj.bias": w(8 * head),
        f"{prefix}self_attn.k_proj.bias": w(2 * head),
        f"{prefix}self_attn.v_proj.bias": w(2 * head),
        f"{prefix}self_attn.o_proj.weight": w(hidden, 8 * head),
        f"{prefix}mlp.gate_proj.weight": w(inter, hidden),
        f"{prefix}mlp.up_proj.weight": w(inter, hidden),
        f"{prefix}mlp.down_proj.weight": w(hidden, inter),
        f"{prefix}input_layernorm.weight": w(hidden),
    }


# -- rename ------------------------------------------------------------------------------------
def test_rename_exact_prefix_regex_keep_the_tensor_itself() -> None:
    sd = llama_layer()
    name = "model.layers.0.mlp.up_proj.weight"
    cases = [
        (Rename.exact({name: "up"}), "up"),
        (Rename.prefix("model.", "decoder."), "decoder.layers.0.mlp.up_proj.weight"),
        (Rename.regex(r"layers\.(\d+)\.", r"h.\1."), "model.h.0.mlp.up_proj.weight"),
    ]
    for transform, expected in cases:
        out = dict(apply_transforms([transform], sd.items()))
        assert expected in out
        assert out[expected] is sd[name]  # no copy: the same tensor object goes through
        assert len(out) == len(sd)


def test_rename_collision_and_strict_modes_name_the_weights() -> None:
    sd = {"a.w": torch.ones(2), "b.w": torch.zeros(2)}
    with pytest.raises(LayoutMismatchError, match=r"renames both 'a.w' and 'b.w' to 'w'"):
        list(apply_transforms([Rename.regex(r"^[ab]\.", "")], sd.items()))
    with pytest.raises(LayoutMismatchError, match=r"'b.w' is not in the rename map"):
        list(apply_transforms([Rename.exact({"a.w": "x"}, strict=True)], sd.items()))
    with pytest.raises(LayoutMismatchError, match=r"does not start with 'model.'"):
        list(apply_transforms([Rename.prefix("model.", "", strict=True)], sd.items()))
    with pytest.raises(LayoutMismatchError, match=r"turned 'a.w' into ''"):
        list(apply_transforms([Rename(lambda n: "")], sd.items()))


def test_rename_forgets_names_between_versions() -> None:
    transform = Rename.prefix("x.", "")
    for _ in range(2):  # the same names again in the next version are not a collision
        assert [n for n, _ in apply_transforms([transform], [("x.w", torch.ones(1))])] == ["w"]


# -- fuse ----------------------------------------------------------------------------------------
def test_fuse_stacks_qkv_and_gate_up_as_vllm_llama_loads_them() -> None:
    sd = llama_layer()
    out = dict(apply_transforms([Fuse(LLAMA_STACKED_PARAMS)], sd.items()))
    p = "model.layers.0."
    assert sorted(out) == sorted(
        [
            f"{p}self_attn.qkv_proj.weight",
            f"{p}self_attn.qkv_proj.bias",
            f"{p}self_attn.o_proj.weight",
            f"{p}mlp.gate_up_proj.weight",
            f"{p}mlp.down_proj.weight",
            f"{p}input_layernorm.weight",
        ]
    )
    qkv = out[f"{p}self_attn.qkv_proj.weight"]
    q, k, v = (sd[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
    # vLLM's QKVParallelLinear (tp=1): q at rows [0, q), k at [q, q+kv), v at [q+kv, q+2kv)
    assert same_bits(qkv[: q.shape[0]], q)
    assert same_bits(qkv[q.shape[0] : q.shape[0] + k.shape[0]], k)
    assert same_bits(qkv[q.shape[0] + k.shape[0] :], v)
    assert same_bits(qkv, torch.cat([q, k, v]))
    bias = out[f"{p}self_attn.qkv_proj.bias"]
    assert same_bits(bias, torch.cat([sd[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"]))
    gate_up = out[f"{p}mlp.gate_up_proj.weight"]
    # MergedColumnParallelLinear: shard 0 (gate) first, shard 1 (up) after it
    assert same_bits(gate_up, torch.cat([sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]]))
    assert out[f"{p}self_attn.o_proj.weight"] is sd[f"{p}self_attn.o_proj.weight"]


def test_fuse_any_arrival_order_and_reused_buffers_give_the_same_bits() -> None:
    """Shards come in any order, each as a view of a bucket buffer that is overwritten after the
    call (what a receiver hands over): the stage keeps its own copy of what it holds back."""
    sd = llama_layer(seed=3)
    order = sorted(sd, key=lambda n: ("v_proj" not in n, "up_proj" not in n, n))  # v and up first
    scratch = torch.empty(4096, dtype=torch.float32)
    transform = Fuse()
    transform.start()
    out: dict[str, torch.Tensor] = {}
    for name in order:
        tensor = sd[name]
        view = scratch[: tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        # what passes through is still a view of the buffer: a consumer uses it during the call
        out.update((n, t.clone()) for n, t in transform.feed(name, view))
        scratch.fill_(float("nan"))  # the "bucket buffer" is reused for the next bucket
    out.update(transform.finish())
    reference = dict(apply_transforms([Fuse()], sd.items()))
    assert sorted(out) == sorted(reference)
    for name in reference:
        assert same_bits(out[name], reference[name]), name


def test_fuse_keeps_special_values_bit_exact() -> None:
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, 3.4e38])
    bits = special.view(torch.int32).clone()
    bits[0] = 0x7FC12345  # a NaN with a payload
    q = bits.view(torch.float32).reshape(6, 1)
    k, v = q.flip(0).clone(), -q
    out = dict(
        apply_transforms([Fuse()], [("a.q_proj.weight", q), ("a.k_proj.weight", k), ("a.v_proj.weight", v)])
    )
    assert same_bits(out["a.qkv_proj.weight"], torch.cat([q, k, v]))


def test_fuse_errors_name_the_stacked_weight_and_the_shard() -> None:
    sd = llama_layer()
    incomplete = {n: t for n, t in sd.items() if "k_proj.weight" not in n}
    with pytest.raises(LayoutMismatchError, match=r"qkv_proj.weight' is missing shard\(s\) \['k'\]"):
        list(apply_transforms([Fuse()], incomplete.items()))
    twice = [("a.q_proj.weight", torch.ones(2, 2)), ("a.q_proj.weight", torch.ones(2, 2))]
    with pytest.raises(LayoutMismatchError, match=r"shard 'q' of 'a.qkv_proj.weight' arrived twice"):
        list(apply_transforms([Fuse()], twice))
    wide = [("a.q_proj.weight", torch.ones(4, 8)), ("a.k_proj.weight", torch.ones(2, 6))]
    with pytest.raises(LayoutMismatchError, match=r"cannot stack 'a.qkv_proj.weight' along dim 0"):
        list(apply_transforms([Fuse()], wide))
    mixed = [("a.gate_proj.w", torch.ones(2, 2)), ("a.up_proj.w", torch.ones(2, 2, dtype=torch.float16))]
    with pytest.raises(LayoutMismatchError, match=r"'a.gate_proj.w' is float32, 'a.up_proj.w' is float16"):
        list(apply_transforms([Fuse()], mixed))
    with pytest.raises(ValueError, match=r"listed twice"):
        Fuse([("qkv", "q", "q"), ("qkv", "k", "q")])


# -- cast --------------------------------------------------------------------------------------
def _bf16_round_nearest_even(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 computed on the integer bits (an independent reference for torch)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16) & 0xFFFF
    return rounded.to(torch.int32).to(torch.int16).view(torch.bfloat16)  # low 16 bits as bf16


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=64))
def test_cast_to_bfloat16_rounds_to_nearest_even_bit_exact(words: list[int]) -> None:
    raw = torch.tensor(words, dtype=torch.int64).to(torch.int32)  # wraps to the same 32 bits
    x = raw.view(torch.float32)
    out = dict(apply_transforms([Cast(torch.bfloat16)], [("w", x)]))["w"]
    assert out.dtype == torch.bfloat16
    reference = _bf16_round_nearest_even(x)
    finite = ~torch.isnan(x)
    assert torch.equal(out[finite].view(torch.int16), reference[finite].view(torch.int16))
    assert bool(torch.isnan(out[~finite].float()).all())


def test_cast_widening_is_exact_and_leaves_integers_and_unmatched_names() -> None:
    g = torch.Generator().manual_seed(0)
    half = torch.randn(257, generator=g).to(torch.bfloat16)
    ids = torch.arange(5)
    mask = torch.tensor([True, False])
    out = dict(
        apply_transforms(
            [Cast("float32", only=r"\.weight$")],
            [("l.weight", half), ("l.bias", half), ("ids", ids), ("mask", mask)],
        )
    )
    assert out["l.weight"].dtype == torch.float32
    assert same_bits(out["l.weight"].to(torch.bfloat16), half)  # the round trip is the identity
    assert out["l.bias"] is half  # not matched by `only`
    assert out["ids"] is ids
    assert out["mask"] is mask
    with pytest.raises(ValueError, match=r"floating point"):
        Cast(torch.int8)


def test_drop_leaves_out_matching_weights() -> None:
    weights = [("rotary_emb.inv_freq", torch.ones(2)), ("w", torch.ones(1))]
    assert [n for n, _ in apply_transforms([Drop(r"rotary_emb\.")], weights)] == ["w"]


# -- chains and plans ----------------------------------------------------------------------------
def _trainer_to_engine() -> list[WeightTransform]:
    """A trainer (FSDP, names under "module.") to an engine (stacked projections, bf16)."""
    return [
        Rename.prefix("module.", "model."),
        Drop(r"\.rotary\.inv_freq$"),
        Fuse(),
        Cast(torch.bfloat16),
    ]


def test_chain_rename_fuse_cast_bit_exact_against_a_manual_conversion() -> None:
    sd = {f"module.{k.removeprefix('model.')}": v for k, v in llama_layer().items()}
    sd["module.layers.0.rotary.inv_freq"] = torch.ones(4)
    sd["module.step"] = torch.tensor(7)
    out = dict(apply_transforms(_trainer_to_engine(), sd.items()))
    p = "module.layers.0."
    expected = {
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat(
            [sd[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]
        ).to(torch.bfloat16),
        "model.layers.0.self_attn.qkv_proj.bias": torch.cat(
            [sd[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"]
        ).to(torch.bfloat16),
        "model.layers.0.self_attn.o_proj.weight": sd[f"{p}self_attn.o_proj.weight"].to(torch.bfloat16),
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat(
            [sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]]
        ).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": sd[f"{p}mlp.down_proj.weight"].to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": sd[f"{p}input_layernorm.weight"].to(torch.bfloat16),
        "model.step": sd["module.step"],
    }
    assert sorted(out) == sorted(expected)
    for name, tensor in expected.items():
        assert same_bits(out[name], tensor), name


def test_plan_matches_real_tensors_and_fails_before_any_byte_moves() -> None:
    sd = {f"module.{k.removeprefix('model.')}": v for k, v in llama_layer().items()}
    entries = [(n, tuple(t.shape), t.dtype) for n, t in sd.items()]
    plan = plan_transforms(_trainer_to_engine(), entries)
    real = apply_transforms(_trainer_to_engine(), sd.items())
    assert plan == [(n, tuple(t.shape), "bfloat16") for n, t in real]
    broken = [e for e in entries if "v_proj.weight" not in e[0]]
    with pytest.raises(LayoutMismatchError, match=r"missing shard\(s\) \['v'\]"):
        plan_transforms(_trainer_to_engine(), broken)


def test_chain_rejects_what_is_not_a_stage() -> None:
    with pytest.raises(TypeError, match=r"must be a WeightTransform"):
        TransformChain([lambda n: n])  # type: ignore[list-item]
