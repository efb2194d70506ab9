"""Weight-only quantised linear layers (`--quantize int8|int4`): their passes of few rows on
the project's int kernels where this CPU runs them (`kernels/int_mm.py`), else, and for
the layouts kept, on PyTorch's own weight-only kernels (the ones gpt-fast uses).

Decode is bound by reading weights: a bf16 step of the default model reads ~270 MB, an
int4 one ~80 MB. The layouts:

- int4: `_weight_int4pack_mm_for_cpu` (CUDA: `_weight_int4pack_mm`, tinygemm), group-32
  asymmetric: weight = (q - 8) * scale + zero per group of 32 inputs, q in 0..15. A GGUF
  Q4_0/Q4_1 block, or a Q4_K sub-block, is exactly such a group (`blocks`,
  `kquant`): its codes are used as they are; a Q5_0 block or Q5_K sub-block loses at
  most its codes' low bit (`kquant`).
- int8: `_weight_int8pack_mm` (CPU), per output channel symmetric: weight = q * scale.
  On CUDA, where PyTorch has no such kernel, the int8 weights are widened per call.

In both modes the output projection (`lm_head`, the largest matrix: 49,152 x 576 in the
default model) is int8: the GGUF keeps it in 8 bits too (Q8_0), and 4 bits there cost
more quality than anywhere else. So is a GGUF's Q6_K matrix (the more-bits matrices of
a Q4_K_M or Q5_K_M file): int4 would take ~8x its int8 error from it. Embeddings are
not quantised (a lookup reads a few rows): a GGUF's stays in its own blocks, its rows
widened as read (`block_embedding`).

A model's layers are built by `model_layers.quantize_model` (and, where the project's int
kernels run, `vnni_layouts.build`): a conversion's from its GGUF on a mode's first run,
then kept in the kernels' layout; a model directory's quantised from its dense weights at
each load.

torchao was measured as the alternative: 0.18.0 takes 6.6 s to import here (against the
run's whole start-up budget of 1.5 s) and its CPU int4 layout refuses torch 2.13.

Measured on the 2-core Xeon (bf16 activations, one thread, M = rows):
576x1536 M=1: bf16 297 us, int8 125 us, int4 112 us; the 49,152-row projection M=1:
bf16 10.7 ms, int8 4.0 ms, int4 2.2 ms (see docs/speed.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from aici_cli.core.errors import ModelError
from aici_cli.models.cache.packed_layers import pack_int4_cpu
from aici_cli.models.gguf import blocks
from aici_cli.models.gguf.matrices import GgufMatrices
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels.aligned import aligned
from aici_cli.models.quant import prompt_tokens

GROUP = blocks.BLOCK  # int4 group size: one GGUF block
MODES = ("none", "int8", "int4")
# The activations the project's int kernels take (`kernels/int_mm.py`): both are rounded
# to 8 bits per group of 32 there, so a float32 run's layers cost what a bf16 run's do.
INT_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


class Int4Linear(torch.nn.Module):
    """y = x W^T (+ b) with W as group-32 int4 codes packed for the device's kernel.

    `packed`: the kernel's layout of the [N, K] codes; `scale_zero`: [K/32, N, 2] in the
    activation dtype (the kernels require it to match)."""

    packed: torch.Tensor
    scale_zero: torch.Tensor
    bias: torch.Tensor | None
    # [N, K] in the activation dtype, for the prompt tokens of 16-bit passes
    # (`dense_copies`, `prompt_tokens`): an attribute, not a buffer (no state dict, no
    # package, no stacked layer has one).
    dense: torch.Tensor | None = None
    # Whether bf16 and float32 tokens off the dense copy run the int kernels (int_mm) on
    # the same matrix in its layout: buffers `vnni_codes`, `vnni_d`, `vnni_m` (`use_vnni`).
    vnni: bool = False
    vnni_codes: torch.Tensor
    vnni_d: torch.Tensor
    vnni_m: torch.Tensor

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        """`codes` [N, K] int32 in 0..15, `d`, `m` [N, K/32]: weight = codes * d + m."""
        super().__init__()
        n, k = codes.shape
        self.in_features, self.out_features = k, n
        if codes.device.type == "cuda":
            self.inner_k_tiles = _cuda_inner_k_tiles(k)
        self.register_buffer("scale_zero", scale_zero(d, m, dtype))
        self.register_buffer("packed", pack_int4(codes))
        self.register_buffer("bias", bias)

    @classmethod
    def from_buffers(cls, packed: torch.Tensor, scale_zero: torch.Tensor,
                     bias: torch.Tensor | None) -> Int4Linear:
        """A layer over buffers already in the kernel's layout (another layer's, stacked
        or kept: `fused_linear`, `packed_layers`); `scale_zero` [K/32, N, 2]."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        k, n = scale_zero.shape[0] * GROUP, scale_zero.shape[1]
        layer.in_features, layer.out_features = k, n
        if packed.device.type == "cuda":
            layer.inner_k_tiles = _cuda_inner_k_tiles(k)
        # Kept or stacked buffers may start anywhere (a mapped file's offset, a slice):
        # the kernels read them with aligned vector loads (`aligned`).
        layer.register_buffer("scale_zero", aligned(scale_zero))
        layer.register_buffer("packed", aligned(packed))
        layer.register_buffer("bias", bias)
        return layer

    @classmethod
    def vnni_only(cls, tiled: int_mm.Tiled4, dtype: torch.dtype,
                  bias: torch.Tensor | None) -> Int4Linear:
        """A layer that runs only bf16/float32 passes of fewer than its dense rows, on the
        int kernel over `tiled` (the compiled step's stacked layers, `fused_linear`): no int4
        kernel buffers (`packed` empty; any other pass raises)."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.in_features, layer.out_features = tiled.k, tiled.n
        layer.register_buffer("scale_zero", torch.empty(0, dtype=dtype))
        layer.register_buffer("packed", torch.empty(0, dtype=torch.uint8))
        layer.register_buffer("bias", bias)
        layer.use_vnni(tiled)
        return layer

    @classmethod
    def from_parts(cls, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                   bias: torch.Tensor | None, dtype: torch.dtype) -> Int4Linear:
        """A layer over codes already in the kernel's layout (`pack_int4`) and the scales
        they were packed with (kept: `packed_layers`)."""
        return cls.from_buffers(packed, scale_zero(d, m, dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        prompt = self.prompt_tokens(flat.shape[0])
        if prompt is not None:
            assert self.dense is not None
            y = prompt.run(flat, self.dense, self.few_rows)
        else:
            y = self.few_rows(flat)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def prompt_tokens(self, rows: int) -> prompt_tokens.PromptTokens | None:
        """The prompt tokens of an eager pass of `rows` tokens that run on the dense copy
        (`prompt_tokens`), or None where every token runs the int kernel (no copy, no
        prompt token, or not the pass's own rows)."""
        # The copy first: a compiled step's layers have none, so its graph never asks.
        if self.dense is None:
            return None
        tokens = prompt_tokens.current()
        return tokens if tokens is not None and tokens.total == rows else None

    def runs_int_kernel(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether every token of a pass of `rows` rows of `dtype` runs on the project's
        int kernel."""
        return self.vnni and dtype in INT_KERNEL_DTYPES and self.prompt_tokens(rows) is None

    def few_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, K] -> [rows, N] on the quantised kernel a pass without the dense copy
        runs (`dense_copies` times it against the copy): the project's int kernel for bf16
        and float32 rows where the layer has its layout, else PyTorch's int4 kernel."""
        if self.vnni and flat.dtype in INT_KERNEL_DTYPES:
            return torch.ops.aici.int4_vnni_mm(flat.contiguous(), self.vnni_codes,
                                               self.vnni_d, self.vnni_m, self.out_features)
        if self.packed.numel() == 0:
            raise RuntimeError(f"a VNNI-only int4 layer got {flat.shape[0]} {flat.dtype} rows")
        if self.packed.device.type == "cuda":
            return torch.ops.aten._weight_int4pack_mm(flat, self.packed, GROUP, self.scale_zero)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP,
                                                          self.scale_zero)

    def tiled(self) -> int_mm.Tiled4 | None:
        """The VNNI kernel's buffers, where the layer has them."""
        if not self.vnni:
            return None
        return int_mm.Tiled4(self.vnni_codes, self.vnni_d, self.vnni_m,
                                   self.out_features, self.in_features)

    def use_vnni(self, tiled: int_mm.Tiled4) -> None:
        """Run bf16 and float32 passes on the int kernels over `tiled` (this layer's
        matrix, in their VNNI layout)."""
        assert (tiled.n, tiled.k) == (self.out_features, self.in_features)
        self.register_buffer("vnni_codes", tiled.codes)
        self.register_buffer("vnni_d", tiled.d)
        self.register_buffer("vnni_m", tiled.m)
        self.vnni = True


def scale_zero(d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' [K/32, N, 2] scales and zeros in `dtype` for weight = q d + m, [N, K/32]
    each: weight = (q - 8) d + (m + 8 d), so the kernels' zero is m + 8 d. Written into
    the result in place: stacking, then converting, ran 60x slower on two busy threads
    (~0.7 s of the default model's load)."""
    scale = d.float()
    zero = m.float() + 8 * scale
    out = torch.empty(d.shape[1], d.shape[0], 2, dtype=dtype, device=d.device)
    out[..., 0] = scale.t()
    out[..., 1] = zero.t()
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in 0..15 (any integer dtype) in the int4 kernel's layout for their
    device (`packed_layers` says what it depends on)."""
    if codes.device.type == "cuda":
        pairs = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(
            pairs, _cuda_inner_k_tiles(codes.shape[1]))
    return pack_int4_cpu(codes)


class Int8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W as int8 codes [N, K] and one scale per output channel."""

    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    vnni: bool = False  # bf16 and float32 passes on the int kernels (`use_vnni`)
    vnni_codes: torch.Tensor
    vnni_scale: torch.Tensor

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        # Aligned: the AVX-512 kernel reads `codes` with aligned loads, and a kept layer's
        # codes are a view of a mapped file (`aligned`).
        self.register_buffer("codes", aligned(codes.to(torch.int8).contiguous()))
        self.register_buffer("scale", aligned(scale.to(dtype).contiguous()))  # [N]
        self.register_buffer("bias", bias)

    @classmethod
    def from_buffers(cls, codes: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> Int8Linear:
        """A layer over its buffers as another layer holds them (`codes` int8 [N, K],
        `scale` [N] in the activation dtype)."""
        return cls(codes, scale, bias, scale.dtype)

    @classmethod
    def vnni_only(cls, tiled: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype, k: int) -> Int8Linear:
        """A layer that runs only bf16/float32 passes, on the int kernel over `tiled` (its
        codes in the kernel's layout, `int_mm.tile_int8`) with `scale` [N] float32: no
        plain codes (`codes` empty; `rows` gathers from the tiles)."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.out_features, layer.in_features = scale.shape[0], k
        layer.register_buffer("codes", torch.empty(0, dtype=torch.int8))
        layer.register_buffer("scale", aligned(scale.to(dtype).contiguous()))
        layer.register_buffer("bias", bias)
        layer.use_vnni(tiled)
        return layer

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The codes of output rows `ids`: [len(ids), K] int8 (the masked projection's
        gather: len(ids) K bytes read)."""
        if self.codes.numel():
            return self.codes[ids]
        return int_mm.tiled_int8_rows(self.vnni_codes, self.out_features, self.in_features, ids)

    def use_vnni(self, codes: torch.Tensor) -> None:
        """Run bf16 and float32 passes on the int kernel over `codes` (this layer's, tiled:
        `int_mm.tile_int8`) and its scales in float32 (as rounded to the activation
        dtype: the int8 kernel's own)."""
        assert codes.numel() == self.out_features * self.in_features
        self.register_buffer("vnni_codes", codes)
        self.register_buffer("vnni_scale", self.scale.float())
        self.vnni = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        y = int8_mm(flat, self.codes, self.scale, self.vnni_scale if self.vnni else None,
                    self.vnni_codes if self.vnni else None, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


def int8_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
            vnni_scale: torch.Tensor | None = None,
            tiled: torch.Tensor | None = None, n: int | None = None) -> torch.Tensor:
    """x [r, K] times int8 `codes` [N, K] with row `scale` [N] -> [r, N]: the one kernel
    choice of int8 weights, for a layer's passes and for the masked projection's gathered
    rows alike (so that both give the same values).

    The project's int kernel for bf16 and float32 passes where the weights have its
    layout (`vnni_scale`: the float32 scales it takes; `tiled`: the tiles kept, of `n`
    rows, else `codes` tiled per call), else PyTorch's int8 kernel on the CPU, else (no
    int8 weight-only kernel) widened per call.
    """
    if vnni_scale is not None and x.dtype in INT_KERNEL_DTYPES:
        if tiled is None:
            return int_mm.int8_rows_mm(x, codes, vnni_scale)
        rows = n if n is not None else codes.shape[0]
        return torch.ops.aici.int8_vnni_mm(x.contiguous(), tiled, vnni_scale, rows)
    if codes.numel() == 0:
        raise RuntimeError(f"a VNNI-only int8 layer got {x.shape[0]} {x.dtype} rows")
    if codes.device.type == "cpu":
        return torch.ops.aten._weight_int8pack_mm(x, codes, scale)
    return F.linear(x, codes.to(x.dtype)) * scale


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes [N, K] int8, scale [N] float32), symmetric per channel."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes [N, K] int32 0..15, d, m [N, K/32] float32), asymmetric per
    group of 32 inputs (min/max, as GGUF's Q4_1 and gpt-fast do): weight ~ codes d + m."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((w - lo[..., None]) / d[..., None]).clamp(0, 15).to(torch.int32)
    return codes.reshape(n, k), d, lo


def available_blocks(path: Path) -> set[str]:
    """The block formats of the GGUF matrices a conversion reads ({"q4", "q8"} or a part
    of it; empty for a model that came as float weights)."""
    matrices = GgufMatrices.of(path)
    return matrices.block_kinds() if matrices is not None else set()


def resolve_mode(spec: str, path: Path, dtype: torch.dtype,
                 device: torch.device | None = None) -> str:
    """The quantisation a run uses for `--quantize spec`. `auto`: a GGUF source runs at
    its own precision where a kernel exists (one with 4-bit matrices and none of 5 bits
    as int4, one with matrices of 5 bits or more as int8: `GgufMatrices.block_kinds`)
    in a 16-bit run, and in a float32 run on a CPU whose int kernels run (`device`: the
    run's; `kernels/int_mm.py`: every CPU of AVX2 or NEON and up); GPUs, other float32
    runs (the int kernels off) and float sources run unquantised."""
    if spec in MODES:
        return spec
    if spec != "auto":
        raise ModelError(f"unknown quantization {spec!r}: expected auto, none, int8 or int4")
    if device is not None and device.type == "cuda":
        # A GPU streams 16-bit weights at its memory's rate, and the kernels' launches, not
        # the bytes, bound a small model's step; CUDA's int8 path widens the whole matrix
        # on every call. Weights run as the model stores them unless --quantize says so.
        return "none"
    if dtype == torch.float32 and not (device is not None and device.type == "cpu"
                                       and int_mm.unusable() is None):
        return "none"
    kinds = available_blocks(path)
    return "int4" if "q4" in kinds else "int8" if "q8" in kinds else "none"


def _cuda_inner_k_tiles(k: int) -> int:
    """tinygemm's innerKTiles: the largest of 8, 4, 2 with K a multiple of 16 of them."""
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ModelError(f"int4 on CUDA needs input sizes that are multiples of 32, not {k}")


def module_name(model: Any, module: Any) -> str | None:
    """`module`'s dotted name in `model`, or None where it is not one of its modules."""
    return next((n for n, m in model.named_modules() if m is module), None)


def set_module(model: Any, name: str, new: torch.nn.Module) -> None:
    """Put `new` in `model` under the dotted `name`, in place of what was there."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
