"""Model inputs for one packed forward pass: tokens, positions, and the attention plan.

Row i of the span feeds `chunk_i` (1 sampled token, several fast-forward ones, a whole
prompt, or nothing) at positions `length_i .. length_i + n_i - 1`, which are also its
cache slots. The chunks are concatenated into one sequence `[1, T]` with no padding; see
`attention.py` for how attention keeps the rows apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aici_cli.engine.forward.attention import PackedPlan, RowRun, SingleGroup, packed


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    # A placeholder 4D mask: it tells transformers not to build one (attention.py ignores it).
    attention_mask: torch.Tensor | dict[str, torch.Tensor]
    # Packed indices whose logits the pass returns: first each row's next-token position
    # (0 for a row that fed nothing), so logits[:b] is [b, V] as a view; then each row's
    # other readout positions (`Readout.extras`), row by row.
    last: torch.Tensor
    extra_at: list[int]  # where row i's extra logits start in the returned logits
    plan: PackedPlan


@dataclass(frozen=True)
class Readout:
    """Where in a row's chunk the pass reads logits: `next_at`, the position whose logits
    pick the row's next token, and `extras`, other positions (ascending): earlier ones
    whose logits score tokens already fed (choices, logprobs), later ones that check a
    draft. Default: the chunk's last position only."""

    next_at: int
    extras: tuple[int, ...] = ()


@dataclass(frozen=True)
class AttentionLayout:
    """What the model needs from the attention mask: a sliding window, and whether it
    takes one mask per layer type."""

    sliding_window: int | None = None
    dict_mask: bool = False  # Gemma-style models take {"full_attention", "sliding_attention"}

    @classmethod
    def for_config(cls, config: object) -> AttentionLayout:
        layer_types = getattr(config, "layer_types", None) or []
        window = getattr(config, "sliding_window", None)
        if "sliding_attention" in layer_types and window:
            return cls(sliding_window=int(window), dict_mask=True)
        # A window and no layer types (Mistral 7B v0.1): every layer attends within it,
        # and each passes it to the attention (`rows_attention`'s `sliding_window`).
        if window and not layer_types:
            return cls(sliding_window=int(window))
        return cls()


def _run(row: int, start: int, length: int, n: int, window: int | None,
         device: torch.device) -> RowRun:
    """A multi-token row: causal over its own slots, within the window if there is one."""
    kv = length + n
    pos = torch.arange(length, kv)[:, None]  # [n, 1] query positions
    s = torch.arange(kv)[None, :]  # [1, kv] key slots = key positions
    # A fresh row (length 0) is plain causal attention: the fast path, no mask tensor.
    mask = None if length == 0 else (s <= pos).to(device)
    sliding = None
    if window is not None and kv > window:
        sliding = ((s <= pos) & (s > pos - window)).to(device)
    return RowRun(row=row, start=start, n=n, kv_len=kv, attn_mask=mask,
                  sliding_attn_mask=sliding)


def _single_group(lengths: Sequence[int], single_tok: list[int], members: list[int],
                  kv_len: int, window: int | None, device: torch.device) -> SingleGroup:
    """The rows feeding one token, attended in one batched call: every span row gets a
    query (`single_tok[i]`: its packed index, 0 for a non-member)."""
    b = len(lengths)
    length_t = torch.tensor(lengths, dtype=torch.long)[:, None]  # [b, 1]
    is_member = torch.zeros(b, 1, dtype=torch.bool)
    is_member[members] = True
    s = torch.arange(kv_len)[None, :]  # [1, kv]
    # A member's query (position = length) sees slots 0..length; a dummy sees slot 0,
    # so no softmax row is empty.
    full = torch.where(is_member, s <= length_t, s == 0)
    sliding = None
    if window is not None and kv_len > window:
        sliding = torch.where(is_member, (s <= length_t) & (s > length_t - window), s == 0)
        sliding = sliding[:, None, None].to(device)
    return SingleGroup(
        token=torch.tensor(single_tok, dtype=torch.long, device=device),
        members=torch.tensor(members, dtype=torch.long, device=device),
        member_tokens=torch.tensor([single_tok[i] for i in members], dtype=torch.long,
                                   device=device),
        kv_len=kv_len,
        attn_mask=full[:, None, None].to(device),
        sliding_attn_mask=sliding,
        lengths=torch.where(is_member[:, 0], length_t[:, 0] + 1, 0).to(device),
    )


# Long: one walk over the rows fills every per-token and per-row list at once (it runs
# every step); split, each part would walk the rows again.
def build_inputs(
    first_row: int,
    lengths: Sequence[int],
    chunks: Sequence[Sequence[int]],
    attention_layout: AttentionLayout,
    device: torch.device,
    readouts: Sequence[Readout | None] | None = None,
    deterministic: bool = False,
) -> ForwardInputs:
    """Inputs for rows `first_row ..` whose cache holds `lengths[i]` tokens and which feed
    `chunks[i]` (empty: the row sits this pass out). At least one chunk is non-empty.
    `readouts[i]` (default: the last position) says which of row i's positions to
    return logits for. `deterministic`: a pass of the deterministic mode
    (engine/forward/deterministic.py), which needs no masks.

    One walk over the rows fills every per-token and per-row list at once (this runs
    every step); hence its length."""
    b = len(chunks)
    window = attention_layout.sliding_window
    ids: list[int] = []
    positions: list[int] = []
    token_rows: list[int] = []
    last: list[int] = []
    extra: list[int] = []
    extra_at: list[int] = []
    single_tok = [0] * b
    members: list[int] = []
    runs: list[RowRun] = []
    single_kv = 1
    for i, (length, chunk) in enumerate(zip(lengths, chunks)):
        n = len(chunk)
        readout = readouts[i] if readouts is not None else None
        extra_at.append(b + len(extra))
        if n == 0:  # placeholders: the layout depends on the readouts only
            last.append(0)
            extra += [0] * (len(readout.extras) if readout is not None else 0)
            continue
        start = len(ids)
        ids += chunk
        positions += range(length, length + n)
        token_rows += [first_row + i] * n
        if readout is None:
            last.append(start + n - 1)
        else:
            last.append(start + readout.next_at)
            extra += (start + offset for offset in readout.extras)
        if deterministic:
            continue
        if n == 1:
            single_tok[i] = start
            members.append(i)
            single_kv = max(single_kv, length + 1)
        else:
            runs.append(_run(first_row + i, start, length, n, window, device))
    assert ids, "a forward pass needs at least one token"

    single = (_single_group(lengths, single_tok, members, single_kv, window, device)
              if members else None)
    pos_t = torch.tensor(positions, dtype=torch.long)
    plan = PackedPlan(
        rows=slice(first_row, first_row + b),
        token_rows=torch.tensor(token_rows, dtype=torch.long, device=device),
        token_slots=pos_t.to(device),
        kv_len=max(length + len(c) for length, c in zip(lengths, chunks)),
        single=single,
        runs=runs,
        deterministic=deterministic,
        token_row_list=token_rows if deterministic else None,
        token_slot_list=positions if deterministic else None,
    )
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    mask: torch.Tensor | dict[str, torch.Tensor] = placeholder
    if attention_layout.dict_mask:
        mask = {"full_attention": placeholder, "sliding_attention": placeholder}
    return ForwardInputs(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=pos_t[None].to(device),
        attention_mask=mask,
        last=torch.tensor(last + extra, dtype=torch.long, device=device),
        extra_at=extra_at,
        plan=plan,
    )


def forward(model: Any, cache: Any, inputs: ForwardInputs, project: bool = True) -> torch.Tensor:
    """One packed pass; returns the logits of the positions `inputs.last` names: [b, vocab]
    with the default `keep`, row i's last token in row i (rows that fed nothing get the
    logits of token 0, to be ignored). `project` False (the project's own Llama module
    only): their final hidden states [b, hidden] instead, for the masked projection."""
    cache.plan = inputs.plan
    with packed(inputs.plan):
        out = model(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,
            cache=cache,
            use_cache=True,
            logits_to_keep=inputs.last,
            **({} if project else {"project": False}),
        )
    return out.logits[0]
