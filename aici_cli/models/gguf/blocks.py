"""A GGUF tensor's quantisation blocks as integer codes and their scales, without floats.

ggml stores a Q4_0, Q4_1 or Q8_0 matrix row by row in blocks of 32 weights along the
input dimension (K); each block holds one or two float16 numbers and 32 codes:

    Q4_1: d, m (f16), 16 bytes of 4-bit codes q   -> w = q * d + m
    Q4_0: d (f16),    16 bytes of 4-bit codes q   -> w = (q - 8) * d = q * d + (-8 d)
    Q8_0: d (f16),    32 signed bytes q           -> w = q * d

Byte j of a 4-bit block holds code j in its low nibble and code j + 16 in its high one.
A 4-bit block is exactly one group of group-32 asymmetric int4 (PyTorch's int4 kernels,
`quant/quantize.py`), so those weights load with their own codes and scales: no dequantise and
requantise round trip. Torch-free (numpy only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights per ggml block (QK4_0 = QK4_1 = QK8_0)

# ggml type name -> bytes per block.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}

FOUR_BIT = frozenset({"Q4_0", "Q4_1"})
EIGHT_BIT = frozenset({"Q8_0"})


@dataclass(frozen=True)
class Int4Blocks:
    """`codes`: [N, K/2] uint8, two 4-bit codes per byte in column order (column 2c in the
    low nibble, 2c + 1 in the high one); `d`, `m`: [N, K/32] float16 (float32 for a
    Q4_K's sub-blocks: `kquant`), so that weight (n, k) = codes[n, k] * d[n, k // 32] +
    m[n, k // 32]."""

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray


@dataclass(frozen=True)
class Int8Blocks:
    """`codes`: [N, K] int8; `d`: [N, K/32] float16: weight (n, k) = codes[n, k] * d[n, k // 32]."""

    codes: np.ndarray
    d: np.ndarray


def is_block_type(type_name: str) -> bool:
    return type_name in _BLOCK_BYTES


def read_blocks(raw: np.ndarray, type_name: str) -> Int4Blocks | Int8Blocks:
    """The blocks of a GGUF tensor's data (`GGUFReader` tensor `.data`: [N, bytes per row]
    uint8) of type `type_name` (Q4_0, Q4_1 or Q8_0). Costs a few copies of the raw bytes."""
    size = _BLOCK_BYTES[type_name]
    rows, row_bytes = raw.shape
    if row_bytes % size:
        raise ValueError(f"{type_name} rows of {row_bytes} bytes are not whole blocks")
    blocks = np.ascontiguousarray(raw).reshape(rows, row_bytes // size, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]  # [N, K/32]
    if type_name == "Q8_0":
        codes8 = blocks[:, :, 2:].copy().view(np.int8).reshape(rows, -1)  # [N, K]
        return Int8Blocks(codes=codes8, d=d)
    if type_name == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
        packed = blocks[:, :, 4:]
    else:  # Q4_0: w = (q - 8) d; -8 d is exact in float16 (a power-of-two multiple)
        m = (d * np.float16(-8)).astype(np.float16)
        packed = blocks[:, :, 2:]
    # [N, K/32, 16] bytes -> codes in column order [N, K/32, 32]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return Int4Blocks(codes=pack_codes(codes), d=d, m=m)


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """[N, K] 4-bit codes (0..15) -> [N, K/2] uint8, column 2c in the low nibble."""
    c = codes.astype(np.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """The inverse of `pack_codes`: [N, K/2] uint8 -> [N, K] uint8 codes."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def dequantize(blocks: Int4Blocks | Int8Blocks) -> np.ndarray:
    """[N, K] float32 weights (for checks: the engine never needs them)."""
    if isinstance(blocks, Int8Blocks):
        d = np.repeat(blocks.d.astype(np.float32), BLOCK, axis=1)
        return blocks.codes.astype(np.float32) * d
    codes = unpack_codes(blocks.codes).astype(np.float32)
    d = np.repeat(blocks.d.astype(np.float32), BLOCK, axis=1)
    m = np.repeat(blocks.m.astype(np.float32), BLOCK, axis=1)
    return codes * d + m
