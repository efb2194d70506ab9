"""Attention over the per-row cache for a packed, unpadded forward pass.

A step feeds every row a different number of tokens: one sampled token, a chunk of
fast-forward tokens, or a whole prompt. Padding those to one `[rows, longest]` block made a
single 12-token chunk cost the whole batch 12 query positions, and made prompts wait for
a separate prefill pass. Instead the step's tokens are packed into one sequence
`[1, T]`: projections, MLPs and norms see only real tokens, and attention, the only part
that needs to know which row a token belongs to, is done here per row group:

- rows feeding one token: one batched call over the span of rows, with the query heads
  of a key/value group stacked ([rows, kv_heads, heads_per_kv, D]), so no key is copied
  or repeated for grouped-query attention;
- rows feeding several tokens: one call each, over that row's cache slots only.

In a float32 pass where the int kernels' library is loaded, both groups attend on its
operator (`aici::rows_attention`), a multi-token row of up to `PER_QUERY_MAX` tokens one
query at a time over its own slots (its keys a stride-0 view): a token's attention is then
the same computation, bit for bit, whether it is fed in a prompt, a fast-forward chunk, a
draft or alone, and whatever rows share the pass, so a line's tokens do not depend on its
neighbours (docs/speed.md, "A line's text and its neighbours"). Longer rows (prompts) keep
SDPA: the same bits alone or beside other rows, other bits where the prefix cache has
supplied the prompt's start.

The model's attention layers call `rows_attention`: a `models/families/llama.py` model's directly,
a transformers model's through transformers' attention registry (`install`). Outside a
`packed(plan)` block it falls back to plain causal SDPA attention (transformers' own for
its models), so the same model object still runs ordinary forward passes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from aici_cli.engine.forward.deterministic import per_query_attention
from aici_cli.engine.forward.packed_runs import RunsMask, packed_runs_attention, takes_packed
from aici_cli.models.families.llama import Attention as OwnAttention
from aici_cli.models.families.llama import LlamaCausalLM, causal_attention
from aici_cli.models.families.softcap import softcapped_attention
from aici_cli.models.kernels.rows_attention import rows_attention as rows_attention_op

NAME = "aici_rows"
# The longest multi-token row whose queries attend one at a time on the one-token rows'
# operator (`_run_per_query`). Past it SDPA's blocked kernel wins: 1,000 and 1,500 query
# prompts' attention took 4.3x and 4.5x SDPA's time a layer on it (2 threads, default
# model's heads), at 300 queries the same time.
PER_QUERY_MAX = 256


@dataclass
class SingleGroup:
    """The rows of the span that feed exactly one token, attended in one call.

    Every row of the span gets a query (rows outside the group a dummy one that sees slot
    0 only and whose output is dropped), so the span's keys are read as a view.
    """

    token: torch.Tensor  # [S] long: packed index of each span row's query (0: dummy)
    members: torch.Tensor  # [m] long: span positions of the rows in the group
    member_tokens: torch.Tensor  # [m] long: their packed token indices
    kv_len: int  # slots visible: max over members of length + 1
    attn_mask: torch.Tensor  # [S, 1, 1, kv_len] bool
    sliding_attn_mask: torch.Tensor | None  # under the sliding window (None: no such layers)
    # [S] long: the slots each span row sees, from slot 0 (a member: its length + 1; a
    # dummy: 0), for the int kernels' attention over each row's own slots.
    lengths: torch.Tensor | None = None


@dataclass
class RowRun:
    """A row feeding n > 1 tokens (fast-forward chunk or prompt), attended on its own."""

    row: int  # buffer row
    start: int  # packed index of its first token
    n: int
    kv_len: int  # length before the pass + n
    attn_mask: torch.Tensor | None  # [n, kv_len] bool; None: plain causal (from slot 0)
    sliding_attn_mask: torch.Tensor | None  # under the sliding window; None: `attn_mask`


@dataclass
class PackedPlan:
    """Where one packed pass writes keys and which keys each query sees."""

    rows: slice  # the span of buffer rows the pass covers
    token_rows: torch.Tensor  # [T] long: buffer row of each packed token
    token_slots: torch.Tensor  # [T] long: its cache slot (= its position)
    kv_len: int  # max over rows of length + n
    single: SingleGroup | None
    runs: list[RowRun]
    # The deterministic mode (engine/forward/deterministic.py): one attention call per
    # token, from these lists (the tensors above as Python ints), and linear layers in
    # fixed tiles.
    deterministic: bool = False
    token_row_list: list[int] | None = None
    token_slot_list: list[int] | None = None
    # The multi-token rows in one call where launches bind (`packed_runs.py`): its block
    # masks and output index, made at the first layer and kept for the others.
    runs_mask: RunsMask = field(default_factory=RunsMask)


_state = threading.local()


@contextmanager
def packed(plan: PackedPlan) -> Iterator[None]:
    """Make `rows_attention` use `plan` for the forward passes inside the block."""
    _state.plan = plan
    try:
        yield
    finally:
        _state.plan = None


def current_plan() -> PackedPlan | None:
    return getattr(_state, "plan", None)


def deterministic_pass() -> bool:
    """True inside a packed pass of the deterministic mode."""
    plan = current_plan()
    return plan is not None and plan.deterministic


def install(model: Any) -> None:
    """Route the model's attention through `rows_attention` (idempotent)."""
    if isinstance(model, LlamaCausalLM):  # no registry to go through
        model.set_attention(rows_attention)
        return
    # transformers' masking utilities cost ~1 s to import: only for its models.
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, rows_attention)
    # Outside `packed`, masks are built exactly as for transformers' SDPA attention.
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)


def _unplanned(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
               scaling: float | None, sliding_window: int | None, softcap: float | None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention outside a step's plan (a plain forward): the model's own causal
    attention, or transformers' SDPA; soft-capped scores explicitly (no SDPA kernel
    caps them, and transformers' SDPA function drops the cap)."""
    if softcap is not None:
        o = softcapped_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                 is_causal=attention_mask is None and query.shape[2] > 1,
                                 enable_gqa=True, softcap=softcap)
        return o.transpose(1, 2).contiguous(), None
    if isinstance(module, OwnAttention):
        return causal_attention(module, query, key, value, attention_mask, scaling=scaling,
                                sliding_window=sliding_window)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask,
                                  dropout=dropout, scaling=scaling,
                                  sliding_window=sliding_window, **kwargs)


def rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [1, H, T, D] packed; key/value: the whole cache buffers
    [rows, kv_heads, capacity, D] (see `RowCache.update`). Returns [1, T, H, D]."""
    plan = current_plan()
    softcap = kwargs.pop("softcap", None)
    # Soft-capped logits (Gemma 2) have no SDPA kernel: the same call, scores explicit.
    attend = (F.scaled_dot_product_attention if softcap is None
              else functools.partial(softcapped_attention, softcap=softcap))
    if plan is None:
        return _unplanned(module, query, key, value, attention_mask, dropout, scaling,
                          sliding_window, softcap, **kwargs)
    if plan.deterministic:
        if softcap is not None:
            raise NotImplementedError("attention logit soft-capping in --deterministic")
        assert plan.token_row_list is not None and plan.token_slot_list is not None
        return per_query_attention(query, key, value, plan.token_row_list,
                                   plan.token_slot_list, scaling, sliding_window)[None], None
    heads, t, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[1]
    rep = heads // kv_heads
    windowed = sliding_window is not None
    out = query.new_empty(t, heads, dim)

    if plan.single is not None:
        _one_token_rows(plan, plan.single, query, key, value, out, scaling, windowed, softcap,
                      attend)
    runs = plan.runs
    if softcap is None and takes_packed(runs, query.device):  # one call for them all
        o = packed_runs_attention(query, key, value, runs,
                                  plan.runs_mask.get(runs, windowed, query.device), scaling)
        out.index_copy_(0, plan.runs_mask.tokens(runs, query.device), o)
        runs = []
    for r in runs:
        if r.n <= PER_QUERY_MAX and softcap is None and \
                not (windowed and r.sliding_attn_mask is not None) and \
                _run_per_query(r, query, key, value, out, scaling):
            continue
        # Contiguous: the same strides alone or beside other rows (SDPA's bf16 path gave
        # a row other bits as its query sat in a longer packed pass).
        q = query[:, :, r.start : r.start + r.n].contiguous()  # [1, H, n, D]
        k = key[r.row : r.row + 1, :, : r.kv_len]
        v = value[r.row : r.row + 1, :, : r.kv_len]
        run_mask = (r.sliding_attn_mask if windowed and r.sliding_attn_mask is not None
                    else r.attn_mask)
        o = attend(
            q, k, v, attn_mask=run_mask, is_causal=run_mask is None, scale=scaling,
            enable_gqa=rep > 1,
        )
        out[r.start : r.start + r.n] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _one_token_rows(plan: PackedPlan, g: SingleGroup, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, out: torch.Tensor, scaling: float | None,
                  windowed: bool, softcap: float | None, attend: Any) -> None:
    """The rows feeding one token, in one call, into `out` [T, H, D] at their tokens."""
    heads, dim = query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    span = g.token.shape[0]
    # [H, S, D] -> [S, kv_heads, rep, D]: head h = kv group h // rep, as in repeat_kv.
    q = query[0].index_select(1, g.token).transpose(0, 1).reshape(span, kv_heads,
                                                                   heads // kv_heads, dim)
    k = key[plan.rows, :, : g.kv_len]
    v = value[plan.rows, :, : g.kv_len]
    mask = (g.sliding_attn_mask if windowed and g.sliding_attn_mask is not None
            else g.attn_mask)
    # Each row over its own slots, where the int kernels' library has the operator
    # (SDPA reads every row up to the longest, a dummy row's too): no window, no cap.
    o = (rows_attention_op(q, k, v, g.lengths, dim ** -0.5 if scaling is None else scaling)
         if g.lengths is not None and mask is g.attn_mask and softcap is None else None)
    if o is None:
        o = attend(q, k, v, attn_mask=mask, scale=scaling)
    out[g.member_tokens] = o.reshape(span, heads, dim)[g.members]


def _run_per_query(r: RowRun, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   out: torch.Tensor, scaling: float | None) -> bool:
    """A multi-token row's queries each over its row's slots up to its own position, on
    the one-token rows' operator, into `out` [T, H, D]; False where the operator does not
    apply (the caller attends with SDPA). Each query is then the very computation it is
    fed alone: a token's attention has the same bits in a prompt, a fast-forward chunk,
    a draft or a one-token pass, however a line's tokens were split into passes (the
    prefix cache, drafts, the neighbours' share of the pass). The row's keys are read
    through a view that repeats it per query (stride 0), nothing copied."""
    heads, dim = query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    # [H, n, D] -> [n, kv_heads, rep, D]: head h = kv group h // rep, as in repeat_kv.
    q = query[0, :, r.start : r.start + r.n].transpose(0, 1).reshape(
        r.n, kv_heads, heads // kv_heads, dim)
    k = key[r.row : r.row + 1, :, : r.kv_len].expand(r.n, -1, -1, -1)
    v = value[r.row : r.row + 1, :, : r.kv_len].expand(r.n, -1, -1, -1)
    lengths = torch.arange(r.kv_len - r.n + 1, r.kv_len + 1, device=query.device)
    o = rows_attention_op(q, k, v, lengths, dim ** -0.5 if scaling is None else scaling)
    if o is None:
        return False
    out[r.start : r.start + r.n] = o.reshape(r.n, heads, dim)
    return True
