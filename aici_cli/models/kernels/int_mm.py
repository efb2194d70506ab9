"""Quantised layers' passes of few rows on the project's own int kernels: group-32 int4
and per-channel int8 weights times activations quantised to int8 per group of 32, as
llama.cpp's Q4/Q8 x Q8_0 dot products, as PyTorch operators (`torch.ops.aici.int4_vnni_mm`,
`int8_vnni_mm`; "vnni" names the weights' layout: four bytes of a row a 32-bit lane, 16
rows a tile, which every variant reads).

PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) widens every weight to float
before multiplying, so it is bound by that work, not by reading the weights (23 GB/s on a
5632 x 2048 layer in the cache of the 2-core AMX Xeon, 12.3 GB/s from memory), and with
float32 activations it is a scalar loop (23.9 ms for that layer at AVX2). These multiply
the codes as bytes and apply the scales once per group: 0.14 ms (AVX-512 VNNI) and
0.20 ms (AVX2) for that layer, so a 1B model's step is bound by memory.

One variant per instruction set (`Variant`: `X86_VARIANTS`, `ARM_VARIANTS`), the best this
CPU and torch's capability allow (`variant`; `cpu_features` applies a forced lower ISA),
each built from native/ (the torch-free core: every variant's outputs are the generic
reference's bit for bit) with `int_mm.cpp` (the operators) into
`$AICI_BATCH_CACHE/kernels/` at first use (~6 s, once per machine, variant, source and
torch version), and judged by the kernel probe (mode `vnni`, at the run's dtype: its
layers at the model's shapes in a child process) before a run uses it. Elsewhere, or with
`AICI_BATCH_VNNI=off`, PyTorch's int4 and int8 kernels.

Being operators, they run in eager passes, in `torch.compile` graphs and in the compiled
step's AOTInductor packages alike (the package calls them through the dispatcher), with
the layouts as the layers' buffers.

What it changes: the activations are rounded to 8 bits per group of 32 (x = xd x8, xd =
amax / 127) before the product, as llama.cpp does: a layer's outputs are ~5e-3 off float32
over the same weights (of their largest). bf16 and float32 runs alike take them
(`--quantize auto` quantises a float32 CPU run where they run); `--quantize none` is the
exact path, and `--deterministic` runs are unquantised.

Cost: a second copy of the quantised matrices in this layout (int4: 4.5 bits a weight,
5 where the layer has zeros; int8: a byte), made from the kept codes on the first load and
kept (`quant/vnni_layouts.py`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from aici_cli.core.cache_paths import cache_dir
from aici_cli.models.kernels import native_build, probe
from aici_cli.models.kernels.cpu_features import cpu_features
from aici_cli.models.kernels.rows_attention import ATTENTION_FLAGS

SOURCE = Path(__file__).with_suffix(".cpp")
NATIVE = Path(__file__).parent / "native"  # the torch-free core, a file per instruction set
ENV = "AICI_BATCH_VNNI"  # "off": never these kernels
TILE, GROUP = 16, 32
PROBE_QUANTIZE = "vnni"  # the kernel probe's mode for them (checks/probe_child.py)
LAYOUT = "1"  # of the kept layouts (cache/packed_layers.py): bump when tile_int4/tile_int8 change


@dataclass(frozen=True)
class Tiled4:
    """An [n, k] int4 matrix in the kernel's layout: `codes` [n/16 * k/32 * 256] uint8,
    `d` and `m` [n/16, k/32, 16] float16 (`m` empty: symmetric, m = -8 d)."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    n: int
    k: int


def tile_int4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Tiled4 | None:
    """[n, k] codes in 0..15 and their [n, k/32] scales d and zeros m (weight = q d + m)
    in the kernel's layout; None where n is not a multiple of 16 or k of 32."""
    n, k = codes.shape
    if n % TILE or k % GROUP or n == 0:
        return None
    g = k // GROUP
    # [tile, row, group, sub-block j, half, i]: code k = 32 g + 8 j + 4 half + i
    c = codes.to(torch.uint8).reshape(n // TILE, TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    packed = (c[..., 0] | (c[..., 1] << 4)).contiguous().reshape(-1)

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float16).reshape(n // TILE, TILE, g).permute(0, 2, 1).contiguous()

    symmetric = bool(torch.equal(m.float(), -8 * d.float()))
    empty = torch.empty(0, dtype=torch.float16)
    return Tiled4(packed, per_tile(d), empty if symmetric else per_tile(m), n, k)


def tile_int8(codes: torch.Tensor) -> torch.Tensor | None:
    """[n, k] int8 codes in the kernel's layout, each as the unsigned byte c + 128:
    [n/16 * k/32 * 512] uint8; None where n is not a multiple of 16 or k of 32."""
    n, k = codes.shape
    if n % TILE or k % GROUP or n == 0:
        return None
    # [tile, row, group, sub-block j, i]: k = 32 g + 4 j + i
    biased = (codes.to(torch.int16) + 128).to(torch.uint8)
    return biased.reshape(n // TILE, TILE, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4) \
        .contiguous().reshape(-1)


def untile_int4(t: Tiled4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tile_int4` undone: [n, k] uint8 codes and their [n, k/32] float16 d and m (m = -8 d
    where the tiles hold none). ~10 ms for a 1536 x 576 matrix: for dense copies."""
    n, k = t.n, t.k
    nt, g = n // TILE, k // GROUP
    tiles = t.codes.reshape(nt, g, 4, TILE, 4)  # [tile, group, j, row, i]: two codes a byte
    c = torch.stack([tiles & 15, tiles >> 4], dim=-1)  # [..., i, half]
    codes = c.permute(0, 3, 1, 2, 5, 4).reshape(n, k)

    def per_row(x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 1).reshape(n, g)

    d = per_row(t.d)
    return codes, d, (-8 * d if t.m.numel() == 0 else per_row(t.m))


def untile_int8(tiled: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`tile_int8` undone: [n, k] int8 codes (~30 ms for the default model's 49,152 x 576
    output projection)."""
    rows = tiled.reshape(n // TILE, k // GROUP, 8, TILE, 4).permute(0, 3, 1, 2, 4)
    return (rows.reshape(n, k).to(torch.int16) - 128).to(torch.int8)


def tiled_int8_rows(tiled: torch.Tensor, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the [n, k] int8 matrix whose layout `tiled` is, as codes [len(ids), k]
    (reads only those rows' bytes: a layer kept tiled alone serves the masked
    projection's gathers)."""
    tiles = tiled.reshape(n // TILE, k // GROUP, 8, TILE, 4)
    rows = tiles[ids // TILE, :, :, ids % TILE]  # [len, k/32, 8, 4]
    return (rows.reshape(-1, k).to(torch.int16) - 128).to(torch.int8)


def int8_rows_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, k] times some rows of an int8 matrix (`codes` [n, k], `scale` [n] float32)
    on the kernel, tiled here (padded to whole tiles): each output equals the whole
    matrix's on the kernel bit for bit (a row's sum is its own lane's, in group order)."""
    n = codes.shape[0]
    pad = -n % TILE
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, codes.shape[1])])
        scale = torch.cat([scale, scale.new_zeros(pad)])
    tiled = tile_int8(codes)
    assert tiled is not None, "int8_rows_mm: k must be a multiple of 32"
    return torch.ops.aici.int8_vnni_mm(x.contiguous(), tiled, scale, n + pad)[:, :n]


def int4_mm(x: torch.Tensor, t: Tiled4) -> torch.Tensor:
    """x [rows, k] (bfloat16 or float32) times the matrix: [rows, n] in x's dtype."""
    return torch.ops.aici.int4_vnni_mm(x.contiguous(), t.codes, t.d, t.m, t.n)


def stack_int4(parts: list[Tiled4]) -> Tiled4 | None:
    """The matrices of `parts` (one input width) stacked by rows: tiles are independent,
    so its outputs are the parts' side by side, bit for bit. Over their own storage where
    they lie back to back in one (`group_int4` left them so), else a copy. None where they
    do not all have zeros or all lack them."""
    if len({p.k for p in parts}) != 1 or len({p.m.numel() == 0 for p in parts}) != 1:
        return None
    def one(tensors: list[torch.Tensor]) -> torch.Tensor:
        joined = _joined(tensors)
        return joined if joined is not None else torch.cat(tensors)

    m = torch.empty(0, dtype=torch.float16) if parts[0].m.numel() == 0 \
        else one([p.m for p in parts])
    return Tiled4(one([p.codes for p in parts]), one([p.d for p in parts]), m,
                  sum(p.n for p in parts), parts[0].k)


def group_int4(parts: list[Tiled4]) -> list[Tiled4] | None:
    """`parts` copied once into one storage, back to back, each a view of its rows: a
    later `stack_int4` of them (the compiled step's q/k/v and gate/up) copies nothing.
    None where they do not stack."""
    whole = stack_int4(parts)
    if whole is None:
        return None
    views, start = [], 0
    for p in parts:
        views.append(int4_rows(whole, start, p.n))
        start += p.n
    return views


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Contiguous tensors that lie back to back in one storage, as one tensor over it
    (rows of the first's trailing shape), or None."""
    first = tensors[0]
    end = first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != end \
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def int4_rows(stacked: Tiled4, start: int, n: int) -> Tiled4:
    """Rows start..start+n of `stacked` (multiples of 16) over its storage."""
    t0, t1 = start // TILE, (start + n) // TILE
    per_tile = stacked.codes.numel() // (stacked.n // TILE)
    # An empty m of its own: a tensor shared by two layers is one buffer to
    # `named_buffers`, which would change the packaged step's key (packaged_step).
    m = torch.empty(0, dtype=torch.float16) if stacked.m.numel() == 0 else stacked.m[t0:t1]
    return Tiled4(stacked.codes[t0 * per_tile:t1 * per_tile], stacked.d[t0:t1], m, n,
                  stacked.k)


def quantised_activations(x: torch.Tensor) -> torch.Tensor:
    """x [rows, k] as the kernels round it: per group of 32, x8 = round(x / xd) (nearest,
    ties away from zero) in -127..127 with xd = amax / 127, returned as x8 xd in float64."""
    rows, k = x.shape
    xg = x.float().reshape(rows, k // GROUP, GROUP)
    xd = xg.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(xd != 0, 1 / xd, torch.zeros_like(xd))
    r = xg * inv
    x8 = torch.where(r < 0, r - 0.5, r + 0.5).trunc().clamp(-127, 127)
    return (x8.double() * xd.double()).reshape(rows, k)


def reference_int4(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor,
                   m: torch.Tensor) -> torch.Tensor:
    """What `int4_mm` computes, in float64: the quantised activations times q d + m with
    d and m rounded to float16."""
    k = x.shape[1]
    w = (codes.double().reshape(-1, k // GROUP, GROUP) * d.half().double()[..., None]
         + m.half().double()[..., None]).reshape(-1, k)
    return quantised_activations(x) @ w.t()


def reference_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What `int8_vnni_mm` computes, in float64: the quantised activations times c scale."""
    return quantised_activations(x) @ (codes.double() * scale.double()[:, None]).t()


def wanted(path: Path, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model's quantised layers at `path` run these kernels here: bf16 or
    float32 passes on a CPU that runs a variant and whose probe passed it at the model's
    shapes."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32) \
            or unusable() is not None:
        return False
    if not probe.enabled():
        return True
    return probed(probe.Shapes.of(path), str(dtype).removeprefix("torch.")).ok


def probed(shapes: probe.Shapes, dtype: str) -> probe.Verdict:
    """The kernel probe's verdict on the kernels (mode `vnni`) at `shapes` with `dtype`
    activations (the run's: the rest of the probe's layers run in it), per build of their
    sources (the variant's among them)."""
    mode = probe.current_mode("cpu", dtype, PROBE_QUANTIZE)
    return probe.verdict(mode, shapes, code=_source_digest())


@dataclass(frozen=True)
class Variant:
    """One instruction set's build of the kernels: the CPU flags it needs, the compiler
    flags of its file in native/, and the ATen capability torch's own kernels must run at
    for it (so `ATEN_CPU_CAPABILITY=avx2` takes the AVX-512 variant away too)."""

    name: str
    needs: tuple[str, ...]
    cflags: tuple[str, ...]
    source: str
    capability: str | None  # None: any (ARM)
    # The activation quantiser's own file and flags (x86: AVX2's, which every x86
    # variant's CPU has), or None: the generic one in generic.c.
    quantiser: tuple[str, tuple[str, ...]] | None = None


# The AVX2 quantiser (native/x86_quantise.c), the same bytes as the generic one, ~3x faster.
X86_QUANTISER = ("x86_quantise.c", ("-mavx2", "-mfma", "-mf16c"))


# Best first, per architecture (cpu_features.CpuFeatures.x86 / .arm).
X86_VARIANTS = (
    Variant("avx512_vnni",
            ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"),
            "x86_avx512_vnni.c", "AVX512", X86_QUANTISER),
    Variant("avx_vnni", ("avx2", "avx_vnni", "f16c", "fma"),
            ("-mavx2", "-mavxvnni", "-mf16c", "-mfma"), "x86_avx_vnni.c", "AVX2", X86_QUANTISER),
    Variant("avx2", ("avx2", "f16c", "fma"), ("-mavx2", "-mf16c", "-mfma"), "x86_avx2.c",
            "AVX2", X86_QUANTISER),
)
ARM_VARIANTS = (
    Variant("neon_dot", ("asimd", "asimddp"), ("-march=armv8.2-a+dotprod",), "arm_neon.c",
            None),
    Variant("neon", ("asimd",), ("-march=armv8-a",), "arm_neon.c", None),
)
CAPABILITY_RANK = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}


def variant() -> Variant | str:
    """The variant this process runs (the best this CPU and torch's capability allow; a
    forced lower ISA, `AICI_BATCH_ISA`, is already in the CPU's flags), or why none."""
    cpu = cpu_features()
    if cpu.system != "Linux" or not (cpu.x86 or cpu.arm):
        return "not an x86-64 or ARM64 Linux machine"
    why = ""
    for v in X86_VARIANTS if cpu.x86 else ARM_VARIANTS:
        missing = cpu.missing(v.needs)
        if missing:
            why = why or f"the CPU lacks {', '.join(missing)}"
        elif v.capability is not None and \
                CAPABILITY_RANK.get(cpu.capability, 0) < CAPABILITY_RANK[v.capability]:
            why = why or f"torch runs its kernels at {cpu.capability}"
        else:
            return v
    return why


def unusable() -> str | None:
    """Why this machine or process cannot run the kernels, or None (builds the library
    the first time)."""
    if _turned_off():
        return f"{ENV}=off"
    chosen = variant()
    if isinstance(chosen, str):
        return chosen
    return _load(chosen)


def start_build() -> None:
    """This CPU's variant's library found or built on a thread of its own, where this
    process has not yet and the kernels are on: its compilers run while the caller works
    on (a load converts its GGUF file meanwhile), and `unusable` waits for what is left."""
    chosen = None if _turned_off() else variant()
    if isinstance(chosen, Variant):
        native_build.in_background(chosen, functools.partial(_find_or_build, chosen))


def _turned_off() -> bool:
    return os.environ.get(ENV, "").lower() in ("off", "0", "false", "no")


def _objects(v: Variant) -> list[tuple[Path, list[str]]]:
    """The C files of variant `v`'s library, each with its own instruction-set flags."""
    files = [(NATIVE / "generic.c", []), (NATIVE / v.source, list(v.cflags)),
             (NATIVE / "rows_attention.c", [*v.cflags, *ATTENTION_FLAGS])]
    if v.quantiser is not None:
        files.append((NATIVE / v.quantiser[0], list(v.quantiser[1])))
    return files


def _sources(v: Variant) -> list[Path]:
    return [NATIVE / "int_dot.h", NATIVE / "tiles.h", NATIVE / "rows_attention.h",
            NATIVE / "rows_attention_body.h",
            *(path for path, _ in _objects(v))]


@functools.cache
def _source_digest() -> str:
    chosen = variant()
    files = [SOURCE, *(_sources(chosen) if isinstance(chosen, Variant) else [])]
    name = chosen.name if isinstance(chosen, Variant) else ""
    return hashlib.sha256(b"".join(f.read_bytes() for f in files) + name.encode()) \
        .hexdigest()[:16]


@functools.cache
def _load(v: Variant) -> str | None:
    """Loads the operators' library for variant `v` (built where the cache lacks it, or
    waited for where `start_build` builds it), once a process: None, or why not."""
    built = _library(v)
    if isinstance(built, str):
        return built
    try:
        torch.ops.load_library(str(built))
    except (OSError, RuntimeError) as e:
        built.unlink(missing_ok=True)  # built again by the next process
        return f"its library did not load ({type(e).__name__}: {str(e)[:200]})"
    _register_fakes()
    return None


def _library(v: Variant) -> Path | str:
    """Variant `v`'s library, its path or why there is none: found once a process (by
    `start_build`'s thread or `_load`, the other waiting for it)."""
    return native_build.once(v, functools.partial(_find_or_build, v))


def _find_or_build(v: Variant) -> Path | str:
    """Variant `v`'s library in the cache, built where it is missing: its path, or why
    not."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cc is None or cxx is None:
        return "no C and C++ compiler (cc and c++, or $CC and $CXX)"
    root = Path(torch.__file__).parent
    # The core as C11 (no contraction of a * b + c beyond the core's own fmaf: every
    # variant's floats are the generic one's, bit for bit), each file with its own flags.
    c_flags = ["-O3", "-fPIC", "-std=c11", "-ffp-contract=off", f"-I{NATIVE}"]
    # -fopenmp: at::parallel_for is inlined from the headers as OpenMP (torch's build), and
    # libgomp.so.1 resolves to the one torch loaded (one pool).
    cxx_flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c++17",
                 f"-DAICI_VARIANT={v.name}", f"-I{SOURCE.parent}",
                 *(["-DAICI_QUANTISE_AVX2"] if v.quantiser == X86_QUANTISER else []),
                 f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                 "-isystem", str(root / "include"),
                 "-isystem", str(root / "include" / "torch" / "csrc" / "api" / "include")]
    # After the sources: a linker that drops libraries no earlier input needs (--as-needed)
    # would drop them before them.
    libraries = [f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-lc10", "-ltorch_cpu"]
    try:
        versions = "".join(subprocess.run([c, "--version"], capture_output=True, text=True,
                                          timeout=30).stdout for c in (cc, cxx))
        digest = hashlib.sha256(
            _source_digest().encode() + " ".join(c_flags + list(v.cflags) + cxx_flags
                                                 + libraries).encode()
            + versions.encode() + torch.__version__.encode()).hexdigest()
        built = cache_dir() / "kernels" / f"int-{v.name}-{digest[:16]}.so"
        if not built.is_file():  # ~10-13 s of compilers on a loaded 2-core machine
            problem = native_build.compile_library(built, cc, _objects(v), c_flags, cxx,
                                                   SOURCE, cxx_flags, libraries)
            if problem is not None:
                return problem
    except (OSError, subprocess.SubprocessError) as e:
        return f"building its library failed ({type(e).__name__}: {str(e)[:200]})"
    return built


def _register_fakes() -> None:
    """Shapes for tracing (torch.compile, torch.export): [rows, n] in x's dtype."""
    @torch.library.register_fake("aici::int4_vnni_mm")
    def _int4(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
              n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("aici::int8_vnni_mm")
    def _int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("aici::rows_attention")
    def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                   scale: float) -> torch.Tensor:
        return q.new_empty(q.shape)
