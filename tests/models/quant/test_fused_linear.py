"""Stacked linear layers (models/quant/fused_linear.py): the stacked output is exactly the parts'
outputs side by side, the parts still give what they gave, and the weights are held once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.models.quant.fused_linear import SideBySide, stack_linears
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
