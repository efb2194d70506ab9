"""Stacked linear layers (models/quant/fused_linear.py): the stacked output is exactly the parts'
outputs side by side, the parts still give what they gave, and the weights are held once;
in eager passes (`stack_eager`), each projection's output from one call, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.models.kernels import int_mm
from aici_cli.models.quant import prompt_tokens
from aici_cli.models.quant.fused_linear import (
    SideBySide,
    StackedParts,
    _share_storage,
    stack_eager,
    stack_linears,
)
from aici_cli.models.quant.quantize import Int4Linear, Int8Linear, quantize_int4, quantize_int8

KINDS = ("dense", "int4", "int8")


def _part(kind: str, n: int, k: int, bias: bool, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.1
    b = torch.randn(n, generator=gen) if bias else None
    if kind == "dense":
        lin = torch.nn.Linear(k, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(weight)
            if b is not None:
                lin.bias.copy_(b)
        return lin.to(torch.bfloat16)
    if kind == "int4":
        codes, d, m = quantize_int4(weight)
        return Int4Linear(codes, d, m, None if b is None else b.bfloat16(), torch.bfloat16)
    q, s = quantize_int8(weight)
    return Int8Linear(q, s, None if b is None else b.bfloat16(), torch.bfloat16)


def _big(p: torch.nn.Module) -> torch.Tensor:
    """The layer's weight matrix (codes, for the quantized kinds)."""
    name = {Int4Linear: "packed", Int8Linear: "codes"}.get(type(p), "weight")
    tensor = getattr(p, name)
    assert isinstance(tensor, torch.Tensor)
    return tensor


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS),
       widths=st.lists(st.sampled_from([32, 64, 96, 128, 192]), min_size=2, max_size=3),
       k=st.sampled_from([64, 128]), bias=st.booleans(), rows=st.integers(1, 9),
       seed=st.integers(0, 1000))
def test_stacked_output_is_the_parts_side_by_side(kind: str, widths: list[int], k: int,
                                                  bias: bool, rows: int, seed: int) -> None:
    parts = [_part(kind, n, k, bias, seed + i) for i, n in enumerate(widths)]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    before = [p(x) for p in parts]
    stacked = stack_linears(parts)
    assert torch.equal(stacked(x), torch.cat(before, dim=-1))
    for p, y in zip(parts, before):  # the parts, now reading slices, give the same
        assert torch.equal(p(x), y)
    if not isinstance(stacked, SideBySide):
        storage = _big(stacked).untyped_storage().data_ptr()
        assert all(_big(p).untyped_storage().data_ptr() == storage for p in parts)


def test_parts_of_different_kinds_are_called_side_by_side() -> None:
    parts = [_part("int4", 64, 64, False, 0), _part("int8", 64, 64, False, 1)]
    x = torch.randn(2, 64).bfloat16()
    stacked = stack_linears(parts)
    assert isinstance(stacked, SideBySide)
    assert torch.equal(stacked(x), torch.cat([p(x) for p in parts], dim=-1))


@pytest.mark.real_model
def test_the_default_models_layers_stack_for_the_compiled_step() -> None:
    """On the real default model at int4 (its GGUF's own blocks), every layer's q/k/v and
    gate/up stack (no SideBySide fallback), and the model's own modules keep their
    outputs."""
    from aici_cli.engine.forward.decode_layer import DecodeLayer
    from aici_cli.models.load import load_model

    lm = load_model(None, "cpu", "auto", "int4")
    # auto: bf16 only where the CPU has native bf16, float32 elsewhere
    x = torch.randn(3, lm.model.config.hidden_size).to(lm.dtype)
    for layer in lm.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v, up = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp.up_proj(x)
        fused = DecodeLayer(layer, lm.model.config)
        assert isinstance(fused.qkv, Int4Linear) and isinstance(fused.gate_up, Int4Linear)
        assert torch.equal(fused.qkv(x), torch.cat([q, k, v], dim=-1))
        assert torch.equal(attn.v_proj(x), v) and torch.equal(mlp.up_proj(x), up)


# ------------------------------------------------------------- eager passes (stack_eager)

WHY_NOT = int_mm.unusable()
needs_kernel = pytest.mark.skipif(WHY_NOT is not None, reason=f"no int kernel: {WHY_NOT}")


def _owner(widths: list[int], k: int, seed: int, back_to_back: bool = True) -> torch.nn.Module:
    """A module as the Llama family's attention declares itself: q/k/v int4 layers on the
    int kernels (their layouts back to back, as the load keeps them) and `qkv` None."""
    gen = torch.Generator().manual_seed(seed)
    tiled = []
    for n in widths:
        codes = torch.randint(0, 16, (n, k), generator=gen)
        d = torch.rand(n, k // 32, generator=gen) * 0.05
        one = int_mm.tile_int4(codes, d, -8 * d)
        assert one is not None
        tiled.append(one)
    grouped = int_mm.group_int4(tiled) if back_to_back else tiled
    assert grouped is not None
    owner = torch.nn.Module()
    for name, t in zip(("q_proj", "k_proj", "v_proj"), grouped):
        owner.add_module(name, Int4Linear.vnni_only(t, torch.float32, None))
    owner.qkv = None
    return owner


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(widths=st.lists(st.sampled_from([16, 32, 64, 192]), min_size=3, max_size=3),
       k=st.sampled_from([64, 576]), rows=st.integers(1, 40), seed=st.integers(0, 1000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_an_eager_pass_gets_each_projection_from_one_call_bit_for_bit(
        widths: list[int], k: int, rows: int, seed: int, dtype: torch.dtype) -> None:
    owner = _owner(widths, k, seed)
    assert stack_eager(owner) == 1 and isinstance(owner.qkv, StackedParts)
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    got = owner.qkv(x)
    for out, part in zip(got, (owner.q_proj, owner.k_proj, owner.v_proj)):
        assert out.shape == (2, rows, part.out_features)
        assert torch.equal(out, part(x))


@needs_kernel
def test_a_pass_on_the_dense_copies_calls_the_parts() -> None:
    owner = _owner([32, 16, 16], 64, 0)
    stack_eager(owner)
    assert isinstance(owner.qkv, StackedParts)
    for part in (owner.q_proj, owner.k_proj, owner.v_proj):  # as dense_copies leaves them
        part.dense = torch.randn(part.out_features, 64)
    x = torch.randn(16, 64)
    for runs, dense in (([(0, 16)], True), ([], False)):
        with prompt_tokens.feeding(runs, 16, x.device):
            got = owner.qkv(x)
            for out, part in zip(got, (owner.q_proj, owner.k_proj, owner.v_proj)):
                assert torch.equal(out, part(x))
                assert torch.equal(out, prompt_tokens.tiled_linear(x, part.dense)) == dense


@needs_kernel
def test_layers_whose_layouts_are_apart_or_of_another_kind_are_left_to_their_own_calls() -> None:
    apart = _owner([32, 16, 16], 64, 1, back_to_back=False)
    assert stack_eager(apart) == 0 and apart.qkv is None
    mixed = _owner([32, 16, 16], 64, 2)
    mixed.v_proj = _part("int8", 16, 64, False, 3)
    assert stack_eager(mixed) == 0 and mixed.qkv is None


@pytest.mark.real_model
def test_the_default_models_eager_passes_are_the_unstacked_ones_bit_for_bit() -> None:
    """On the real default model at its defaults, where the int kernels run, every layer's
    q/k/v and gate/up are stacked for eager passes and its logits are those of each
    projection's own call."""
    from aici_cli.models.load import load_model

    lm = load_model(None, "cpu", "auto", "auto")
    layers = lm.model.model.layers
    if lm.quantize == "none" or WHY_NOT is not None:
        assert all(layer.self_attn.qkv is None for layer in layers)
        pytest.skip(f"the defaults here do not run the int kernels ({lm.quantize}, {WHY_NOT})")
    assert all(isinstance(layer.self_attn.qkv, StackedParts)
               and isinstance(layer.mlp.gate_up, StackedParts) for layer in layers)
    ids = torch.randint(0, lm.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stacked = lm.model(ids).logits
        saved = [(layer.self_attn.qkv, layer.mlp.gate_up) for layer in layers]
        for layer in layers:
            layer.self_attn.qkv = layer.mlp.gate_up = None
        try:
            alone = lm.model(ids).logits
        finally:
            for layer, (qkv, gate_up) in zip(layers, saved):
                layer.self_attn.qkv, layer.mlp.gate_up = qkv, gate_up
    assert torch.equal(stacked, alone)


@pytest.mark.parametrize("unit", [1, 8])
def test_parts_share_the_stack_in_its_layouts_rows(unit: int) -> None:
    """After stacking, each part reads its own rows of the stacked int4 layout: rows of N
    where the layout is [N, ...] (the CPU's), rows of N / 8 where it holds output rows in
    tiles of 8 (CUDA's tinygemm layout, [N / 8, ...]): a part must not read its
    neighbour's tiles."""
    k, widths = 64, [16, 8, 24]
    packed = [torch.randint(0, 255, (n // unit, 40), dtype=torch.uint8) for n in widths]
    scale_zero = [torch.randn(k // 32, n, 2) for n in widths]
    parts = [Int4Linear.from_buffers(p, sz, None) for p, sz in zip(packed, scale_zero)]
    stacked = Int4Linear.from_buffers(torch.cat(packed), torch.cat(scale_zero, dim=1), None)
    _share_storage(stacked, parts)
    for part, want in zip(parts, packed):
        assert torch.equal(part.packed, want)
        assert part.packed.data_ptr() != want.data_ptr()  # a view of the stack now
