"""Reference decoding for tests: greedy tokens from full forward passes, no cache and no
engine, so that what it checks does not depend on the engine's own machinery."""

from __future__ import annotations

from typing import Any

import torch


def greedy_tokens(model: Any, ids: torch.Tensor, n: int) -> list[int]:
    """The `n` tokens greedy decoding appends to `ids` ([1, T]), end-of-sequence or not:
    one whole forward pass per token (O(n T) work: for short checks only)."""
    out: list[int] = []
    seq = ids
    with torch.inference_mode():
        for _ in range(n):
            token = int(model(input_ids=seq).logits[0, -1].float().argmax())
            out.append(token)
            seq = torch.cat([seq, torch.tensor([[token]], dtype=seq.dtype)], dim=1)
    return out
