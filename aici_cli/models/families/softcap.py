"""Attention with soft-capped logits, as a drop-in for `F.scaled_dot_product_attention`.

Gemma 2 caps every attention logit at `attn_logit_softcapping` (s -> c * tanh(s / c))
before the mask and the softmax. SDPA's kernels have no such step, which is why
transformers refuses SDPA for Gemma 2; this computes the scores explicitly as
transformers' eager attention does (`eager_attention_forward`: scale, cap, mask, softmax
in float32, weighted sum), for callers that otherwise call SDPA with the same arguments.
"""

from __future__ import annotations

import torch


def softcapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                         scale: float | None = None, enable_gqa: bool = False, *,
                         softcap: float) -> torch.Tensor:
    """`F.scaled_dot_product_attention(query, key, value, attn_mask, is_causal=...,
    scale=..., enable_gqa=...)` with each logit capped at `softcap` first.

    query [..., Hq, L, D], key/value [..., Hk, S, D]; `attn_mask` boolean (True: attend)
    or additive, broadcast to [..., Hq, L, S]; `is_causal` aligns the last query with the
    last key, as SDPA does when L == S (its only use here). A masked logit becomes the
    dtype's lowest value, as transformers' additive masks make it, so a row with every
    key masked averages the values instead of giving NaN.
    """
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    lowest = torch.finfo(scores.dtype).min
    if is_causal:
        length, keys = scores.shape[-2], scores.shape[-1]
        allowed = torch.ones(length, keys, dtype=torch.bool, device=scores.device).tril(
            keys - length)
        scores = scores.masked_fill(~allowed, lowest)
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, lowest) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)
