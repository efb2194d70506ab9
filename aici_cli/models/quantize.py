"""Weight-only quantised linear layers (`--quantize int8|int4`) on PyTorch's own kernels.

Decode is bound by reading weights: a bf16 step of the default model reads ~270 MB, an
int4 one ~80 MB. PyTorch ships the weight-only kernels gpt-fast uses, so nothing here is a
hand-written kernel:

- int4: `_weight_int4pack_mm_for_cpu` (CUDA: `_weight_int4pack_mm`, tinygemm), group-32
  asymmetric: weight = (q - 8) * scale + zero per group of 32 inputs, q in 0..15. A GGUF
  Q4_0/Q4_1 block is exactly such a group (`gguf_blocks`): its codes are used as they are.
- int8: `_weight_int8pack_mm` (CPU), per output channel symmetric: weight = q * scale.
  On CUDA, where PyTorch has no such kernel, the int8 weights are widened per call.

In both modes the output projection (`lm_head`, the largest matrix: 49,152 x 576 in the
default model) is int8: the GGUF keeps it in 8 bits too (Q8_0), and 4 bits there cost
more quality than anywhere else. Embeddings stay dense (a lookup reads a few rows).

torchao was measured as the alternative: 0.18.0 takes 6.6 s to import here (against the
run's whole start-up budget of 1.5 s) and its CPU int4 layout refuses torch 2.13.

Measured on the 2-core Xeon (bf16 activations, one thread, M = rows):
576x1536 M=1: bf16 297 us, int8 125 us, int4 112 us; the 49,152-row projection M=1:
bf16 10.7 ms, int8 4.0 ms, int4 2.2 ms (see docs/speed.md).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from aici_cli.core.errors import ModelError
from aici_cli.models import gguf_blocks
from aici_cli.models.aligned import aligned
from aici_cli.models.packed_weights import BUFFERS, packed_file, read_packed, write_packed

GROUP = gguf_blocks.BLOCK  # int4 group size: one GGUF block
MODES = ("none", "int8", "int4")


class Int4Linear(torch.nn.Module):
    """y = x W^T (+ b) with W as group-32 int4 codes packed for the device's kernel.

    `packed`: the kernel's layout of the [N, K] codes; `scale_zero`: [K/32, N, 2] in the
    activation dtype (the kernels require it to match)."""

    packed: torch.Tensor
    scale_zero: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        """`codes` [N, K] int32 in 0..15, `d`, `m` [N, K/32]: weight = codes * d + m."""
        super().__init__()
        n, k = codes.shape
        self.in_features, self.out_features = k, n
        device = codes.device
        # weight = q d + m = (q - 8) d + (m + 8 d): the kernels' zero is m + 8 d.
        zero = m.float() + 8 * d.float()
        scale_zero = torch.stack([d.float().t(), zero.t()], dim=-1).to(dtype).contiguous()
        self.register_buffer("scale_zero", scale_zero)
        if device.type == "cuda":
            self.inner_k_tiles = _cuda_inner_k_tiles(k)
            pairs = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, self.inner_k_tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        self.register_buffer("packed", packed)
        self.register_buffer("bias", bias)

    @classmethod
    def from_buffers(cls, packed: torch.Tensor, scale_zero: torch.Tensor,
                     bias: torch.Tensor | None) -> Int4Linear:
        """A layer over buffers already in the kernel's layout (another layer's, stacked
        or kept: `fused_linear`, `packed_weights`); `scale_zero` [K/32, N, 2]."""
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.packed.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, GROUP, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP,
                                                           self.scale_zero)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class Int8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W as int8 codes [N, K] and one scale per output channel."""

    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.codes.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scale)
        else:  # no int8 weight-only kernel: widen per call
            y = F.linear(flat, self.codes.to(flat.dtype)) * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


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
    """The block formats a converted GGUF keeps beside its bf16 copy ({"q4", "q8"} or a
    part of it; empty for a model that came as float weights)."""
    from aici_cli.models.gguf_quantized import QUANTIZED_FILE

    file = path / QUANTIZED_FILE
    if not file.is_file():
        return set()
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        keys = list(f.keys())  # safe_open is not iterable
    return {key.rsplit(":", 1)[1] for key in keys if key.endswith((":q4", ":q8"))}


def resolve_mode(spec: str, path: Path, dtype: torch.dtype) -> str:
    """The quantisation a run uses for `--quantize spec`. `auto`: a GGUF source runs at
    its own precision where a kernel exists (its 4-bit matrices as int4, an all-8-bit one
    as int8) in a 16-bit run; float32 runs (exactness checks) and float sources run
    unquantised."""
    if spec in MODES:
        return spec
    if spec != "auto":
        raise ModelError(f"unknown quantization {spec!r}: expected auto, none, int8 or int4")
    if dtype == torch.float32:
        return "none"
    blocks = available_blocks(path)
    return "int4" if "q4" in blocks else "int8" if "q8" in blocks else "none"


def quantize_model(model: Any, mode: str, path: Path, dtype: torch.dtype,
                   device: torch.device | None = None) -> int:
    """Replace the linear layers of `model` in place, onto `device` (default: where each
    one is): the decoder layers' in `mode`, the output projection in int8. Matrices the
    conversion kept as GGUF blocks load from them; the others are quantised from their
    dense weights. A conversion-cache entry keeps the layers in their kernels' layout
    (`packed_weights`): a later run reads them instead. Returns the number of layers
    replaced."""
    if mode == "none":
        return 0
    from aici_cli.models.gguf_quantized import QUANTIZED_FILE

    blocks = _BlockFile(path / QUANTIZED_FILE)
    keep = packed_file(path, mode, dtype, device) if device is not None else None
    kept = read_packed(keep, device) if keep is not None and device is not None else {}
    buffers: dict[str, torch.Tensor] = {}
    computed = 0
    output = model.get_output_embeddings()
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    embed_name = module_name(model, model.get_input_embeddings())
    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        weight_name = f"{name}.weight"
        if module is output and tied and embed_name is not None:
            weight_name = f"{embed_name}.weight"  # the tied projection's blocks are there
        bias = module.bias.detach() if module.bias is not None else None
        kind = "int8" if module is output or module.in_features % GROUP else mode
        at = device if device is not None else module.weight.device
        if bias is not None:
            bias = bias.to(at)
        new = _from_kept(kept, name, kind, module, bias, dtype)
        if new is None:
            computed += 1
            new = (_int4(module, blocks, weight_name, bias, dtype, at) if kind == "int4"
                   else _int8(module, blocks, weight_name, bias, dtype, at))
        buffers |= {f"{name}.{b}": getattr(new, b) for b in BUFFERS[kind]}
        set_module(model, name, new)
        replaced += 1
    if keep is not None and computed:
        write_packed(keep, buffers)
    return replaced


def _from_kept(kept: dict[str, torch.Tensor], name: str, kind: str, module: torch.nn.Linear,
               bias: torch.Tensor | None, dtype: torch.dtype) -> torch.nn.Module | None:
    """The layer `name` from the buffers `packed_weights` kept, or None where they are
    missing or do not fit its shape and dtype."""
    n, k = module.out_features, module.in_features
    if kind == "int4":
        packed, sz = kept.get(f"{name}.packed"), kept.get(f"{name}.scale_zero")
        if packed is None or sz is None or sz.shape != (k // GROUP, n, 2) or sz.dtype != dtype \
                or packed.numel() * packed.element_size() * 2 != n * k:  # 4 bits a weight
            return None
        return Int4Linear.from_buffers(packed, sz, bias)
    codes, scale = kept.get(f"{name}.codes"), kept.get(f"{name}.scale")
    if codes is None or scale is None or codes.shape != (n, k) or codes.dtype != torch.int8 \
            or scale.shape != (n,) or scale.dtype != dtype:
        return None
    return Int8Linear.from_buffers(codes, scale, bias)


def _int4(module: torch.nn.Linear, blocks: _BlockFile, name: str,
          bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> Int4Linear:
    q4 = blocks.int4(name)
    if q4 is not None:
        codes_np, d_np, m_np = q4
        unpacked = torch.from_numpy(gguf_blocks.unpack_codes(codes_np).astype(np.int32))
        return Int4Linear(unpacked.to(device), torch.from_numpy(d_np).to(device),
                          torch.from_numpy(m_np).to(device), bias, dtype)
    codes, d, m = quantize_int4(module.weight.detach().to(device))
    return Int4Linear(codes, d, m, bias, dtype)


def _int8(module: torch.nn.Linear, blocks: _BlockFile, name: str,
          bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> Int8Linear:
    # The GGUF's 8-bit blocks have one scale per 32 inputs, the kernel one per channel:
    # requantised from the exact block values (their bf16 copy would round them first),
    # a slice of rows at a time so the float copy never exists whole (113 MB for the
    # default model's output projection).
    rows = blocks.row_source(name)
    if rows is None:
        weight = module.weight.detach()

        def rows(lo: int, hi: int) -> torch.Tensor:
            return weight[lo:hi].float()

    n = module.out_features
    codes = torch.empty(n, module.in_features, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    for lo in range(0, n, _ROWS_AT_ONCE):
        hi = min(n, lo + _ROWS_AT_ONCE)
        codes[lo:hi], scale[lo:hi] = quantize_int8(rows(lo, hi).cpu())
    return Int8Linear(codes.to(device), scale.to(device), bias, dtype)


# Rows requantised at once: bounds the float copies to a few MB.
_ROWS_AT_ONCE = 2048


class _BlockFile:
    """The conversion's GGUF blocks (`gguf_quantized`), read lazily by parameter name.

    Read with plain reads, one tensor at a time, rather than through a memory map: the
    mapped pages of the whole 97 MB file would count in the process's peak RSS."""

    _NP = {"U8": np.uint8, "I8": np.int8, "F16": np.float16, "F32": np.float32}

    def __init__(self, file: Path) -> None:
        self._entries: dict[str, Any] = {}
        self._file = file
        if file.is_file():
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            self._entries, self._start = header, 8 + length

    def _get(self, key: str) -> np.ndarray | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        lo, hi = entry["data_offsets"]
        with self._file.open("rb") as f:
            f.seek(self._start + lo)
            data = bytearray(hi - lo)  # writable: torch.from_numpy warns on read-only
            f.readinto(data)
        return np.frombuffer(data, dtype=self._NP[entry["dtype"]]).reshape(entry["shape"])

    def int4(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        codes = self._get(f"{name}:q4")
        if codes is None:
            return None
        d, m = self._get(f"{name}:q4_d"), self._get(f"{name}:q4_m")
        assert d is not None and m is not None
        return codes, d, m

    def row_source(self, name: str) -> Any:
        """A function (lo, hi) -> rows lo..hi-1 as [hi - lo, K] float32 from the name's
        4- or 8-bit blocks, or None when it has none."""
        q8 = self._get(f"{name}:q8")
        if q8 is not None:
            codes8, d8 = torch.from_numpy(q8), self._get(f"{name}:q8_d")
            assert d8 is not None
            scale8 = torch.from_numpy(d8)

            def rows8(lo: int, hi: int) -> torch.Tensor:
                d = scale8[lo:hi].float().repeat_interleave(GROUP, dim=1)
                return codes8[lo:hi].float() * d
            return rows8
        q4 = self.int4(name)
        if q4 is not None:
            blocks = gguf_blocks.Int4Blocks(*q4)

            def rows4(lo: int, hi: int) -> torch.Tensor:
                part = gguf_blocks.Int4Blocks(blocks.codes[lo:hi], blocks.d[lo:hi],
                                              blocks.m[lo:hi])
                return torch.from_numpy(gguf_blocks.dequantize(part))
            return rows4
        return None


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
