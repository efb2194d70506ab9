"""Passes of many rows on dense copies of the int4 layers, where this machine's dense GEMM
is faster than the int4 kernel at that many rows.

The CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) widens every weight again for every
block of rows, so its cost grows with the rows, while a dense GEMM (oneDNN; AMX or
AVX512-BF16 where the CPU has them) reads each weight once for many rows. On the 2-core
Xeon with AMX, 1536 x 576 in bf16:

| rows | int4 | dense bf16 |
| ---: | ---: | ---: |
| 16 | 0.168 ms | 0.071 ms |
| 64 | 0.627 ms | 0.108 ms |
| 1,500 | 14.85 ms | 0.92 ms |

At one row int4 wins (it reads a quarter of the bytes), so one-token steps keep it. A
prefill of 1,500 tokens of the default model took 2.3 s at int4 against 0.55 s dense.

A dense copy costs memory (two bytes a weight: 212 MB for the default model's 210 int4
layers) and time to make (`dense_weight`: the kernel's weights rounded to the activation
dtype, widened from the unpacked codes where that gives the kernel's own bits, 0.10 s for
the default model, else the kernel's own widening, W^T = int4mm(I), 1.58 s). So it is
made once the run has shown it pays, as in ski rental: when the passes of at least
`quantize.DENSE_MIN_ROWS` rows (16) have fed about as many rows as the copy costs on the
int4 kernel (`copy_rows`: 64 unpacked, else 816 for the default model), and only where a
trial on the model's largest int4 layer finds the dense GEMM at least `MIN_SPEEDUP`
times faster on this machine at some of `TRIAL_ROWS` and the deciding pass's rows (an
AVX2 CPU without native bf16 may find it at none), where the copy fits `budget_bytes`,
and where the kernel probe passes this machine's dense kernels (the unquantised mode at
the run's dtype). From then on every pass of at least the smallest of those row counts
from which it pays runs the int4 layers dense (16 rows on the Xeon with AMX: 2.4x there;
more elsewhere); the others, and the compiled one-token step (its stacked layers are
other modules), keep the int4 kernel.

Outputs of a wide pass differ from the int4 kernel's in rounding only (the product's
accumulation order, and the weights rounded to bf16), as a pass of another row count
already does; `--deterministic` runs unquantised and never comes here.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch

from aici_cli.models.cache import packed_layers
from aici_cli.models.kernels import int_mm, probe
from aici_cli.models.quant import quantize
from aici_cli.models.quant.quantize import GROUP, Int4Linear

# Rows of wide passes before the copy is made; None: what making it costs, in rows (the
# layers' input widths, weighted by size: the copy is one pass of K rows through each
# layer's kernel), so the run has spent on the int4 kernel about what the copy costs
# (816 for the default model, ~4,000 for a 1B Llama).
BUILD_AFTER: int | None = None
# What widening a layer from its unpacked codes (`dense_weight`) costs, in rows through its
# int4 kernel: 0.10 s for the default model's 210 layers against 1.58 s for K rows each
# (816 weighted) on the AMX Xeon, about 53 rows; rounded up.
UNPACKED_COPY_ROWS = 64
MIN_SPEEDUP = 1.5  # the dense GEMM's speed-up a trial must show
# The row counts the trial times (with the deciding pass's): passes from the smallest of
# them where the dense GEMM is MIN_SPEEDUP times faster, and at every larger one, run it.
TRIAL_ROWS = (16, 32, 64, 128, 256)
MAX_BYTES = 4 << 30  # and the copy's size at most this, and a quarter of free memory


def dense_weight(layer: Int4Linear) -> torch.Tensor:
    """`layer`'s weights [N, K] in its activation dtype, as its kernel widens them:
    (q - 8) scale + zero in float32, rounded once, from the int kernels' tiles where the
    layer has them (their float16 scales), else from the codes unpacked where this
    machine's layout can be (`packed_layers.unpack_int4_cpu`; 1.8 against 5.6 ms for
    1536 x 576 on the AMX Xeon) and that widening gives the kernel's own bits
    (`_unpacked_exact`), else the product of the identity with them (exact: one term
    a sum)."""
    tiled = layer.tiled()
    if tiled is not None:  # the int kernels' weights: their layout's codes and scales
        tiles, d, m = int_mm.untile_int4(tiled)
        return _widened(tiles, quantize.scale_zero(d, m, layer.scale_zero.dtype))
    n, k = layer.out_features, layer.in_features
    codes = packed_layers.unpack_int4_cpu(layer.packed, n, k) \
        if layer.packed.device.type == "cpu" and _unpacked_exact() else None
    return _kernel_widened(layer) if codes is None else _widened(codes, layer.scale_zero)


def _widened(codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """[N, K] codes and their [K/32, N, 2] scales and zeros: the weights in the scales'
    dtype."""
    n, k = codes.shape
    sz = scale_zero.float().permute(1, 0, 2)  # [N, K/32, 2]
    weights = codes.view(n, k // GROUP, GROUP).float().sub_(8)
    weights.mul_(sz[..., :1]).add_(sz[..., 1:])
    return weights.view(n, k).to(scale_zero.dtype)


def _kernel_widened(layer: Int4Linear) -> torch.Tensor:
    eye = torch.eye(layer.in_features, dtype=layer.scale_zero.dtype,
                    device=layer.packed.device)
    widened = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.packed, GROUP,
                                                          layer.scale_zero)
    return widened.t().contiguous()


@functools.cache
def _unpacked_exact() -> bool:
    """Whether widening unpacked codes gives the kernel's own widening, bit for bit, on a
    probe layer (a kernel that rounds otherwise, an FMA, keeps its own), once a process."""
    generator = torch.Generator().manual_seed(7)
    n, k = 80, 96  # whole blocks of 64 rows and a rest
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    d = torch.rand(n, k // GROUP, generator=generator) * 0.02
    m = -torch.rand(n, k // GROUP, generator=generator) * 0.2
    layer = Int4Linear(codes, d, m, None, torch.bfloat16)
    unpacked = packed_layers.unpack_int4_cpu(layer.packed, n, k)
    if unpacked is None or not torch.equal(unpacked, codes.to(torch.uint8)):
        return False
    return torch.equal(_widened(unpacked, layer.scale_zero), _kernel_widened(layer))


def budget_bytes() -> int:
    """What a dense copy may take: `MAX_BYTES`, and a quarter of the memory available to
    this process (the machine's, and its cgroup's room where a limit is set: a container
    sees the host's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    room = cgroup_room()
    return min(MAX_BYTES, free // 4, MAX_BYTES if room is None else room // 4)


def cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's cgroup may still take (its limit less its usage; v2's
    memory.max, v1's memory.limit_in_bytes), or None where no limit is set."""
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(os.path.join(root, limit)) as f:
                text = f.read().strip()
            with open(os.path.join(root, usage)) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if text == "max" or int(text) >= 1 << 60:  # v1 writes "no limit" as ~2^63
            return None
        return max(0, int(text) - used)
    return None


class WideRows:
    """A model's int4 layers, and whether passes of many rows run them dense yet."""

    def __init__(self, layers: list[Int4Linear], config: Any = None) -> None:
        """`config`: the model's, for the kernel probe's verdict on the dense kernels."""
        self.layers = layers
        self.config = config
        self.fed = 0  # rows of wide passes so far
        self.state = "counting"  # then "dense", or "int4" (it would not pay, or fit)
        self.reason: str | None = None  # why "int4", or what the trial measured
        self.build_s = 0.0
        self.min_rows = 0  # with "dense": passes of this many rows or more run it

    @classmethod
    def for_model(cls, model: Any) -> WideRows | None:
        """None where no layer is int4 on the CPU (nothing to choose), and where the
        layers run float32 activations on the int kernels: there every row of every pass
        stays on the int kernels, whose rows' bits do not depend on the pass's width, so
        a line's text does not depend on which lines share its passes (docs/speed.md,
        "A line's text and its neighbours"). A wide pass on a dense copy runs its rows on
        float activations, a narrow one on 8-bit ones: the kernel would follow the
        neighbours. 16-bit passes keep the copies where a trial finds them faster."""
        layers = [m for m in model.modules() if isinstance(m, Int4Linear)
                  and m.packed.device.type == "cpu"]
        if not layers or all(layer.vnni and layer.scale_zero.dtype == torch.float32
                             for layer in layers):
            return None
        wide = cls(layers, getattr(model, "config", None))
        if all(layer.dense is not None for layer in layers):  # another engine made them
            wide.state, wide.min_rows = "dense", layers[0].dense_rows
        return wide

    def before_pass(self, rows: int) -> None:
        """A pass of `rows` rows (tokens fed) is about to run."""
        if rows < quantize.DENSE_MIN_ROWS or self.state != "counting":
            return
        self.fed += rows
        if self.fed >= (BUILD_AFTER if BUILD_AFTER is not None else self.copy_rows):
            self._decide(rows)

    @property
    def copy_rows(self) -> int:
        """What making the copy costs, in rows through the int4 kernel (`BUILD_AFTER`):
        `UNPACKED_COPY_ROWS` where the codes unpack, else a pass of K rows a layer."""
        if all(layer.vnni for layer in self.layers) or (
                packed_layers.unpacks() and _unpacked_exact()):
            return UNPACKED_COPY_ROWS
        sizes = [layer.in_features * layer.out_features for layer in self.layers]
        return sum(size * layer.in_features for size, layer in zip(sizes, self.layers)) \
            // max(1, sum(sizes))

    def _decide(self, rows: int) -> None:
        need = sum(layer.in_features * layer.out_features for layer in self.layers) \
            * self.layers[0].scale_zero.element_size()
        if need > budget_bytes():
            self.state, self.reason = "int4", f"a dense copy ({need >> 20} MiB) does not fit"
            return
        refused = self._probe_refuses()
        if refused is not None:
            self.state, self.reason = "int4", refused
            return
        trial = max(self.layers, key=lambda layer: layer.in_features * layer.out_features)
        started = time.perf_counter()
        try:
            sizes = sorted({*TRIAL_ROWS, rows})
            made = dense_weight(trial)  # once: the trial's sizes, then the copy itself
            speedups = {n: _trial(trial, made, n) for n in sizes}
            self.reason = "the dense GEMM against the int4 kernel: " + ", ".join(
                f"{speedups[n]:.1f}x at {n} rows" for n in sizes)
            pays = [n for i, n in enumerate(sizes)
                    if all(speedups[m] >= MIN_SPEEDUP for m in sizes[i:])]
            if not pays:
                self.state = "int4"
                return
            for layer in self.layers:
                layer.dense = made if layer is trial else dense_weight(layer)
                layer.dense_rows = pays[0]
        except (MemoryError, RuntimeError) as e:  # fail safe: the int4 kernel, as before
            for layer in self.layers:
                layer.dense = None
            self.state = "int4"
            self.reason = f"making the dense copy failed: {type(e).__name__}: {e}"[:300]
            return
        self.build_s = time.perf_counter() - started
        self.state, self.min_rows = "dense", pays[0]

    def _probe_refuses(self) -> str | None:
        """Why this machine's dense kernels must not run here: the kernel probe's verdict
        on the unquantised mode at the activation dtype (cached per machine; a child
        process of a few seconds the first time), as a run of that mode would ask it. A
        dense GEMM that crashes or computes wrong is never used by a wide pass either."""
        if self.config is None or not probe.enabled():
            return None
        dtype = self.layers[0].scale_zero.dtype
        found = dense_verdict(self.config, dtype)
        if found.ok:
            return None
        return f"the kernel probe rejects {str(dtype).removeprefix('torch.')}+none here: " \
            f"{found.reason}"


def dense_verdict(config: Any, dtype: torch.dtype) -> probe.Verdict:
    """The kernel probe's verdict on this machine's dense kernels at `dtype` for a model
    of `config`: what wide passes ask before their first dense copy (`aici-batch prepare`
    asks it first, so that a run does not wait for the probe's child)."""
    mode = probe.current_mode("cpu", str(dtype).removeprefix("torch."), "none")
    return probe.verdict(mode, probe.Shapes.of_config(config))


def _trial(layer: Int4Linear, dense: torch.Tensor, rows: int) -> float:
    """How many times faster `layer` runs `rows` rows on `dense`, its dense copy, than on
    the int4 kernel (the better of three calls each, after one to warm)."""
    x = torch.randn(rows, layer.in_features, dtype=layer.scale_zero.dtype)

    def best(run: Any) -> float:
        run()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times)

    int4 = best(lambda: layer.few_rows(x))
    return int4 / max(best(lambda: torch.nn.functional.linear(x, dense)), 1e-9)
