"""The project's int kernels as PyTorch operators (`models/kernels/int_mm.py`): what they
compute against a float64 model of their arithmetic over generated shapes, rows and
scales; that every instruction-set variant the host runs gives the same bits; where they
run (bf16 and float32 passes of the int4 layers below their dense rows and of the int8
ones, in eager passes and in compiled graphs); and the conditions that keep them off (the
CPU, torch's capability, the environment, the probe).

The kernels' own tests skip, saying why, on a CPU that runs no variant; on one that runs
one they must run (`test_a_cpu_with_the_flags_runs_them`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_shapes import TINY

from aici_cli.models.checks.probe_child import FAULT_ENV
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels import probe as kernel_probe
from aici_cli.models.kernels.cpu_features import cpu_features
from aici_cli.models.quant import prompt_tokens, vnni_layouts
from aici_cli.models.quant.quantize import (
    Int4Linear,
    Int8Linear,
    quantize_int4,
    quantize_int8,
)

WHY_NOT = int_mm.unusable()
needs_kernel = pytest.mark.skipif(WHY_NOT is not None, reason=f"no int kernel: {WHY_NOT}")


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
    tiled = int_mm.tile_int4(codes, d, m)
    assert tiled is not None and (tiled.m.numel() == 0) == symmetric
    y = int_mm.int4_mm(x, tiled).double()
    ref = int_mm.reference_int4(x, codes, d, m)
    assert y.shape == (rows, n)
    # float32 accumulation of exact integer group sums: a few float32 roundings per term
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-30


@needs_kernel
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_bf16_rows_give_the_float32_result_rounded_once(rows: int, seed: int) -> None:
    codes, d, m = _matrix(48, 96, seed, symmetric=False)
    tiled = int_mm.tile_int4(codes, d, m)
    assert tiled is not None
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)).bfloat16()
    assert torch.equal(int_mm.int4_mm(x, tiled),
                       int_mm.int4_mm(x.float(), tiled).bfloat16())


@needs_kernel
@settings(max_examples=6, deadline=None)
@given(rows=st.integers(129, 300), threads=st.sampled_from([1, 2, 3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_a_pass_of_many_rows_gives_each_row_its_own_result(
        rows: int, threads: int, dtype: torch.dtype, seed: int) -> None:
    """Many rows (a prompt's pass) are quantised on several threads, a slice each: every
    row's outputs are the bits it gets alone, whatever the split."""
    codes, d, m = _matrix(32, 256, seed, symmetric=seed % 2 == 0)
    tiled = int_mm.tile_int4(codes, d, m)
    assert tiled is not None
    x = (torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = int_mm.int4_mm(x, tiled)
    finally:
        torch.set_num_threads(before)
    alone = torch.cat([int_mm.int4_mm(x[i:i + 1], tiled) for i in range(rows)])
    assert torch.equal(whole, alone)


def test_shapes_that_do_not_tile_are_left_to_the_int4_kernel() -> None:
    codes, d, m = _matrix(24, 64, 0, symmetric=True)
    assert int_mm.tile_int4(codes, d, m) is None  # 24 rows: not whole tiles of 16
    assert int_mm.tile_int4(codes[:16], d[:16], m[:16]) is not None
    assert int_mm.tile_int8(codes.to(torch.int8)) is None
    assert int_mm.tile_int8(codes[:16, :48].to(torch.int8)) is None  # 48 inputs


@needs_kernel
def test_a_layer_runs_it_for_bf16_and_float32_rows_off_its_dense_copy() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 128) / 128 ** 0.5
    codes, d, m = quantize_int4(w)
    plain = Int4Linear(codes, d, m, None, torch.bfloat16)
    layer = Int4Linear(codes, d, m, None, torch.bfloat16)
    assert vnni_layouts.int4_layer(layer, d, m)
    tiled = layer.tiled()
    assert tiled is not None
    x = torch.randn(3, 128)
    expected = int_mm.reference_int4(x.bfloat16().float(), codes, d, m)
    y = layer(x.bfloat16())
    assert torch.equal(y, int_mm.int4_mm(x.bfloat16(), tiled))
    assert (y.double() - expected).abs().max() <= 1e-2 * expected.abs().max()
    assert not torch.equal(y, plain(x.bfloat16()))  # another kernel's rounding
    # float32 rows too: the same kernel, its float32 result unrounded
    f32 = Int4Linear(codes, d, m, None, torch.float32)
    assert vnni_layouts.int4_layer(f32, d, m)
    assert torch.equal(f32(x), int_mm.int4_mm(x, tiled))
    assert (f32(x).double() - int_mm.reference_int4(x, codes, d, m)).abs().max() \
        <= 1e-5 * expected.abs().max()
    assert not torch.equal(f32(x), Int4Linear(codes, d, m, None, torch.float32)(x))
    # with a dense copy, a pass's prompt tokens run on it, the other tokens the kernel
    layer.dense = torch.zeros(64, 128, dtype=torch.bfloat16)
    many = torch.randn(40, 128).bfloat16()
    assert torch.equal(layer(many), int_mm.int4_mm(many, tiled))  # no prompt token
    with prompt_tokens.feeding([(0, 40)], 40, many.device):
        assert layer(many).abs().max() == 0
    with prompt_tokens.feeding([(5, 10)], 40, many.device):
        y = layer(many)
    assert y[5:15].abs().max() == 0
    assert torch.equal(y[:5], int_mm.int4_mm(many[:5], tiled))
    assert torch.equal(y[15:], int_mm.int4_mm(many[15:], tiled))


def test_a_cpu_with_the_flags_runs_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has a variant's flags (AVX2, FMA and F16C are enough on x86; NEON on
    ARM), torch's capability allows it and compilers exist, the kernels must be usable:
    their tests cannot all skip on such a machine. The best variant is taken."""
    cpu = cpu_features()
    variants = int_mm.X86_VARIANTS if cpu.x86 else int_mm.ARM_VARIANTS
    runs = [v for v in variants if not cpu.missing(v.needs) and (
        v.capability is None or int_mm.CAPABILITY_RANK.get(cpu.capability, 0)
        >= int_mm.CAPABILITY_RANK[v.capability])]
    capable = cpu.system == "Linux" and runs and shutil.which("c++") and shutil.which("cc")
    if not capable:
        assert int_mm.unusable() is not None
        return
    assert int_mm.variant() == runs[0]
    assert int_mm.unusable() is None
    monkeypatch.setenv(int_mm.ENV, "off")
    assert int_mm.unusable() == f"{int_mm.ENV}=off"


@pytest.mark.subprocess
@needs_kernel
def test_the_probe_passes_them_and_a_faulty_kernel_keeps_the_int4_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    """The probe's child builds the layers on the kernels (`checks/probe_child.py`, mode vnni); a
    crash there leaves a model's layers on the int4 and int8 kernels."""
    monkeypatch.setenv(kernel_probe.ENV, "on")
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    mode = kernel_probe.current_mode("cpu", "bfloat16", int_mm.PROBE_QUANTIZE)
    found = kernel_probe.run_probe(mode, TINY)
    assert found.ok, found.reason
    assert found.max_error is not None and found.max_error < 0.03
    cpu = torch.device("cpu")
    assert int_mm.wanted(tiny_model_dir, torch.bfloat16, cpu)
    assert int_mm.wanted(tiny_model_dir, torch.float32, cpu)
    assert not int_mm.wanted(tiny_model_dir, torch.float16, cpu)
    monkeypatch.setenv(FAULT_ENV, f"segv:{int_mm.PROBE_QUANTIZE}")
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "other-cache"))
    assert not int_mm.wanted(tiny_model_dir, torch.bfloat16, cpu)


@needs_kernel
@settings(max_examples=15, deadline=None)
@given(tiles=st.lists(st.integers(1, 4), min_size=1, max_size=3), rows=st.integers(1, 6),
       symmetric=st.booleans(), seed=st.integers(0, 2**16))
def test_stacked_matrices_give_their_parts_outputs_over_the_same_storage(
        tiles: list[int], rows: int, symmetric: bool, seed: int) -> None:
    parts = [int_mm.tile_int4(*_matrix(16 * t, 64, seed + i, symmetric))
             for i, t in enumerate(tiles)]
    found = [p for p in parts if p is not None]
    assert len(found) == len(parts)
    whole = int_mm.stack_int4(found)
    assert whole is not None
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    assert torch.equal(int_mm.int4_mm(x, whole),
                       torch.cat([int_mm.int4_mm(x, p) for p in found], -1))
    start = 0
    for p in found:
        view = int_mm.int4_rows(whole, start, p.n)
        assert view.codes.data_ptr() >= whole.codes.data_ptr()  # a view, not a copy
        assert torch.equal(int_mm.int4_mm(x, view), int_mm.int4_mm(x, p))
        start += p.n


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(tiles=st.integers(1, 6), groups=st.integers(1, 8), rows=st.integers(1, 11),
       seed=st.integers(0, 2**16), extremes=st.booleans())
def test_int8_computes_its_model_of_q8_times_q8_for_any_shape_and_rows(
        tiles: int, groups: int, rows: int, seed: int, extremes: bool) -> None:
    n, k = 16 * tiles, 32 * groups
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    if extremes:
        codes[0] = -128  # the byte's whole range, c + 128 = 0
        codes[-1] = 127
    scale = torch.rand(n, generator=g) * 0.01
    x = torch.randn(rows, k, generator=g)
    tiled = int_mm.tile_int8(codes)
    assert tiled is not None
    y = torch.ops.aici.int8_vnni_mm(x, tiled, scale, n).double()
    ref = int_mm.reference_int8(x, codes, scale)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-30


@needs_kernel
def test_an_int8_layer_runs_it_for_bf16_and_float32_rows() -> None:
    torch.manual_seed(0)
    codes, scale = quantize_int8(torch.randn(48, 64))
    layer = Int8Linear(codes, scale, None, torch.bfloat16)
    assert vnni_layouts.int8_layer(layer)
    x = torch.randn(2, 64).bfloat16()
    expected = int_mm.reference_int8(x.float(), codes, scale.bfloat16().float())
    y = layer(x)
    assert (y.double() - expected).abs().max() <= 1e-2 * expected.abs().max()
    assert not torch.equal(y, Int8Linear(codes, scale, None, torch.bfloat16)(x))
    f32 = Int8Linear(codes, scale, None, torch.float32)
    assert vnni_layouts.int8_layer(f32)
    expected = int_mm.reference_int8(x.float(), codes, scale)
    assert (f32(x.float()).double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(f32(x.float()), int_mm.int8_rows_mm(x.float(), codes, scale))


@needs_kernel
def test_a_compiled_graph_calls_the_kernels_with_the_eager_outputs() -> None:
    """torch.compile traces the operators (their shapes from the registered fakes) and
    calls them: the compiled layer gives the eager one's outputs bit for bit."""
    torch.manual_seed(0)
    codes, d, m = quantize_int4(torch.randn(64, 128))
    layer = Int4Linear(codes, d, m, None, torch.bfloat16)
    assert vnni_layouts.int4_layer(layer, d, m)
    x = torch.randn(1, 128).bfloat16()
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


@needs_kernel
def test_a_loaded_model_stacks_its_layers_for_the_compiled_step_without_a_copy(
        tiny_model_dir: Path) -> None:
    """The load leaves q/k/v and gate/up back to back (quantize._group_vnni): the compiled
    step's stacks are views of the parts' layouts, give their outputs bit for bit, and
    hold no int4-kernel copy; a float16 pass through such a stack is refused."""
    from aici_cli.engine.forward.decode_layer import DecodeLayer
    from aici_cli.models.load import load_model

    lm = load_model(str(tiny_model_dir), "cpu", "bfloat16", "int4")
    layer = lm.model.model.layers[0]
    attn = layer.self_attn
    assert all(p.vnni for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    x = torch.randn(2, lm.model.config.hidden_size).bfloat16()
    parts = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    q_codes = attn.q_proj.vnni_codes.data_ptr()
    fused = DecodeLayer(layer, lm.model.config)
    assert isinstance(fused.qkv, Int4Linear) and fused.qkv.vnni
    assert fused.qkv.vnni_codes.data_ptr() == q_codes  # no copy
    assert fused.qkv.packed.numel() == 0
    assert torch.equal(fused.qkv(x), parts)
    assert torch.equal(fused.qkv(x.float()), torch.cat(
        [attn.q_proj(x.float()), attn.k_proj(x.float()), attn.v_proj(x.float())], dim=-1))
    with pytest.raises(RuntimeError, match="VNNI-only"):
        fused.qkv(x.half())


@needs_kernel
def test_a_conversion_keeps_the_layouts_and_a_later_load_reads_them(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first quantised load of a conversion makes the layouts and keeps them in one
    file (`vnni_layouts`); a later load, of either activation dtype, reads them (no
    tiling), gives the same logits bit for bit and writes nothing; a load with the kernels
    off makes none."""
    from tiny_model import write_tiny_gguf

    from aici_cli.models.cache.conversions import converted_gguf
    from aici_cli.models.cache.packed_layers import vnni_file
    from aici_cli.models.load import load_model

    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "Q4_1")
    entry = converted_gguf(gguf, "tiny")
    with monkeypatch.context() as off:
        off.setenv(int_mm.ENV, "off")
        load_model(str(gguf), "cpu", "bfloat16", "int4")
    file = vnni_file(entry)
    assert file is not None and not file.exists()
    f32 = load_model(str(gguf), "cpu", "float32", "int4")
    assert file.is_file()
    file.unlink()
    first = load_model(str(gguf), "cpu", "bfloat16", "int4")
    assert file.is_file()
    written = file.stat().st_mtime_ns
    layers = [m for m in first.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert layers and all(m.vnni for m in layers if isinstance(m, Int4Linear))

    def refuse(codes: torch.Tensor, *args: object) -> None:
        # A shape that does not tile (the tiny vocabulary's output projection) is asked
        # again, and refused again, at every load.
        if codes.shape[0] % 16 == 0 and codes.shape[1] % 32 == 0:
            raise AssertionError("tiled again although the layouts were kept")

    monkeypatch.setattr(int_mm, "tile_int4", refuse)
    monkeypatch.setattr(int_mm, "tile_int8", refuse)
    second = load_model(str(gguf), "cpu", "bfloat16", "int4")
    ids = torch.tensor([first.tokenizer("the quick brown fox")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(first.model(input_ids=ids).logits, second.model(input_ids=ids).logits)
        again = load_model(str(gguf), "cpu", "float32", "int4")
        assert torch.equal(f32.model(input_ids=ids).logits, again.model(input_ids=ids).logits)
    assert file.stat().st_mtime_ns == written


VARIANT_RUN = """
import sys, torch
from aici_cli.models.kernels import int_mm
torch.manual_seed(int(sys.argv[1]))
n, k, rows = 48, 160, 7
codes = torch.randint(0, 16, (n, k)); d = torch.rand(n, k // 32) * 0.1
m = torch.randn(n, k // 32) * 0.1
c8 = torch.randint(-128, 128, (n, k)).to(torch.int8); scale = torch.rand(n)
x = torch.randn(rows, k)
assert int_mm.unusable() is None, int_mm.unusable()
out = [int_mm.int4_mm(x, int_mm.tile_int4(codes, d, m)),
       int_mm.int4_mm(x.bfloat16(), int_mm.tile_int4(codes, d, -8 * d)).float(),
       int_mm.int8_rows_mm(x, c8, scale)]
torch.save({"variant": int_mm.variant().name, "out": out}, sys.argv[2])
"""


@pytest.mark.subprocess
@needs_kernel
@pytest.mark.parametrize("seed", [0, 1])
def test_every_variant_the_host_runs_gives_the_same_bits(tmp_path: Path, seed: int) -> None:
    """Forced to each instruction set the host runs (`AICI_BATCH_ISA`), a process builds
    and loads that variant's operators, and every one gives the same outputs bit for bit
    (the core does the same float operations in the same order on every ISA)."""
    import os
    import subprocess
    import sys

    cpu = cpu_features()
    variants = int_mm.X86_VARIANTS if cpu.x86 else int_mm.ARM_VARIANTS
    runnable = [v.name for v in variants if not cpu.missing(v.needs)]
    got = {}
    for name in runnable:
        out = tmp_path / f"{name}.pt"
        env = {**os.environ, "AICI_BATCH_ISA": name}
        env.pop("ATEN_CPU_CAPABILITY", None)
        done = subprocess.run([sys.executable, "-c", VARIANT_RUN, str(seed), str(out)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        result = torch.load(out)
        assert result["variant"] == name
        got[name] = result["out"]
    first = got[runnable[0]]
    assert all(torch.equal(a, b) for outs in got.values() for a, b in zip(outs, first))
