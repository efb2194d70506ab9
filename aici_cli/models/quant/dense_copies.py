"""Dense copies of the int4 layers for the prompt tokens of 16-bit passes, where this
machine's dense GEMM is faster than the int kernel at many rows.

The int kernel quantises and widens again for every block of rows, so its cost grows with
the rows, while a dense GEMM (oneDNN; AMX or AVX512-BF16 where the CPU has them) reads each
weight once for many rows. On the 2-core Xeon with AMX, 1536 x 576 in bf16:

| rows | int4 | dense bf16 |
| ---: | ---: | ---: |
| 16 | 0.168 ms | 0.071 ms |
| 64 | 0.627 ms | 0.108 ms |
| 1,500 | 14.85 ms | 0.92 ms |

At one row int4 wins (it reads a quarter of the bytes), so generated tokens keep it.

Which tokens take the copy is a rule by token, so that a line's text does not depend on
the lines beside it (`prompt_tokens`: a prompt token, in tiles of a fixed shape; every
other token on the int kernels). The choice whether copies are made at all is taken once,
before the run's first prompt token is computed: a trial on the model's largest int4
layer, a tile of `prompt_tokens.TILE_ROWS` rows on the copy against as many rows on the
int kernel, must show at least `MIN_SPEEDUP`, and the tiles must keep each row's bits
whatever its place and its neighbours (`prompt_tokens.moved_row`; both measured once a
machine, layer shape and dtype, and cached: `measured_trial`), the copy must fit
`budget_bytes`, and the kernel probe must pass this machine's dense kernels (the
unquantised mode at the run's dtype). A choice taken later (as a rental once enough
prompt rows had run) would give the run's first lines other bits than its later ones.

A dense copy costs memory (two bytes a weight: 212 MB for the default model's 210 int4
layers) and time to make (`dense_weight`: the kernel's weights rounded to the activation
dtype, widened from the unpacked codes where that gives the kernel's own bits, 0.10 s for
the default model, else the kernel's own widening, W^T = int4mm(I), 1.58 s).

float32 passes on the int kernels never take copies (`WideRows.for_model`); neither does
the compiled one-token step (its stacked layers are other modules) nor `--deterministic`
(unquantised).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from aici_cli.core.cache_paths import cache_dir
from aici_cli.models.cache import packed_layers
from aici_cli.models.kernels import int_mm, probe
from aici_cli.models.quant import prompt_tokens, quantize
from aici_cli.models.quant.quantize import GROUP, Int4Linear

MIN_SPEEDUP = 1.5  # the dense tiles' speed-up the trial must show
TRIAL_VERSION = 1  # of the trial's cached measurements (`measured_trial`)
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
    """A model's int4 layers, and whether their prompt tokens run on dense copies."""

    def __init__(self, layers: list[Int4Linear], config: Any = None) -> None:
        """`config`: the model's, for the kernel probe's verdict on the dense kernels."""
        self.layers = layers
        self.config = config
        self.state = "undecided"  # then "dense", or "int4" (it would not pay, or fit)
        self.reason: str | None = None  # why "int4", or what the trial measured
        self.build_s = 0.0

    @classmethod
    def for_model(cls, model: Any) -> WideRows | None:
        """None where no layer is int4 on the CPU (nothing to choose), and where the
        layers run float32 activations on the int kernels: a float32 dense GEMM has no
        AMX or bf16 path to gain from (measured 0.36-0.69x the int kernel at 1-1,024 rows
        on the AVX-512 Xeon, 0.49-1.33x on an AVX2 EPYC), so every token stays on the int
        kernels, with no trial. 16-bit runs' prompt tokens take the copies where the
        trial finds them faster."""
        layers = [m for m in model.modules() if isinstance(m, Int4Linear)
                  and m.packed.device.type == "cpu"]
        if not layers or all(layer.vnni and layer.scale_zero.dtype == torch.float32
                             for layer in layers):
            return None
        wide = cls(layers, getattr(model, "config", None))
        if all(layer.dense is not None for layer in layers):  # another engine made them
            wide.state = "dense"
        return wide

    def before_pass(self, prompt_rows: int) -> None:
        """A pass feeding `prompt_rows` prompt tokens is about to run: before the run's
        first, whether its prompt tokens run on dense copies is decided, once."""
        if prompt_rows and self.state == "undecided":
            self._decide()

    @property
    def dense(self) -> bool:
        """Whether the prompt tokens run on the dense copies."""
        return self.state == "dense"

    def _decide(self) -> None:
        need = sum(layer.in_features * layer.out_features for layer in self.layers) \
            * self.layers[0].scale_zero.element_size()
        if need > budget_bytes():
            self.state, self.reason = "int4", f"a dense copy ({need >> 20} MiB) does not fit"
            return
        refused = self._probe_refuses()
        if refused is not None:
            self.state, self.reason = "int4", refused
            return
        trial = self.trial_layer()
        started = time.perf_counter()
        try:
            found = measured_trial(trial)
            self.reason = f"the dense GEMM against the int4 kernel: {found.speedup:.1f}x " \
                f"at {prompt_tokens.TILE_ROWS} rows"
            if found.speedup < MIN_SPEEDUP:
                self.state = "int4"
                return
            if found.moved is not None:
                self.state = "int4"
                self.reason = "the dense GEMM rounds a row by the rows beside it in a tile " \
                    f"here ({found.moved}): prompt tokens stay on the int kernels"
                return
            for layer in self.layers:
                layer.dense = found.made if layer is trial and found.made is not None \
                    else dense_weight(layer)
        except (MemoryError, RuntimeError) as e:  # fail safe: the int4 kernel, as before
            for layer in self.layers:
                layer.dense = None
            self.state = "int4"
            self.reason = f"making the dense copy failed: {type(e).__name__}: {e}"[:300]
            return
        self.build_s = time.perf_counter() - started
        self.state = "dense"

    def trial_layer(self) -> Int4Linear:
        """The layer the trial times: the largest."""
        return max(self.layers, key=lambda layer: layer.in_features * layer.out_features)

    def _probe_refuses(self) -> str | None:
        """Why this machine's dense kernels must not run here: the kernel probe's verdict
        on the unquantised mode at the activation dtype (cached per machine; a child
        process of a few seconds the first time), as a run of that mode would ask it. A
        dense GEMM that crashes or computes wrong is never used for prompt tokens either."""
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
    of `config`: what a run asks before its first dense copy (`aici-batch prepare` asks it
    first, so that a run does not wait for the probe's child)."""
    mode = probe.current_mode("cpu", str(dtype).removeprefix("torch."), "none")
    return probe.verdict(mode, probe.Shapes.of_config(config))


@dataclass(frozen=True)
class Trial:
    """What the trial found for a layer on this machine: the speed-up of its tiles on the
    dense copy over its int kernel, and where the tiles round a row by its place or its
    neighbours (`prompt_tokens.moved_row`; None: nowhere). `made`: the copy, where it was
    made for the trial now (None: read from the cache)."""

    speedup: float
    moved: str | None
    made: torch.Tensor | None = None


def measured_trial(layer: Int4Linear) -> Trial:
    """The trial of `layer` as first measured on this machine for its shape and dtype
    (cached: a timing near the threshold would otherwise choose the kernel of a run's
    prompt tokens, and with it its lines' text, by the machine's load at the run's
    start)."""
    key = json.dumps({"trial": TRIAL_VERSION, "torch": torch.__version__,
                      "machine": probe.fingerprint("cpu"),
                      "shape": [layer.out_features, layer.in_features],
                      "dtype": str(layer.scale_zero.dtype), "vnni": layer.vnni,
                      "rows": prompt_tokens.TILE_ROWS}, sort_keys=True)
    path = cache_dir() / "dense-trials" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return Trial(float(cached["speedup"]), cached.get("moved"))
    except (OSError, ValueError, TypeError, KeyError):
        pass
    made = dense_weight(layer)
    found = Trial(_trial(layer, made, prompt_tokens.TILE_ROWS),
                  prompt_tokens.moved_row(made), made)
    try:  # the first measurement stays: a run that measured at once keeps its own
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "speedup": found.speedup,
                                   "moved": found.moved}) + "\n")
        try:
            os.link(tmp, path)
        finally:
            tmp.unlink()
    except OSError:
        pass  # an unwritable cache, or measured by another run first
    return found


def _trial(layer: Int4Linear, dense: torch.Tensor, rows: int) -> float:
    """How many times faster `layer` runs `rows` rows on `dense`, its dense copy (as the
    prompt tokens run it: `prompt_tokens.tiled_linear`), than on the int4 kernel (the
    better of three calls each, after one to warm)."""
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
    return int4 / max(best(lambda: prompt_tokens.tiled_linear(x, dense)), 1e-9)
