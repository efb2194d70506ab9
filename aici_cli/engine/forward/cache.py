"""A preallocated KV cache with its own length per row.

Slot s of a row holds the keys/values of position s, so the engine's bookkeeping is O(1):
backtrack is "length -= n", refill is "length = 0, prefill into that row". transformers'
`StaticCache` cannot do this (one shared length for the whole batch) and `DynamicCache`
grows without bound when rows are ragged.

Buffers are `[rows, kv_heads, capacity, head_dim]` per layer. A pass writes each packed
token's keys at (its row, its position) and hands the whole buffers to
`attention.rows_attention`, which reads each row's slots as views.

Memory: on the CPU the buffers are anonymous memory maps, which the OS fills with zeros
page by page on first write: a row no line uses and the slots past a row's length take
no memory, where `torch.zeros` would write every byte at once (94 MB and ~0.1 s for the
default model's 8 rows of 256 slots in float32, all resident in a one-line run).
"""

from __future__ import annotations

import math
import mmap
from functools import lru_cache
from typing import Any

import torch

from aici_cli.engine.forward.attention import PackedPlan


def row_cache(model: Any, num_layers: int, rows: int, capacity: int) -> RowCache:
    """The cache for `model`: a transformers `Cache` too where the model is transformers'
    (its classes check), a plain `RowCache` for `models/families/llama.py`'s (importing
    transformers' cache module would import transformers, ~0.45 s at start-up)."""
    from aici_cli.models.families.llama import LlamaCausalLM

    if isinstance(model, LlamaCausalLM):
        return RowCache(num_layers, rows, capacity)
    return _transformers_row_cache()(num_layers, rows, capacity)


@lru_cache(maxsize=1)
def _transformers_row_cache() -> type[RowCache]:
    from transformers.cache_utils import Cache

    class TransformersRowCache(RowCache, Cache):  # type: ignore[misc]
        """A `RowCache` that transformers' models take as their `Cache`."""

        def __init__(self, num_layers: int, rows: int, capacity: int) -> None:
            Cache.__init__(self, layers=[])
            RowCache.__init__(self, num_layers, rows, capacity)

    return TransformersRowCache


class RowCache:
    """The cache object handed to the model as `cache=`; see the module docstring."""

    def __init__(self, num_layers: int, rows: int, capacity: int) -> None:
        self.num_layers = num_layers
        self.rows = rows
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.plan: PackedPlan | None = None

    def ensure_capacity(self, needed: int) -> None:
        """Grow every buffer (doubling) so that `needed` slots fit; copies live data once.

        Buffers are replaced one by one, so an allocation failure part-way leaves some
        grown and some not: both hold every live slot, and a retry grows the rest."""
        if needed <= self.capacity:
            return
        new_capacity = self.capacity
        while new_capacity < needed:
            new_capacity *= 2
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                if old.shape[2] >= new_capacity:
                    continue
                new = zeros((old.shape[0], old.shape[1], new_capacity, old.shape[3]),
                            old.dtype, old.device)
                new[:, :, : old.shape[2]] = old
                bufs[i] = new
        self.capacity = new_capacity

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give row `dst` the keys/values of row `src`'s first `n` slots (a shared prompt:
        n tokens copied per layer instead of recomputed)."""
        for bufs in (self.keys, self.values):
            for buf in bufs:
                buf[dst, :, :n] = buf[src, :, :n]

    def _allocate(self, like: torch.Tensor) -> None:
        # Zeros, not empty: a dummy query attends to slot 0 of a row sitting a pass out,
        # which must hold finite numbers.
        shape = (self.rows, like.shape[1], self.capacity, like.shape[3])
        for _ in range(self.num_layers):
            self.keys.append(zeros(shape, like.dtype, like.device))
            self.values.append(zeros(shape, like.dtype, like.device))

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [1, kv_heads, T, head_dim] packed, RoPE already applied.
        plan = self.plan
        assert plan is not None, "RowCache.plan must be set before each forward pass"
        if not self.keys:
            self._allocate(key_states)
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        # Two index tensors around a slice: the target view is [T, kv_heads, head_dim].
        k_buf[plan.token_rows, :, plan.token_slots] = key_states[0].transpose(0, 1)
        v_buf[plan.token_rows, :, plan.token_slots] = value_states[0].transpose(0, 1)
        return k_buf, v_buf

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.plan.kv_len if self.plan is not None else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (self.plan.kv_len if self.plan is not None else query_length), 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return False


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros; on the CPU over a private anonymous map, whose pages become
    resident only when written (see the module docstring). The tensor keeps the map."""
    size = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or size == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # Windows
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)
