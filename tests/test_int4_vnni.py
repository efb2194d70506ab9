"""The AVX512-VNNI int4 kernel (`models/int4_vnni.py`): what it computes against a float64
model of its arithmetic over generated shapes, rows and scales; where it runs (bf16 passes
of the int4 layers below their dense rows, never float32 or a compiled graph); and the
conditions that keep it off (the CPU, torch's capability, the environment, the probe).

The kernel's own tests skip, saying why, on a CPU without AVX-512 VNNI; on one with it
they must run (`test_a_cpu_with_the_flags_runs_it`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernel_probe import TINY

from aici_cli.models import int4_vnni, kernel_probe
from aici_cli.models.kernel_run import FAULT_ENV
from aici_cli.models.quantize import Int4Linear, quantize_int4, tiled_copy

WHY_NOT = int4_vnni.unusable()
needs_kernel = pytest.mark.skipif(WHY_NOT is not None, reason=f"no VNNI kernel: {WHY_NOT}")


def _matrix(n: int, k: int, seed: int, symmetric: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    d = torch.rand(n, k // 32, generator=g) * 0.1
    m = -8 * d if symmetric else torch.randn(n, k // 32, generator=g) * 0.1
    return codes, d, m


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(tiles=st.integers(1, 6), groups=st.integers(1, 8), rows=st.integers(1, 11),
       symmetric=st.booleans(), seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1, 50]),
       zero_group=st.booleans())
def test_it_computes_its_model_of_q4_times_q8_for_any_shape_and_rows(
        tiles: int, groups: int, rows: int, symmetric: bool, seed: int, scale: float,
        zero_group: bool) -> None:
    n, k = 16 * tiles, 32 * groups
    codes, d, m = _matrix(n, k, seed, symmetric)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)) * scale
    if zero_group:
        x[:, :32] = 0  # a group of zeros: its scale is 0, its codes 0
    tiled = int4_vnni.tile(codes, d, m)
    assert tiled is not None and (tiled.m is None) == symmetric
    y = tiled.matmul(x).double()
    ref = int4_vnni.reference(x, codes, d, m)
    assert y.shape == (rows, n)
    # float32 accumulation of exact integer group sums: a few float32 roundings per term
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-30


@needs_kernel
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_bf16_rows_give_the_float32_result_rounded_once(rows: int, seed: int) -> None:
    codes, d, m = _matrix(48, 96, seed, symmetric=False)
    tiled = int4_vnni.tile(codes, d, m)
    assert tiled is not None
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)).bfloat16()
    assert torch.equal(tiled.matmul(x), tiled.matmul(x.float()).bfloat16())


def test_shapes_that_do_not_tile_are_left_to_the_int4_kernel() -> None:
    codes, d, m = _matrix(24, 64, 0, symmetric=True)
    assert int4_vnni.tile(codes, d, m) is None  # 24 rows: not whole tiles of 16
    assert int4_vnni.tile(codes[:16], d[:16], m[:16]) is not None


@needs_kernel
def test_a_layer_runs_it_for_bf16_rows_below_its_dense_rows_only() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 128) / 128 ** 0.5
    codes, d, m = quantize_int4(w)
    plain = Int4Linear(codes, d, m, None, torch.bfloat16)
    layer = Int4Linear(codes, d, m, None, torch.bfloat16)
    layer.tiled = tiled_copy(layer, d, m)
    assert layer.tiled is not None
    x = torch.randn(3, 128)
    expected = int4_vnni.reference(x.bfloat16().float(), codes, d, m)
    y = layer(x.bfloat16())
    assert torch.equal(y, layer.tiled.matmul(x.bfloat16()))
    assert (y.double() - expected).abs().max() <= 1e-2 * expected.abs().max()
    assert not torch.equal(y, plain(x.bfloat16()))  # another kernel's rounding
    # float32 rows keep the int4 kernel's outputs, exactly
    f32 = Int4Linear(codes, d, m, None, torch.float32)
    f32.tiled = tiled_copy(f32, d, m)
    assert torch.equal(f32(x), Int4Linear(codes, d, m, None, torch.float32)(x))
    # rows from the dense copy's threshold on run dense
    layer.dense, layer.dense_rows = torch.zeros(64, 128, dtype=torch.bfloat16), 16
    assert layer(torch.randn(16, 128).bfloat16()).abs().max() == 0
    assert layer(torch.randn(15, 128).bfloat16()).abs().max() > 0


def test_a_cpu_with_the_flags_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has every flag and torch runs at AVX512 the kernel must be usable:
    its tests above cannot all skip on such a machine."""
    flags = int4_vnni._cpu_flags()
    capable = all(f in flags for f in int4_vnni.NEEDS) \
        and torch.backends.cpu.get_cpu_capability() == "AVX512"
    if not capable:
        assert int4_vnni.unusable() is not None
        return
    assert int4_vnni.unusable() is None
    monkeypatch.setenv(int4_vnni.ENV, "torch")
    assert int4_vnni.unusable() == f"{int4_vnni.ENV}=torch"


@needs_kernel
def test_the_probe_passes_it_and_a_faulty_kernel_keeps_the_int4_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    """The probe's child builds the layers on the kernel (`kernel_run`, mode int4-vnni);
    a crash there leaves a model's layers on the int4 kernel, loudly nowhere but fast."""
    monkeypatch.setenv(kernel_probe.ENV, "on")
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    mode = kernel_probe.current_mode("cpu", "bfloat16", int4_vnni.PROBE_QUANTIZE)
    found = kernel_probe.run_probe(mode, TINY)
    assert found.ok, found.reason
    assert found.max_error is not None and found.max_error < 0.03
    cpu = torch.device("cpu")
    assert int4_vnni.wanted(tiny_model_dir, torch.bfloat16, cpu)
    assert not int4_vnni.wanted(tiny_model_dir, torch.float32, cpu)
    monkeypatch.setenv(FAULT_ENV, f"segv:{int4_vnni.PROBE_QUANTIZE}")
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "other-cache"))
    assert not int4_vnni.wanted(tiny_model_dir, torch.bfloat16, cpu)


@needs_kernel
@settings(max_examples=15, deadline=None)
@given(tiles=st.lists(st.integers(1, 4), min_size=1, max_size=3), rows=st.integers(1, 6),
       symmetric=st.booleans(), seed=st.integers(0, 2**16))
def test_stacked_matrices_give_their_parts_outputs_over_the_same_storage(
        tiles: list[int], rows: int, symmetric: bool, seed: int) -> None:
    parts = [int4_vnni.tile(*_matrix(16 * t, 64, seed + i, symmetric))
             for i, t in enumerate(tiles)]
    assert all(p is not None for p in parts)
    whole = int4_vnni.stack([p for p in parts if p is not None])
    assert whole is not None
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    assert torch.equal(whole.matmul(x), torch.cat([p.matmul(x) for p in parts if p], -1))
    start = 0
    for p in parts:
        assert p is not None
        view = int4_vnni.rows_of(whole, start, p.n)
        assert view.codes.data_ptr() >= whole.codes.data_ptr()  # a view, not a copy
        assert torch.equal(view.matmul(x), p.matmul(x))
        start += p.n
