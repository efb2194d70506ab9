"""The int4 layers' few-row passes on AVX512-VNNI: group-32 int4 weights times activations
quantised to int8 per group of 32, as llama.cpp's Q4 x Q8_0 dot products.

PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) widens every weight to float
before multiplying, so it is bound by that work, not by reading the weights: 23 GB/s on a
5632 x 2048 layer that sits in the cache of the 2-core AMX Xeon, 12.3 GB/s from memory.
`int4_vnni.c` multiplies the 4-bit codes as bytes (vpdpbusd: 64 products an
instruction, 16 output rows a register) and applies the scales once per group: 54 GB/s
on the same layer (0.134 against 0.309 ms), so a 1B model's step is bound by memory.

What it changes: the activations are rounded to 8 bits per group of 32 (x = xd x8, xd =
amax / 127) before the product, as llama.cpp does at every quantisation. Against float32
over the same weights a layer's outputs are ~5e-3 off (relative to their largest), the
int4 kernel's ~3e-3 (bf16 inputs). So it runs only where the run already rounds to bf16
(`--dtype bfloat16`, the CPU's default): float32 runs keep the int4 kernel's outputs, and
`--deterministic` runs are unquantised.

Where it runs: x86-64 CPUs with AVX-512 F/BW/VL/VNNI and F16C, where torch's own kernels
run at AVX512 (`ATEN_CPU_CAPABILITY=avx2` forces both down), a C compiler builds the
library (once per machine and source: `$AICI_BATCH_CACHE/kernels/`, ~0.4 s), and the
kernel probe passes it (mode `int4-vnni`: its layers at the model's shapes in a child
process, `kernel_probe`). Elsewhere, or with `AICI_BATCH_INT4_KERNEL=torch`, the int4
kernel. The compiled step keeps the int4 kernel (its graph cannot call this library).

Cost: a second copy of the int4 codes and scales in this layout (4.5 bits a weight; 5
where the layer has zeros), made from the kept codes as the model loads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from aici_cli.core.cache_paths import cache_dir
from aici_cli.models import kernel_probe

SOURCE = Path(__file__).with_suffix(".c")
ENV = "AICI_BATCH_INT4_KERNEL"  # "torch": never this kernel
TILE, GROUP = 16, 32
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512vnni", "-mf16c", "-mfma")
PROBE_QUANTIZE = "int4-vnni"  # the kernel probe's mode for it (kernel_run)


@dataclass(frozen=True)
class Tiled:
    """An [n, k] int4 matrix in the kernel's layout: `codes` [n/16 * k/32 * 256] uint8,
    `d` and `m` [n/16, k/32, 16] float16 (`m` None: symmetric, m = -8 d)."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    n: int
    k: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, k] (bfloat16 or float32, contiguous) times the matrix: [rows, n] in
        x's dtype."""
        kernel = library()
        assert kernel is not None, "int4_vnni.library() is None: no tiled layers exist"
        rows = x.shape[0]
        x = x.contiguous()
        y = torch.empty(rows, self.n, dtype=x.dtype)
        work = torch.empty(rows * (self.k + 8 * self.k // GROUP), dtype=torch.uint8)
        bf16 = int(x.dtype == torch.bfloat16)
        done = kernel(x.data_ptr(), bf16, rows, self.k, self.codes.data_ptr(),
                      self.d.data_ptr(), self.m.data_ptr() if self.m is not None else None,
                      self.n, y.data_ptr(), bf16, work.data_ptr(), torch.get_num_threads())
        if done != 0:
            raise ValueError(f"int4_vnni_mm refused {rows}x{self.k} by {self.n}")
        return y


def tile(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Tiled | None:
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
    return Tiled(packed, per_tile(d), None if symmetric else per_tile(m), n, k)


def stack(parts: list[Tiled]) -> Tiled | None:
    """The matrices of `parts` (one input width) stacked by rows, as one `Tiled`: tiles are
    independent, so its outputs are the parts' side by side, bit for bit. None where they
    do not all have zeros or all lack them."""
    if len({p.k for p in parts}) != 1 or len({p.m is None for p in parts}) != 1:
        return None
    m = None if parts[0].m is None else torch.cat([p.m for p in parts if p.m is not None])
    return Tiled(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]), m,
                 sum(p.n for p in parts), parts[0].k)


def rows_of(stacked: Tiled, start: int, n: int) -> Tiled:
    """Rows start..start+n of `stacked` (multiples of 16) as a `Tiled` over its storage."""
    t0, t1 = start // TILE, (start + n) // TILE
    per_tile = stacked.codes.numel() // (stacked.n // TILE)
    m = None if stacked.m is None else stacked.m[t0:t1]
    return Tiled(stacked.codes[t0 * per_tile:t1 * per_tile], stacked.d[t0:t1], m, n,
                 stacked.k)


def reference(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor,
              m: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: x quantised per group of 32 as the kernel
    does (nearest, ties away from zero), times q d + m with d and m rounded to float16."""
    rows, k = x.shape
    xg = x.float().reshape(rows, k // GROUP, GROUP)
    xd = xg.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(xd != 0, 1 / xd, torch.zeros_like(xd))
    r = xg * inv
    x8 = torch.where(r < 0, r - 0.5, r + 0.5).trunc().clamp(-127, 127)
    xq = (x8.double() * xd.double()).reshape(rows, k)
    w = (codes.double().reshape(-1, k // GROUP, GROUP) * d.half().double()[..., None]
         + m.half().double()[..., None]).reshape(-1, k)
    return xq @ w.t()


def wanted(path: Path, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model's int4 layers at `path` run their few-row passes here: bf16 on a
    CPU that runs the kernel and whose probe passed it at the model's shapes."""
    if device.type != "cpu" or dtype != torch.bfloat16 or unusable() is not None:
        return False
    if not kernel_probe.enabled():
        return True
    mode = kernel_probe.current_mode("cpu", "bfloat16", PROBE_QUANTIZE)
    return kernel_probe.verdict(mode, kernel_probe.Shapes.of(path)).ok


def eager_saving_ms(path: Path) -> float | None:
    """What the kernel saves of a one-row decode step's linear layers against the int4
    kernel, in ms at this process's threads, from the kernel probe's one-thread times of
    both modes at the model's shapes (cached per machine); None without them. The
    compiled step keeps the int4 kernel: `--compile auto` weighs this against what
    compiling saves (engine/forward/compiled.py)."""
    if not kernel_probe.enabled():
        return None
    shapes = kernel_probe.Shapes.of(path)
    times = [kernel_probe.verdict(kernel_probe.current_mode("cpu", "bfloat16", q), shapes)
             for q in ("int4", PROBE_QUANTIZE)]
    if any(t.step_ms is None or not t.ok for t in times):
        return None
    plain, vnni = (float(t.step_ms or 0) for t in times)
    return (plain - vnni) / max(1, torch.get_num_threads())


def unusable() -> str | None:
    """Why this machine or process cannot run the kernel, or None."""
    if os.environ.get(ENV, "auto").lower() == "torch":
        return f"{ENV}=torch"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return "not an x86-64 Linux machine"
    missing = [f for f in NEEDS if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return f"torch runs its kernels at {torch.backends.cpu.get_cpu_capability()}"
    if library() is None:
        return "no C compiler built its library"
    return None


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def library() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """`int4_vnni_mm` from the library built for this source (in the cache), or None
    where it cannot be built or loaded."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()
                                + version.encode()).hexdigest()[:16]
        built = cache_dir() / "kernels" / f"int4_vnni-{digest}.so"
        if not built.is_file():
            built.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".int4_vnni.", suffix=".so", dir=built.parent)
            os.close(fd)
            try:
                done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)],
                                      capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    return None
                os.replace(tmp, built)
            finally:
                Path(tmp).unlink(missing_ok=True)
        # torch loaded libgomp.so.1 already: the library's OpenMP resolves to it (one pool).
        lib = ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError):
        return None
    fn = lib.int4_vnni_mm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return fn
