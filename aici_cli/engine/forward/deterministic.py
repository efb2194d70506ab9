"""The deterministic mode's forward passes (`--deterministic`), batch-invariant: a token's
logits and keys depend on that token's row only, never on how many other tokens, rows
or drafts share the pass.

Why a default pass is not: every reduction whose order follows the shape of the whole
pass. Measured on CPU (torch 2.13, oneDNN/MKL):

- a float32 matmul of M = 1 rows (a GEMV) rounds differently from the same row inside an
  M >= 2 GEMM, and rows of small M (2, 3, 5-7, 9-11) differ from M >= 12, which all agree;
- scaled-dot-product attention over the same keys gives other bits for a query computed in
  a causal prefill chunk than for the same query alone, and (float32) for a query whose
  keys are padded with masked slots, as the batched one-token group does.

Per-token ops (norms, RoPE, activations, residuals, the embedding) reduce within one
token and are invariant already.

So in this mode, two parts of the pass take a fixed shape:

- **Linear layers** run GEMMs of exactly `TILE_ROWS` rows each (the last padded with
  zero rows), on every device: a BLAS picks its kernel, blocking and split by shape, and
  on this project's 2-core Xeon a float32 row of the default model's `down_proj` rounds
  differently in a GEMM of 100 rows than of 300 (where one GEMM over the whole pass was
  the rule before); with one shape, every row sees one kernel.
  `deterministic_check.py` verifies this on each machine before the first deterministic run.
- **Attention** is one call per query token, over exactly the keys it sees (its row's
  slots 0..position, or the last `window` of them), with no mask and no padding, the
  query heads stacked per key/value head as in the one-token group. A query fed in a
  prompt, in a fast-forward chunk, as a draft or alone is then the same computation.

Cost: the attention loop is Python-level (T calls per layer) and pays a call's fixed
overhead per token, most on prompts; the padding costs a small batch's decode passes
(up to 16 rows where it has fewer). `bench/determinism.py`
measures both side by side. On CUDA the same rules hold (fixed-shape GEMMs pick one
kernel, one call per query fixes the split of the keys), at the same cost structure.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

# The fewest rows a linear layer's GEMM runs with (and the tile on CUDA). At or above 12
# the float32 CPU GEMM agrees with itself for every M (see above); 16 is a tile size GPU
# GEMM kernels also use.
TILE_ROWS = 16


def deterministic_linear(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear over `x` [..., K], the same bits per row for any number of rows: GEMMs of
    exactly TILE_ROWS rows each (the last one padded with zero rows), on every device, so
    every row goes through one kernel of one shape."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    padded = -(-rows // TILE_ROWS) * TILE_ROWS
    if padded != rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, k)])
    out = torch.cat([F.linear(flat[i : i + TILE_ROWS], weight, bias)
                     for i in range(0, padded, TILE_ROWS)])
    return out[:rows].reshape(*lead, out.shape[-1])


def install(model: torch.nn.Module, enabled: Any) -> None:
    """Make every `nn.Linear` of `model` run `deterministic_linear` while `enabled()` is
    true (inside a deterministic packed pass); otherwise it runs as before. Idempotent."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not getattr(module, "_aici_tiled", False):
            module.forward = types.MethodType(_forward(enabled), module)  # type: ignore[method-assign]
            module._aici_tiled = True  # type: ignore[assignment]


def _forward(enabled: Any) -> Any:
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if enabled():
            return deterministic_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
    return forward


def per_query_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    token_rows: list[int],
    token_slots: list[int],
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """query: [1, H, T, D] packed; key/value: the cache buffers [rows, kv_heads, cap, D]
    with this pass's keys already written. Token t (row `token_rows[t]`, position
    `token_slots[t]`) attends its row's slots up to its position, or the last `window`
    of them. Returns [T, H, D]."""
    heads, t, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[1]
    rep = heads // kv_heads
    # [H, T, D] -> [T, kv_heads, rep, D]: head h = kv group h // rep, as in repeat_kv.
    q = query[0].transpose(0, 1).reshape(t, kv_heads, rep, dim)
    out = query.new_empty(t, kv_heads, rep, dim)
    for i, (row, slot) in enumerate(zip(token_rows, token_slots)):
        lo = max(0, slot + 1 - window) if window is not None else 0
        k = key[row : row + 1, :, lo : slot + 1]
        v = value[row : row + 1, :, lo : slot + 1]
        out[i] = F.scaled_dot_product_attention(q[i : i + 1], k, v, scale=scaling)[0]
    return out.reshape(t, heads, dim)
