"""`aici::rows_attention` (models/kernels/rows_attention.py over native/rows_attention.c,
built into the int kernels' library): each row's few query heads a key/value head over
the row's own first `lengths[s]` slots, against a float64 model of attention over
generated shapes, lengths (0 included) and cache views; and the eager passes' one-token
group through it, against the same group through PyTorch's attention over a real packed
plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.engine.forward.attention import packed, rows_attention
from aici_cli.engine.forward.inputs import AttentionLayout, build_inputs
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels import rows_attention as op

WHY_NOT = int_mm.unusable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no int kernel: {WHY_NOT}")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
               scale: float) -> torch.Tensor:
    """One row's [G, R, D] in float64: softmax(q k^T scale) v over slots < length."""
    scores = torch.einsum("grd,gjd->grj", q.double(), k[:, :length].double()) * scale
    return torch.einsum("grj,gjd->grd", scores.softmax(-1), v[:, :length].double())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), kv_heads=st.integers(1, 4), rep=st.integers(1, 8),
       dim=st.sampled_from([8, 16, 24, 64, 80, 128]), capacity=st.integers(1, 300),
       spare_rows=st.integers(0, 2), magnitude=st.sampled_from([0.1, 1.0, 8.0]),
       seed=st.integers(0, 2**31 - 1), bf16=st.booleans(), data=st.data())
def test_each_row_attends_over_its_own_slots(rows: int, kv_heads: int, rep: int, dim: int,
                                             capacity: int, spare_rows: int, magnitude: float,
                                             seed: int, bf16: bool, data: Any) -> None:
    """float32 rows against the float64 model; bf16 rows are the float32 computation of
    their bf16 values, rounded once, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    # The cache's buffers as the engine's: more rows and slots than the call reads, and
    # the call's keys a view of its rows.
    keys = torch.randn(rows + spare_rows, kv_heads, capacity + 5, dim, generator=g) * magnitude
    values = torch.randn(rows + spare_rows, kv_heads, capacity + 5, dim, generator=g)
    q = torch.randn(rows, kv_heads, rep, dim, generator=g) * magnitude
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, capacity), min_size=rows,
                                              max_size=rows)), dtype=torch.long)
    scale = dim ** -0.5
    k = keys[spare_rows:, :, :capacity]
    v = values[spare_rows:, :, :capacity]
    if bf16:
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        out = op.rows_attention(q, k, v, lengths, scale)
        wide = op.rows_attention(q.float(), k.float(), v.float(), lengths, scale)
        assert out is not None and wide is not None and out.dtype == torch.bfloat16
        assert torch.equal(out, wide.bfloat16())
        return
    out = op.rows_attention(q, k, v, lengths, scale)
    assert out is not None and out.shape == q.shape and out.dtype == torch.float32
    for s in range(rows):
        n = int(lengths[s])
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))
            continue
        want = _reference(q[s], k[s], v[s], n, scale)
        assert torch.allclose(out[s].double(), want, atol=2e-5, rtol=1e-4), \
            float((out[s].double() - want).abs().max())


def test_it_refuses_a_length_past_the_cache_and_leaves_other_dtypes_to_sdpa() -> None:
    q = torch.randn(2, 1, 3, 16)
    kv = torch.randn(2, 1, 8, 16)
    with pytest.raises(RuntimeError, match="a length past the cache"):
        op.rows_attention(q, kv, kv, torch.tensor([3, 9]), 0.25)
    assert op.rows_attention(q.half(), kv.half(), kv.half(), torch.tensor([3, 4]), 0.25) is None
    assert op.rows_attention(q, kv.bfloat16(), kv.bfloat16(), torch.tensor([3, 4]), 0.25) is None


class _Module(torch.nn.Module):
    pass


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 60), min_size=1, max_size=8),
       fed=st.lists(st.integers(0, 5), min_size=8, max_size=8), seed=st.integers(0, 2**31))
def test_a_packed_passs_one_token_rows_attend_as_through_sdpa(
        lengths: list[int], fed: list[int], seed: int) -> None:
    """Rows feeding one token (the group the operator takes at once), several (each of
    its queries on the operator: a float32 row of up to PER_QUERY_MAX tokens) or none, at
    generated cache lengths: the pass's attention output is PyTorch's to float32
    rounding, and the operator took every call."""
    from aici_cli.engine.forward import attention

    chunks = [[7] * n for n in fed[: len(lengths)]]
    if not any(chunks):
        chunks[0] = [7]
    heads, kv_heads, dim = 6, 2, 16
    g = torch.Generator().manual_seed(seed)
    inputs = build_inputs(0, lengths, chunks, AttentionLayout(), torch.device("cpu"))
    t = inputs.input_ids.shape[1]
    capacity = max(n + len(c) for n, c in zip(lengths, chunks))
    query = torch.randn(1, heads, t, dim, generator=g)
    key = torch.randn(len(lengths), kv_heads, capacity + 3, dim, generator=g)
    value = torch.randn(len(lengths), kv_heads, capacity + 3, dim, generator=g)
    taken: list[bool] = []
    real = attention.rows_attention_op

    def counted(*args: Any) -> torch.Tensor | None:
        out = real(*args)
        taken.append(out is not None)
        return out

    try:
        with packed(inputs.plan):
            attention.rows_attention_op = counted
            fast, _ = rows_attention(_Module(), query, key, value, None, scaling=0.25)
            # PyTorch's attention, as without the library.
            attention.rows_attention_op = lambda *args: None  # type: ignore[assignment]
            plain, _ = rows_attention(_Module(), query, key, value, None, scaling=0.25)
    finally:
        attention.rows_attention_op = real
    assert taken and all(taken)
    assert torch.allclose(fast, plain, atol=1e-5, rtol=1e-4), float((fast - plain).abs().max())
