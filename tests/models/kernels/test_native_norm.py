"""`aici::rms_norm` (models/kernels/native_norm.py over int_mm.cpp): the norm modules'
own forward bit for bit, eager and inside a compiled graph, where inductor would
otherwise fuse the norm and sum its squares in an order of its own."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.models.families.llama import OffsetRMSNorm, RMSNorm
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels.native_norm import NativeNorm, native_norm

WHY_NOT = int_mm.unusable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no int kernel: {WHY_NOT}")


def _norm(offset: bool, size: int, eps: float, dtype: torch.dtype,
          gen: torch.Generator) -> torch.nn.Module:
    norm = OffsetRMSNorm(size, eps) if offset else RMSNorm(size, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=gen) * 0.5 + (0.0 if offset else 1.0))
    return norm.to(dtype)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 17), size=st.sampled_from([8, 64, 576, 1000]),
       offset=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       eps=st.sampled_from([1e-5, 1e-6]), magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=st.integers(0, 2**31 - 1))
def test_the_op_is_the_modules_forward_bit_for_bit(rows: int, size: int, offset: bool,
                                                   dtype: torch.dtype, eps: float,
                                                   magnitude: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    norm = _norm(offset, size, eps, dtype, gen)
    wrapped = native_norm(norm)
    assert isinstance(wrapped, NativeNorm) and wrapped.offset == offset
    x = (torch.randn(rows, size, generator=gen) * magnitude).to(dtype)
    with torch.inference_mode():
        want, got = norm(x), wrapped(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_unknown_norms_and_no_norm_stay_as_they_are() -> None:
    layer_norm = torch.nn.LayerNorm(8)
    assert native_norm(layer_norm) is layer_norm
    assert native_norm(None) is None


@pytest.mark.subprocess
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler for CPU kernels")
def test_a_compiled_graph_keeps_the_eager_bits() -> None:
    """A residual add and the norm after it, as a compiled decode layer runs them: the
    module's eager bits at every row count, where inductor's own fused norm need not give
    them."""
    gen = torch.Generator().manual_seed(3)
    norm = _norm(False, 576, 1e-5, torch.float32, gen)
    wrapped = native_norm(norm)

    def step(h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return wrapped(h + r) * 2.0

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    for rows in (1, 2, 5, 8):
        h = torch.randn(rows, 576, generator=gen) * 3
        r = torch.randn(rows, 576, generator=gen)
        with torch.inference_mode():
            want = norm(h + r) * 2.0
            assert torch.equal(compiled(h, r), want), rows
