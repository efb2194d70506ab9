"""Model inputs for one ragged forward pass: tokens, positions, cache slots and the mask.

Row i feeds `chunk_i` (1 sampled token, several forced ones, or a whole prompt) at
positions `length_i .. length_i + n_i - 1`, which are also its cache slots. Chunks are
right-padded to the longest one; padding queries write to the scratch slot and attend to
slot 0 only, so no softmax row is empty and no live key is disturbed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aici_cli.engine.cache import ForwardPlan


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # [b, q] long
    position_ids: torch.Tensor  # [b, q] long
    attention_mask: torch.Tensor | dict[str, torch.Tensor]  # 4D bool [b, 1, q, kv_len]
    last: torch.Tensor  # [b, 1] long: index of each row's last real query
    plan: ForwardPlan


@dataclass(frozen=True)
class MaskShape:
    """What the model needs from the mask: a sliding window, and whether it takes a dict."""

    sliding_window: int | None = None
    dict_mask: bool = False  # Gemma-style models take {"full_attention", "sliding_attention"}

    @classmethod
    def for_config(cls, config: object) -> MaskShape:
        layer_types = getattr(config, "layer_types", None) or []
        window = getattr(config, "sliding_window", None)
        if "sliding_attention" in layer_types and window:
            return cls(sliding_window=int(window), dict_mask=True)
        return cls()


def build_inputs(
    rows: slice | Sequence[int],
    lengths: Sequence[int],
    chunks: Sequence[Sequence[int]],
    scratch_slot: int,
    pad_id: int,
    mask_shape: MaskShape,
    device: torch.device,
) -> ForwardInputs:
    """Inputs for rows whose cache holds `lengths[i]` tokens and which feed `chunks[i]`.

    An empty chunk marks an idle row inside a contiguous span: all its queries are padding.
    `rows` as an index list is only for fresh rows (every length 0).
    """
    b = len(chunks)
    q = max(1, max(len(c) for c in chunks))
    fresh = not isinstance(rows, slice)
    ids = torch.full((b, q), pad_id, dtype=torch.long)
    for i, c in enumerate(chunks):
        if c:
            ids[i, : len(c)] = torch.as_tensor(c, dtype=torch.long)
    n = torch.tensor([len(c) for c in chunks], dtype=torch.long)  # [b]
    length = torch.tensor(lengths, dtype=torch.long)  # [b]
    j = torch.arange(q, dtype=torch.long)  # [q]
    real = j[None, :] < n[:, None]  # [b, q]
    pos = length[:, None] + j[None, :]  # [b, q]
    position_ids = torch.where(real, pos, torch.zeros_like(pos))
    slots = torch.where(real, pos, torch.full_like(pos, scratch_slot))
    kv_len = q if fresh else max(1, int((length + n).max()))

    s = torch.arange(kv_len, dtype=torch.long)  # [kv]
    causal = s[None, None, :] <= pos[:, :, None]  # [b, q, kv]
    pad_key = s[None, None, :] == 0
    full = torch.where(real[:, :, None], causal, pad_key)
    mask: torch.Tensor | dict[str, torch.Tensor] = full[:, None].to(device)
    if mask_shape.sliding_window is not None:
        # By position, not by slot; here they coincide because slot s holds position s.
        in_window = s[None, None, :] > pos[:, :, None] - mask_shape.sliding_window
        sliding = torch.where(real[:, :, None], causal & in_window, pad_key)
        mask = {"full_attention": mask, "sliding_attention": sliding[:, None].to(device)}

    last = (n - 1).clamp(min=0)[:, None]
    plan = ForwardPlan(
        rows=rows if isinstance(rows, slice) else torch.tensor(list(rows), device=device),
        slots=slots.to(device),
        kv_len=kv_len,
        fresh=fresh,
    )
    return ForwardInputs(
        input_ids=ids.to(device),
        position_ids=position_ids.to(device),
        attention_mask=mask,
        last=last.to(device),
        plan=plan,
    )
