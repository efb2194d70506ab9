"""The torch-free int4/int8 dot-product core (aici_cli/models/kernels/native): its test
program, built and run once per variant by build_and_test.sh (the x86 variants natively
where this CPU has their instructions, the AArch64 builds under qemu-aarch64), and a
property test of the generic variant through ctypes against a numpy model.

What the program checks (test_int_dot.c): every variant equals the generic outputs bit
for bit (they share one float32 operation order, int_dot.h), and the generic outputs equal
a float64 model to float32 rounding. Here, independently of that C code: the quantiser
equals a numpy float32 replica of it exactly, and the outputs the float64 model to
(2 G + 4) 2^-24 sum |terms| (G groups, two rounded steps a group; relative to the terms'
magnitudes, since outputs can cancel), plus a floor for subnormal steps.

An ARM build skips where aarch64-linux-gnu-gcc or qemu-aarch64 is missing
(`apt-get install crossbuild-essential-arm64 qemu-user`), and fails instead with
AICI_REQUIRE_ARM=1.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from paths import ROOT

from aici_cli.models.kernels import int_mm

NATIVE = ROOT / "aici_cli" / "models" / "kernels" / "native"
SCRIPT = NATIVE / "build_and_test.sh"
REQUIRE_ARM = "AICI_REQUIRE_ARM"
TILE, GROUP = 16, 32
# The CPU flags each x86 build needs: the ones the operators' variants declare.
CPU_NEEDS = {v.name: v.needs for v in int_mm.X86_VARIANTS}
# What each build's run prints, one line a variant tested (neon_dot links the plain build;
# each x86 build links the AVX2 quantiser every x86 operator calls, x86_quantise.c).
PRINTS = {"generic": ["generic"], "avx2": ["x86_quantise", "generic", "avx2"],
          "avx_vnni": ["x86_quantise", "generic", "avx_vnni"],
          "avx512_vnni": ["x86_quantise", "generic", "avx512_vnni"],
          "neon_dot": ["generic", "neon_dot", "neon"], "neon": ["generic", "neon"]}


def _cpu_flags() -> set[str]:
    from aici_cli.models.kernels.cpu_features import cpu_features

    return set(cpu_features().flags)


def _why_not(variant: str) -> str | None:
    """Why this machine cannot build and run `variant`'s test program, or None."""
    if variant in ("neon_dot", "neon"):
        missing = [t for t in ("aarch64-linux-gnu-gcc", "qemu-aarch64") if not shutil.which(t)]
        return f"no {' or '.join(missing)} on PATH" if missing else None
    if shutil.which("gcc") is None:
        return "no gcc on PATH"
    if variant == "generic":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return "not an x86-64 machine"
    lacking = [f for f in CPU_NEEDS[variant] if f not in _cpu_flags()]
    return f"the CPU lacks {', '.join(lacking)}" if lacking else None


@pytest.mark.subprocess
@pytest.mark.parametrize("variant", list(PRINTS))
def test_each_variant_matches_the_generic_one_and_the_generic_one_the_model(
        variant: str, tmp_path: Path) -> None:
    problem = _why_not(variant)
    if problem is not None:
        if variant.startswith("neon") and os.environ.get(REQUIRE_ARM) == "1":
            pytest.fail(f"{variant}: {problem} ({REQUIRE_ARM}=1: the ARM builds must run)")
        pytest.skip(f"{variant}: {problem}")
    done = subprocess.run(["bash", str(SCRIPT), "-o", str(tmp_path), variant],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    passed = [line.split(":")[0].split()[1] for line in done.stdout.splitlines()
              if line.startswith("int_dot ") and ": pass" in line]
    assert passed == PRINTS[variant], done.stdout
    # And the variant's build of the one-token rows' attention (rows_attention.c).
    assert f"rows_attention {variant}: pass" in done.stdout, done.stdout


# ------------------------------------------------------------------ the ctypes property


class Acts(ctypes.Structure):
    _fields_ = [("x8", ctypes.POINTER(ctypes.c_int8)), ("xd", ctypes.POINTER(ctypes.c_float)),
                ("s", ctypes.POINTER(ctypes.c_int32)), ("rows", ctypes.c_int64),
                ("k", ctypes.c_int64)]


@pytest.fixture(scope="module")
def generic(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """generic.c as a shared library (~0.2 s to build)."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc on PATH")
    lib = tmp_path_factory.mktemp("int-dot") / "libaici_int_dot_generic.so"
    subprocess.run(["gcc", "-std=c11", "-O2", "-shared", "-fPIC", "-o", str(lib),
                    str(NATIVE / "generic.c"), "-lm"], check=True, timeout=120)
    so = ctypes.CDLL(str(lib))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    so.aici_quantise_f32.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    so.aici_int4_tiles_generic.argtypes = [ptr, ptr, ptr, ctypes.POINTER(Acts), i64, i64, i64,
                                           ptr]
    so.aici_int8_tiles_generic.argtypes = [ptr, ptr, ctypes.POINTER(Acts), i64, i64, i64, ptr]
    return so


def _p(a: np.ndarray) -> int:
    """The address of `a`'s data: the caller holds `a` for as long as it is used."""
    assert a.flags.c_contiguous
    return a.ctypes.data


def quantise_model(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The quantiser in numpy float32, operation for operation (int_dot.h)."""
    rows, k = x.shape
    g = x.reshape(rows, k // GROUP, GROUP)
    d = np.abs(g).max(-1) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        t = np.where(np.isinf(inv)[..., None], g / d[..., None], g * inv[..., None])
    half = np.float32(0.5)
    x8 = np.clip(np.trunc(np.where(t < 0, t - half, t + half)), -127, 127).astype(np.int8)
    return x8.reshape(rows, k), d.astype(np.float32), x8.astype(np.int32).sum(-1)


def tile_int4(codes: np.ndarray) -> np.ndarray:
    n, k = codes.shape
    c = codes.astype(np.uint8).reshape(n // TILE, TILE, k // GROUP, 4, 2, 4) \
        .transpose(0, 2, 3, 1, 5, 4)
    return np.ascontiguousarray(c[..., 0] | (c[..., 1] << 4)).reshape(-1)


def tile_int8(codes: np.ndarray) -> np.ndarray:
    n, k = codes.shape
    biased = (codes.astype(np.int16) + 128).astype(np.uint8)
    return np.ascontiguousarray(biased.reshape(n // TILE, TILE, k // GROUP, 8, 4)
                                .transpose(0, 2, 3, 1, 4)).reshape(-1)


def per_tile(scales: np.ndarray) -> np.ndarray:
    n, groups = scales.shape
    return np.ascontiguousarray(scales.reshape(n // TILE, TILE, groups).transpose(0, 2, 1))


finite32 = st.floats(-2.0**20, 2.0**20, width=32)  # subnormals and zeros included
# float16 bits, finite: zeros, subnormals, to 65504 (float16 arrays of floats get rejected)
finite16 = st.builds(lambda sign, rest: sign << 15 | rest, st.integers(0, 1),
                     st.integers(0, 0x7bff))


@st.composite
def cases(draw: st.DrawFn) -> dict[str, np.ndarray]:
    """Activations and scales drawn element by element (zeros, subnormals, extremes), or
    activations on ties; codes from a drawn seed (random, or all at one end, or at both:
    Hypothesis' buffer would not hold [n, k] codes element by element)."""
    rows, groups, tiles = draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    n, k = tiles * TILE, groups * GROUP
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ends = draw(st.sampled_from(["random", "low", "high", "both"]))

    def pick(lo: int, hi: int) -> np.ndarray:
        if ends == "random":
            return rng.integers(lo, hi + 1, (n, k))
        if ends == "both":
            return np.where(rng.integers(0, 2, (n, k)) == 1, hi, lo)
        return np.full((n, k), lo if ends == "low" else hi)

    x = draw(hnp.arrays(np.float32, (rows, k), elements=finite32))
    if draw(st.booleans()):  # halves with amax 127: xd = 1, ties at every odd half
        x = (rng.integers(-254, 255, (rows, k)) / 2).astype(np.float32)
        x[:, ::GROUP] = 127
    return {
        "x": x,
        "q4": pick(0, 15).astype(np.uint8),
        "c8": pick(-128, 127).astype(np.int8),
        "d": draw(hnp.arrays(np.uint16, (n, groups), elements=finite16)).view(np.float16),
        "m": draw(hnp.arrays(np.uint16, (n, groups), elements=finite16)).view(np.float16),
        "scale": draw(hnp.arrays(np.float32, (n,), elements=st.floats(-2.0**66, 2.0**66,
                                                                       width=32))),
    }


def _within(got: np.ndarray, want: np.ndarray, mass: np.ndarray, steps: int,
            floor: np.ndarray | float) -> None:
    tol = steps * 2.0**-24 * mass + floor
    bad = np.argwhere(~(np.abs(got - want) <= tol))
    assert bad.size == 0, (bad[:3], got[tuple(bad[0])], want[tuple(bad[0])], tol[tuple(bad[0])])


@pytest.mark.subprocess  # the library's build
@settings(max_examples=60, deadline=None)
@given(case=cases(), symmetric=st.booleans())
def test_the_generic_variant_equals_a_numpy_model(generic: ctypes.CDLL,
                                                  case: dict[str, np.ndarray],
                                                  symmetric: bool) -> None:
    x, q4, c8, d, m, scale = (case[key] for key in ("x", "q4", "c8", "d", "m", "scale"))
    rows, k = x.shape
    n, groups = d.shape
    x8, xd, s = (np.empty((rows, k), np.int8), np.empty((rows, groups), np.float32),
                 np.empty((rows, groups), np.int32))
    generic.aici_quantise_f32(_p(x), rows, k, _p(x8), _p(xd), _p(s))
    want8, want_d, want_s = quantise_model(x)
    assert np.array_equal(x8, want8) and np.array_equal(xd.view(np.uint32),
                                                        want_d.view(np.uint32))
    assert np.array_equal(s, want_s)

    acts = Acts(x8.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
                xd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                s.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), rows, k)
    xs = xd.astype(np.float64)                                   # [rows, G]
    xg = x8.astype(np.int64).reshape(rows, groups, GROUP)
    subnormal_step = 2.0**-150

    # int4: sum_g xd (d dot + m s), or xd d (dot - 8 s) with m = -8 d left out.
    out = np.empty((rows, n), np.float32)
    codes4 = tile_int4(q4)
    d_t, m_t = per_tile(d).view(np.uint16), per_tile(m).view(np.uint16)
    generic.aici_int4_tiles_generic(_p(codes4), _p(d_t), None if symmetric else _p(m_t),
                                    ctypes.byref(acts), n, 0, n // TILE, _p(out))
    w = q4.astype(np.int64).reshape(n, groups, GROUP) - (8 if symmetric else 0)
    dot = np.einsum("agi,ogi->aog", xg, w).astype(np.float64)    # [rows, n, G]
    t1 = d.astype(np.float64)[None] * xs[:, None] * dot
    t2 = np.zeros_like(t1) if symmetric else \
        m.astype(np.float64)[None] * xs[:, None] * s.astype(np.float64)[:, None]
    _within(out.astype(np.float64), (t1 + t2).sum(-1), (abs(t1) + abs(t2)).sum(-1),
            2 * groups + 4, 2 * groups * (2**16 + 2) * subnormal_step)

    # int8: scale sum_g xd (dot - 128 s), the stored bytes c + 128.
    codes8 = tile_int8(c8)  # held: _p gives the address only
    generic.aici_int8_tiles_generic(_p(codes8), _p(scale), ctypes.byref(acts), n, 0, n // TILE,
                                    _p(out))
    dot8 = np.einsum("agi,ogi->aog", xg, c8.astype(np.int64).reshape(n, groups, GROUP))
    t = scale.astype(np.float64)[None, :, None] * xs[:, None] * dot8
    _within(out.astype(np.float64), t.sum(-1), abs(t).sum(-1), 2 * groups + 4,
            (groups + 2) * 2 * subnormal_step * np.maximum(1.0, abs(scale.astype(np.float64))))
