"""The multi-token rows of a pass in one attention call (`packed_runs.py`) equal one call
per row, as `attention.rows_attention` makes them: hypothesis over row counts, lengths,
cached prefixes, grouped-query heads and rows with masks of their own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.engine.forward.packed_runs import (
    MAX_PAIRS,
    block_mask,
    packed_runs_attention,
    takes_packed,
)
from aici_cli.models.load import LoadedModel


@dataclass
class Run:
    row: int
    start: int
    n: int
    kv_len: int
    attn_mask: torch.Tensor | None
    sliding_attn_mask: torch.Tensor | None = None


def loop(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: list[Run],
         windowed: bool) -> torch.Tensor:
    """One SDPA call a run, as the pass's loop makes them: [N, H, D] in run order."""
    outs = []
    rep = query.shape[1] // key.shape[1]
    for r in runs:
        mask = r.sliding_attn_mask if windowed and r.sliding_attn_mask is not None \
            else r.attn_mask
        o = F.scaled_dot_product_attention(
            query[:, :, r.start : r.start + r.n], key[r.row : r.row + 1, :, : r.kv_len],
            value[r.row : r.row + 1, :, : r.kv_len], attn_mask=mask, is_causal=mask is None,
            enable_gqa=rep > 1)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), runs=st.integers(1, 4), kv_heads=st.integers(1, 2),
       rep=st.integers(1, 3), windowed=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_the_packed_call_equals_one_call_a_row(data: st.DataObject, runs: int, kv_heads: int,
                                               rep: int, windowed: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    dim, rows, capacity = 8, 5, 24
    row_ids = data.draw(st.lists(st.integers(0, rows - 1), min_size=runs, max_size=runs,
                                 unique=True))
    plan: list[Run] = []
    start = data.draw(st.integers(0, 3))  # one-token rows may come first in the packing
    for row in row_ids:
        n = data.draw(st.integers(2, 6))
        kv_len = n + data.draw(st.integers(0, capacity - 6))  # a cached prefix before it
        own = None  # plain causal from slot 0: a row without a prefix (as `inputs.py` plans)
        if kv_len > n or data.draw(st.booleans()):  # causal past a prefix, maybe with holes
            causal = (torch.arange(kv_len)[None, :]
                      <= torch.arange(n)[:, None] + (kv_len - n))
            holes = torch.rand(n, kv_len, generator=g) < 0.3 * data.draw(st.integers(0, 1))
            own = causal & ~holes
            own[torch.arange(n), torch.arange(n) + (kv_len - n)] = True
        sliding = None
        if own is not None and data.draw(st.booleans()):
            sliding = own.clone()
            sliding[:, : kv_len // 2] = False
            sliding[torch.arange(n), torch.arange(n) + (kv_len - n)] = True
        plan.append(Run(row, start, n, kv_len, own, sliding))
        start += n + data.draw(st.integers(0, 2))
    heads = kv_heads * rep
    query = torch.randn(1, heads, start + 2, dim, generator=g)
    key = torch.randn(rows, kv_heads, capacity, dim, generator=g)
    value = torch.randn(rows, kv_heads, capacity, dim, generator=g)
    mask = block_mask(plan, windowed, torch.device("cpu"))
    got = packed_runs_attention(query, key, value, plan, mask, None)
    want = loop(query, key, value, plan, windowed)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_the_packed_call_is_taken_where_launches_bind_and_its_square_is_small() -> None:
    runs = [Run(0, 0, 4, 10, None), Run(1, 4, 3, 3, None)]
    assert takes_packed(runs, torch.device("cuda"))
    assert not takes_packed(runs, torch.device("cpu"))  # the loop reads less there
    assert not takes_packed(runs[:1], torch.device("cuda"))  # one row: its own call
    big = [Run(0, 0, 2048, 2048, None), Run(1, 2048, 2048, 2048, None)]
    assert MAX_PAIRS < 4096 * 4096 and not takes_packed(big, torch.device("cuda"))


def test_a_pass_takes_the_packed_call_with_the_loops_logits(lm: LoadedModel,
                                                             monkeypatch: Any) -> None:
    """Three prompts in one pass, then each row's next chunk of three over its cached
    prompt: a pass whose runs attend in one call (the CPU let in, as CUDA takes it) gives
    the loop's logits, and its rows' keys and values, to float32 rounding."""
    from aici_cli.engine.forward import packed_runs
    from aici_cli.engine.forward.attention import install
    from aici_cli.engine.forward.cache import RowCache
    from aici_cli.engine.forward.inputs import AttentionLayout, build_inputs, forward

    install(lm.model)
    layout = AttentionLayout.for_config(lm.model.config)
    layers = int(lm.model.config.num_hidden_layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (7, 3, 11)]
    chunks = [torch.randint(5, 200, (3,), generator=g).tolist() for _ in prompts]

    def passes(packed: bool) -> tuple[torch.Tensor, torch.Tensor, RowCache]:
        monkeypatch.setattr(packed_runs, "PACKED_ON", {"cuda", "cpu"} if packed else {"cuda"})
        cache = RowCache(layers, 3, 32)
        with torch.inference_mode():
            first = forward(lm.model, cache, build_inputs(0, [0, 0, 0], prompts, layout,
                                                          torch.device("cpu")))
            second = forward(lm.model, cache, build_inputs(
                0, [len(p) for p in prompts], chunks, layout, torch.device("cpu")))
        return first, second, cache

    from aici_cli.engine.forward import attention

    calls: list[int] = []
    real = attention.packed_runs_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "packed_runs_attention", counted)
    loop_first, loop_second, loop_cache = passes(False)
    assert not calls
    one_first, one_second, one_cache = passes(True)
    assert len(calls) == 2 * layers  # every layer of both passes, once
    assert torch.allclose(one_first, loop_first, atol=1e-4)
    assert torch.allclose(one_second, loop_second, atol=1e-4)
    for a, b in zip(one_cache.keys, loop_cache.keys):
        assert torch.allclose(a, b, atol=1e-4)
