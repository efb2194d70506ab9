"""GGUF K-quant matrices (Q4_K, Q5_K, Q6_K), and Q5_0 ones, as the codes and scales of
PyTorch's int4 kernel (group-32 asymmetric: weight = q * d + m, q in 0..15), as exactly
as it allows.

ggml stores a K-quant row in super-blocks of 256 weights along the input dimension (K);
the layouts (`gguf.quants`, whose dequantisation is the reference) are:

    Q4_K (144 bytes): d, dmin (f16); 12 bytes of eight 6-bit scales sc and mins mn
        (`get_scale_min`); 128 bytes of 4-bit codes. Sub-block j (weights 32j..32j+31)
        of codes q in 0..15: w = q * (d sc_j) - dmin mn_j.
    Q5_K (176 bytes): as Q4_K, with 32 bytes of fifth bits qh: q in 0..31.
    Q6_K (210 bytes): 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales,
        d (f16): sub-block j of 16 weights: w = d sc_j (q - 32), q in 0..63.

How each maps onto the kernels:

- Q4_K: exactly. A sub-block is one int4 group with scale d sc and offset -dmin mn, both
  exact products in float32 (an f16 times a 6-bit integer needs 17 bits), so codes * d +
  m in float32 is gguf's dequantisation bit for bit. The kernel keeps scale and zero in
  the activation dtype, which rounds them as it rounds a Q4_0/Q4_1 block's.
- Q5_K: a group whose codes span at most 16 values keeps them (codes less their least;
  the offset moved by as many steps, rounded once more in float32); any other drops
  the codes' low bit: (q - lo) // 2 with scale 2 d sc and offset moved to the midpoint
  (+ d sc / 2), so every weight is off by exactly d sc / 2 (half a 5-bit step; a
  min/max requantisation of the same group is off by up to ~d sc and ~0.6 d sc root
  mean square). A run that leaves `--quantize` at auto takes int8 for such a file.
- Q5_0 (22 bytes a block of 32: d (f16), 4 bytes of fifth bits, 16 of low nibbles: w =
  d (q - 16)): one group with scale d and offset -16 d, 5-bit codes as Q5_K's.
- Q6_K: not here: its two 16-weight sub-blocks per group have scales of their own, and
  an int4 group of 6-bit codes loses ~2 bits. It is requantised per output channel to
  int8 from its exact values (`quantize`; docs/models.md gives the measured errors).

Torch-free (numpy only); a few copies of the raw bytes.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights per super-block (gguf.constants.QK_K; gguf imports in ~0.15 s, so
# only the functions that read blocks import it)

GROUP = 32  # weights per int4 group: one Q4_K/Q5_K sub-block, one Q5_0 block
INT4_EXACT = frozenset({"Q4_K"})  # int4 groups exactly
# 5-bit codes: int4 loses at most their low bit; int8 per channel from their values is
# ~7x closer (docs/models.md), so a file with any of them runs int8 under `auto`.
FIVE_BIT = frozenset({"Q5_0", "Q5_K"})
INT8_ALWAYS = frozenset({"Q6_K"})  # requantised to int8 per channel, in int4 runs too
TYPES = INT4_EXACT | FIVE_BIT | INT8_ALWAYS


def block_bytes(type_name: str) -> int:
    """Bytes per block of `type_name` (gguf's table): a K-quant's 256-weight
    super-block, a Q5_0 block of 32."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]


def int4_parts(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K, Q5_K or Q5_0 tensor's data ([N, bytes per row] uint8) as (codes [N, K]
    uint8 in 0..15, d, m [N, K/32] float32): weight ~ codes * d + m (module docstring:
    exact for Q4_K, within half a 5-bit step for Q5_K and Q5_0)."""
    from gguf.quants import Q4_K

    rows, row_bytes = raw.shape
    size = block_bytes(type_name)
    if row_bytes % size:
        raise ValueError(f"{type_name} rows of {row_bytes} bytes are not whole blocks")
    blocks = np.ascontiguousarray(raw).reshape(-1, size)  # [B = N * K/256 (/32), size]
    if type_name == "Q5_0":
        codes, scale, offset = _q5_0(blocks)
        return (codes.reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1))
    n_blocks = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # [B, 8] each, 6-bit integers
    scale = d * sc.astype(np.float32)  # [B, 8], exact
    offset = -(dmin * mn.astype(np.float32))  # exact
    # Byte c*32 + i of the 128 code bytes: sub-block 2c's code i (low), 2c+1's (high).
    low = blocks[:, -QK_K // 2:].reshape(n_blocks, QK_K // 64, 1, GROUP)
    codes = (low >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    codes = codes.reshape(n_blocks, 8, GROUP)  # [B, 8 sub-blocks, 32]
    if type_name == "Q5_K":
        # Bit j of qh byte i: sub-block j's code i's fifth bit.
        qh = blocks[:, 16:16 + QK_K // 8].reshape(n_blocks, 1, GROUP)
        high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 0x01
        codes, scale, offset = _five_to_four(codes | (high << 4), scale, offset)
    return (codes.reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1))


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[B, 22] Q5_0 blocks as 4-bit groups: ([B, 1, 32] codes, [B, 1] scale, offset)."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    # Bit i of the little-endian 32-bit qh: code i's fifth bit.
    qh = blocks[:, 2:6].copy().view("<u4")  # [B, 1]
    high = ((qh >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.uint8)  # [B, 32]
    # Byte j of the 16 code bytes: code j (low nibble) and code j + 16 (high).
    low = np.concatenate([blocks[:, 6:] & 0x0F, blocks[:, 6:] >> 4], axis=1)
    codes = (low | (high << 4))[:, None, :]
    return _five_to_four(codes, d, d * np.float32(-16))  # -16 d: exact


def _five_to_four(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """5-bit groups ([B, G, 32] codes in 0..31, [B, G] scale s and offset o: w = q s +
    o) as 4-bit ones: q - lo where a group's codes span lo..lo+15 (exact), else
    (q - lo) // 2 with scale 2 s, offset o + lo s + s / 2 (each weight off by s / 2)."""
    lo = codes.min(axis=-1)  # [B, 8]
    halve = (codes.max(axis=-1) - lo) > 15
    shifted = codes - lo[..., None]
    out = np.where(halve[..., None], shifted >> 1, shifted).astype(np.uint8)
    base = offset + lo.astype(np.float32) * scale
    new_offset = np.where(halve, base + scale / 2, base).astype(np.float32)
    new_scale = np.where(halve, scale * 2, scale).astype(np.float32)
    return out, new_scale, new_offset
