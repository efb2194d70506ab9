"""A preallocated KV cache with its own length per row.

Slot s of a row holds the keys/values of position s, so the engine's bookkeeping is O(1):
backtrack is "length -= n", refill is "length = 0, prefill into that row". transformers'
`StaticCache` cannot do this (one shared length for the whole batch) and `DynamicCache`
grows without bound when rows are ragged.

Buffers are `[rows, kv_heads, capacity + 1, head_dim]` per layer. The extra last slot is
scratch: padding queries of a ragged step write there, and no query ever reads it
(`kv_len <= capacity`), so padding never disturbs a live row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache


@dataclass
class ForwardPlan:
    """Where one forward pass reads and writes, for `b` rows of `q` query positions.

    `rows` selects buffer rows: a slice (a contiguous span, read without copying) or an
    index tensor (only for fresh rows, whose keys are the ones being written).
    """

    rows: slice | torch.Tensor
    slots: torch.Tensor  # [b, q] long: cache slot each query writes (scratch for padding)
    kv_len: int  # keys visible to this pass: max over rows of (length + chunk)
    fresh: bool  # every row starts at length 0: attention reads only this pass's keys


class RowCache(Cache):
    """The cache object handed to the model as `cache=`; see the module docstring."""

    def __init__(self, num_layers: int, rows: int, capacity: int) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.rows = rows
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.plan: ForwardPlan | None = None

    @property
    def scratch_slot(self) -> int:
        return self.capacity

    def ensure_capacity(self, needed: int) -> None:
        """Grow every buffer (doubling) so that `needed` slots fit; copies live data once."""
        if needed <= self.capacity:
            return
        new_capacity = self.capacity
        while new_capacity < needed:
            new_capacity *= 2
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = old.new_zeros(old.shape[0], old.shape[1], new_capacity + 1, old.shape[3])
                new[:, :, : self.capacity] = old[:, :, : self.capacity]
                bufs[i] = new
        self.capacity = new_capacity

    def _allocate(self, like: torch.Tensor) -> None:
        # Zeros, not empty: a padding query may attend to slot 0 of an idle row, which must
        # hold finite numbers.
        shape = (self.rows, like.shape[1], self.capacity + 1, like.shape[3])
        for _ in range(self.num_layers):
            self.keys.append(torch.zeros(shape, dtype=like.dtype, device=like.device))
            self.values.append(torch.zeros(shape, dtype=like.dtype, device=like.device))

    def update(  # type: ignore[override]
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [b, kv_heads, q, head_dim], RoPE already applied.
        plan = self.plan
        assert plan is not None, "RowCache.plan must be set before each forward pass"
        if not self.keys:
            self._allocate(key_states)
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        if isinstance(plan.rows, slice):
            row_idx = torch.arange(self.rows, device=k_buf.device)[plan.rows]
        else:
            row_idx = plan.rows
        # Advanced indices around a slice put them first: the target view is [b, q, H, D].
        k_buf[row_idx[:, None], :, plan.slots] = key_states.transpose(1, 2)
        v_buf[row_idx[:, None], :, plan.slots] = value_states.transpose(1, 2)
        if plan.fresh:
            return key_states, value_states
        assert isinstance(plan.rows, slice)
        return k_buf[plan.rows, :, : plan.kv_len], v_buf[plan.rows, :, : plan.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.plan.kv_len if self.plan is not None else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:  # type: ignore[override]
        return (self.plan.kv_len if self.plan is not None else query_length), 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return False
