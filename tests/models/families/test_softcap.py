"""`softcapped_attention` against transformers' Gemma 2 eager attention (its reference for
soft-capped logits), and against SDPA where a cap too high to bind changes nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from aici_cli.models.families.softcap import softcapped_attention

HEADS, KV_HEADS, DIM = 4, 2, 16


def qkv(length: int, keys: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, length, DIM, generator=g) * 3
    k = torch.randn(1, KV_HEADS, keys, DIM, generator=g) * 3
    v = torch.randn(1, KV_HEADS, keys, DIM, generator=g)
    return q, k, v


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
          softcap: float) -> torch.Tensor:
    """transformers' Gemma 2 eager attention, [1, H, L, D]."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = SimpleNamespace(head_dim=DIM, num_key_value_groups=HEADS // KV_HEADS,
                             training=False)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out, _ = eager_attention_forward(module, q, k, v, additive, scaling=DIM ** -0.5,
                                     softcap=softcap)
    return out.transpose(1, 2)


@pytest.mark.parametrize("softcap", [1.0, 5.0])
def test_a_bool_mask_with_grouped_heads_matches_transformers_eager(softcap: float) -> None:
    q, k, v = qkv(5, 9)
    # Causal from slot 4 on, inside a window of 6: what the engine's row masks look like.
    pos, slot = torch.arange(4, 9)[:, None], torch.arange(9)[None, :]
    allowed = ((slot <= pos) & (slot > pos - 6))[None, None]
    got = softcapped_attention(q, k, v, attn_mask=allowed, scale=DIM ** -0.5,
                               enable_gqa=True, softcap=softcap)
    want = eager(q, k, v, allowed, softcap)
    assert (got - want).abs().max() < 1e-5
    uncapped = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    assert (got - uncapped).abs().max() > 1e-2  # the cap binds at these logits


def test_is_causal_is_the_lower_triangle() -> None:
    q, k, v = qkv(6, 6, seed=1)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    got = softcapped_attention(q, k, v, is_causal=True, enable_gqa=True, softcap=2.0)
    assert (got - eager(q, k, v, allowed, 2.0)).abs().max() < 1e-5


def test_a_cap_that_never_binds_is_sdpa() -> None:
    q, k, v = qkv(3, 7, seed=2)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    mask = torch.rand(1, 1, 3, 7, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True  # no row fully masked
    got = softcapped_attention(q, k, v, attn_mask=mask, softcap=1e6)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (got - want).abs().max() < 1e-5
