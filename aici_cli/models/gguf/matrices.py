"""The matrices a conversion leaves in its GGUF (`tensors`), read from there when a
mode first builds its layers (`quantize`, `packed_layers`).

Each matrix is read with plain reads of its bytes (no GGUF parsing: the conversion
recorded its offset and type), a few rows of blocks at a time where it is requantised, in
the row order transformers gives it. What a layer is built from, by the matrix's type:

- Q4_0, Q4_1, Q4_K: its 4-bit codes and scales as they are (int4), or its exact values
  (int8: requantised per output channel);
- Q5_0, Q5_K: its codes less their low bit where a group needs it (int4, `kquant`), or
  its exact values (int8);
- Q6_K, Q8_0: its exact values (a Q6_K matrix is int8 in int4 runs too: `int8_only`);
- any other type (F16, Q2_K, Q3_K, ...): gguf's own dequantisation rounded to bfloat16,
  the values transformers' conversion stores, so a layer built from it is the one a
  dense copy would give.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aici_cli.core.errors import ModelError
from aici_cli.models.gguf import blocks, kquant
from aici_cli.models.gguf.entry_record import BASE_FILE, source_gguf
from aici_cli.models.kernels import aligned

MATRICES_KEY = "aici:matrices"  # the base file's metadata entry (`tensors`)
STORED_DTYPE = torch.bfloat16  # the dtype of a conversion's dense tensors

RowSource = Callable[[int, int], torch.Tensor]  # (lo, hi) -> rows lo..hi-1, float32


class GgufMatrices:
    """The matrices a conversion at `entry` left in its GGUF, by parameter name."""

    def __init__(self, entry: Path) -> None:
        self._entry = entry
        self._gguf: Path | None = None
        self._where: dict[str, dict[str, Any]] = {}
        header = read_header(entry / BASE_FILE)
        meta = header.get("__metadata__") or {}
        self._where = json.loads(meta.get(MATRICES_KEY, "{}"))

    @classmethod
    def of(cls, entry: Path) -> GgufMatrices | None:
        """The entry's matrices, or None for a directory that keeps its weights dense (a
        user's model directory)."""
        return cls(entry) if (entry / BASE_FILE).is_file() else None

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def names(self) -> set[str]:
        return set(self._where)

    def block_kinds(self) -> set[str]:
        """"q4" where a matrix is Q4_0/Q4_1/Q4_K (an int4 kernel's groups exactly) and
        none has 5 bits; "q8" where one has 5 bits or more (Q5_0, Q5_K, Q6_K, Q8_0: int8
        is ~7x closer to them than int4). A Q4_K_M file with Q5_0 fallbacks (its matrices
        of 640 inputs, not whole super-blocks, in gemma-3-270m's) is "q8" only: int4
        would run its 5-bit majority at KL 0.47 from the bf16 run, int8 at 0.022."""
        kinds = {entry["type"] for entry in self._where.values()}
        four = kinds & (blocks.FOUR_BIT | kquant.INT4_EXACT) \
            and not kinds & kquant.FIVE_BIT
        eight = kinds & (blocks.EIGHT_BIT | kquant.FIVE_BIT | kquant.INT8_ALWAYS)
        return ({"q4"} if four else set()) | ({"q8"} if eight else set())

    def int8_only(self, name: str) -> bool:
        """Whether the matrix is int8 in an int4 run as well: a Q6_K one, whose int4
        requantisation is ~8x further from its values than int8's (docs/models.md)."""
        return self._where[name]["type"] in kquant.INT8_ALWAYS

    def int4(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes [N, K] uint8 in 0..15, d, m [N, K/32] float16, or float32 from
        `kquant`) of a Q4_0/Q4_1/Q4_K/Q5_0/Q5_K matrix, so that weight = codes * d + m
        (exactly but for the 5-bit types: `kquant`); None for another type."""
        kind = self._where[name]["type"]
        if kind in kquant.INT4_EXACT | kquant.FIVE_BIT:
            codes, d, m = kquant.int4_parts(self._raw(name), kind)
            return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)
        if kind not in blocks.FOUR_BIT:
            return None
        return int4_parts(self._raw(name), kind)

    def dense(self, name: str) -> torch.Tensor:
        """The matrix as a dense copy holds it: [N, K] bfloat16."""
        return self._values(name, 0, self._where[name]["data_shape"][0]).to(STORED_DTYPE)

    def row_source(self, name: str) -> RowSource:
        """Rows of the matrix as float32: the blocks' exact values (a K-quant's as gguf
        dequantises them), or for another type the bfloat16 a dense copy holds
        (widened)."""
        kind = self._where[name]["type"]
        exact = blocks.is_block_type(kind) or kind in kquant.TYPES

        def rows(lo: int, hi: int) -> torch.Tensor:
            values = self._values(name, lo, hi)
            return values if exact else values.to(STORED_DTYPE).float()
        return rows

    def _values(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi-1 dequantised as gguf does (float32)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        entry = self._where[name]
        raw = self._raw(name, lo, hi)
        if blocks.is_block_type(entry["type"]):  # ours: numpy, exactly gguf's values
            return torch.from_numpy(blocks.dequantize(
                blocks.read_blocks(raw, entry["type"])))
        values = dequantize(raw, GGMLQuantizationType[entry["type"]])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def _raw(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The GGUF data of rows lo..hi-1 (in the model's row order) as the GGUF reader
        shapes it: [rows, bytes per row] for a quantised type, [rows, K] for a float one."""
        entry = self._where[name]
        shape = list(entry["data_shape"])
        hi = shape[0] if hi is None else hi
        dtype = np.dtype(entry["dtype"])
        row_items = int(np.prod(shape[1:]))
        order = self._order(name)
        gguf = self._file()
        if order is None:
            data = np.fromfile(gguf, dtype=dtype, count=(hi - lo) * row_items,
                               offset=entry["offset"] + lo * row_items * dtype.itemsize)
            return data.reshape(hi - lo, *shape[1:])
        data = np.fromfile(gguf, dtype=dtype, count=shape[0] * row_items,
                           offset=entry["offset"]).reshape(shape)
        return np.ascontiguousarray(data[order[lo:hi]])

    def _order(self, name: str) -> np.ndarray | None:
        if not self._where[name].get("rows"):
            return None
        from safetensors import safe_open

        with safe_open(str(self._entry / BASE_FILE), framework="numpy") as f:
            return np.asarray(f.get_tensor(f"{name}:rows"), dtype=np.int64)

    def _file(self) -> Path:
        if self._gguf is None:
            self._gguf = source_gguf(self._entry)
            if self._gguf is None:
                raise ModelError(
                    f"cannot build the quantised layers of {self._entry}: none of the GGUF "
                    "files it was converted from still holds its content (run it from the "
                    ".gguf file, or delete the directory to convert again)")
        return self._gguf


def int4_parts(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1 tensor's data ([N, bytes per row] uint8) as (codes [N, K] uint8, d,
    m [N, K/32] float16), in torch (a 1B-weight model's codes: seconds in numpy)."""
    size = {"Q4_0": 18, "Q4_1": 20}[kind]
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(rows, -1, size)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16)[..., 0]  # [N, K/32]
    if kind == "Q4_1":
        m = blocks[:, :, 2:4].contiguous().view(torch.float16)[..., 0]
        packed = blocks[:, :, 4:]
    else:  # Q4_0: w = (q - 8) d; -8 d is exact in float16 (a power-of-two multiple)
        m = d * -8
        packed = blocks[:, :, 2:]
    # Byte j of a block holds code j (low nibble) and code j + 16 (high).
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, -1)
    return codes, d, m


def read_header(file: Path) -> dict[str, Any]:
    """A safetensors file's JSON header (its tensors and `__metadata__`), or {} where it
    cannot be read."""
    try:
        with file.open("rb") as f:
            return aligned.read_header(f)[0]
    except (OSError, ValueError, struct.error):
        return {}
