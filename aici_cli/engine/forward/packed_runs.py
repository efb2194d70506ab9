"""The multi-token rows of a pass (prompts, fast-forward chunks, drafts) in one attention
call, where launches bound the step (an accelerator): each row's queries and its cache
slots packed end to end, and a block mask that lets a query see its own row's slots only,
up to its own position (or the row's own mask, a sliding window's or a prompt's).

Equal to one call per row (the loop in `attention.rows_attention`), which the CPU keeps:
there the loop reads each row's own slots with no mask, where the packed call reads a
[N, S] mask and scores for every pair of the pass's queries and slots (N queries, S slots
over all runs). So it is taken where the device is in `PACKED_ON` and N S stays under
`MAX_PAIRS` (a long prompt's square would dominate memory); otherwise the loop runs.

Cost: the rows' keys and values copied once a layer ([kv_heads, S, D] each), and the mask
built once a pass (`RunsMask`, kept for every layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

# Devices whose passes attend the runs in one call; a test adds the CPU's.
PACKED_ON = {"cuda"}
# The largest N x S the packed call may score: 4 M pairs (16 MB of float32 scores a head).
MAX_PAIRS = 1 << 22


class Run(Protocol):
    """A row feeding n > 1 tokens (`attention.RowRun`)."""

    row: int
    start: int
    n: int
    kv_len: int
    attn_mask: torch.Tensor | None
    sliding_attn_mask: torch.Tensor | None


@dataclass
class RunsMask:
    """A pass's block masks, made at its first layer and kept for the others."""

    masks: dict[bool, torch.Tensor] = field(default_factory=dict)  # by windowed
    index: torch.Tensor | None = None  # [N] long: the runs' packed token indices, in order

    def tokens(self, runs: Sequence[Run], device: torch.device) -> torch.Tensor:
        """Where the packed call's N outputs go in the pass's [T, H, D] output."""
        if self.index is None:
            self.index = torch.cat([torch.arange(r.start, r.start + r.n) for r in runs]
                                   ).to(device)
        return self.index

    def get(self, runs: Sequence[Run], windowed: bool, device: torch.device) -> torch.Tensor:
        mask = self.masks.get(windowed)
        if mask is None:
            mask = self.masks[windowed] = block_mask(runs, windowed, device)
        return mask


def takes_packed(runs: Sequence[Run], device: torch.device) -> bool:
    """Whether a pass's runs attend in one call: several of them, on a device of
    `PACKED_ON`, with at most `MAX_PAIRS` query-slot pairs."""
    if len(runs) < 2 or device.type not in PACKED_ON:
        return False
    return sum(r.n for r in runs) * sum(r.kv_len for r in runs) <= MAX_PAIRS


def block_mask(runs: Sequence[Run], windowed: bool, device: torch.device) -> torch.Tensor:
    """[N, S] bool: query i of run r sees slot j of run r where the run's own mask says
    (its sliding window's where `windowed`), else where j <= its position (causal from slot
    0: the run's n queries are its last n slots); never another run's slots."""
    n_all, s_all = sum(r.n for r in runs), sum(r.kv_len for r in runs)
    mask = torch.zeros(n_all, s_all, dtype=torch.bool, device=device)
    qa = ka = 0
    for r in runs:
        own = r.sliding_attn_mask if windowed and r.sliding_attn_mask is not None \
            else r.attn_mask
        if own is None:
            q = torch.arange(r.n, device=device)[:, None] + (r.kv_len - r.n)
            own = torch.arange(r.kv_len, device=device)[None, :] <= q
        mask[qa : qa + r.n, ka : ka + r.kv_len] = own.reshape(r.n, r.kv_len)
        qa += r.n
        ka += r.kv_len
    return mask


def packed_runs_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          runs: Sequence[Run], mask: torch.Tensor,
                          scaling: float | None) -> torch.Tensor:
    """query [1, H, T, D] packed; key/value [rows, kv_heads, capacity, D]; `mask` the
    runs' `block_mask`. Returns [N, H, D]: each run's queries' outputs, runs in order."""
    heads, kv_heads = query.shape[1], key.shape[1]
    q = torch.cat([query[0, :, r.start : r.start + r.n] for r in runs], dim=1)  # [H, N, D]
    k = torch.cat([key[r.row, :, : r.kv_len] for r in runs], dim=1)  # [kv_heads, S, D]
    v = torch.cat([value[r.row, :, : r.kv_len] for r in runs], dim=1)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                       scale=scaling, enable_gqa=heads > kv_heads)
    return o[0].transpose(0, 1)  # [N, H, D]
