"""Weights at 64-byte boundaries: written so by the project, copied so at load.

CPU kernels may read a weight with aligned vector loads. PyTorch's AVX-512
`_weight_int8pack_mm` does (a `vmovdqa` of 16 bytes), and a weight that starts off a
16-byte boundary kills the process with SIGSEGV. Tensors mapped from a safetensors file
start wherever the file puts them: the format packs them back to back after a JSON header
of any length, so `safetensors`' own writer leaves most of them 8-byte aligned only. Two
defences, each enough alone:

- `save_aligned` writes the project's own files (conversions, GGUF blocks, kept packed
  layers) with the data and every tensor at a 64-byte boundary of the file (a memory map
  starts at a page, so a mapped tensor is then aligned in memory too). The format allows
  no gap between tensors, so a tensor whose size is not a multiple of 64 is followed by a
  padding tensor (`PAD_PREFIX`, uint8), which readers ignore; the header is padded with
  spaces, which JSON allows. Any safetensors reader reads these files.
- `align_model` copies every tensor a kernel reads that does not start at a 64-byte
  boundary, whatever file it came from (a user's own safetensors, an older cache entry).
  PyTorch's CPU allocator returns 64-byte aligned memory, so a copy is aligned.

64 bytes is a cache line and an AVX-512 register: the widest alignment any CPU kernel asks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

ALIGN = 64
PAD_PREFIX = "__aici_pad__."  # padding tensors of `save_aligned`; never a model's name

_TORCH_CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                torch.float64: "F64", torch.int8: "I8", torch.uint8: "U8",
                torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
                torch.bool: "BOOL"}
_NUMPY_CODES = {"float16": "F16", "float32": "F32", "float64": "F64", "int8": "I8",
                "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64",
                "bool": "BOOL"}


def is_aligned(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s first element sits at a 64-byte boundary (an empty one has none
    to read)."""
    return tensor.numel() == 0 or tensor.data_ptr() % ALIGN == 0


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself where it is aligned, else a contiguous copy (which is)."""
    if is_aligned(tensor):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def align_model(model: torch.nn.Module) -> int:
    """Copy, in place, every parameter and buffer of `model` that a kernel reads and that
    does not start at a 64-byte boundary; returns how many were copied.

    A parameter keeps its identity (its `.data` is replaced), so tied weights stay tied.
    Tensors only embedding lookups read are left as they are: a lookup gathers rows with
    no vector-aligned load of the table, and copying a mapped table would make its pages
    resident (the default model's: 57 MB)."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    kernels = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Embedding)
               for p in m.parameters(recurse=False)}
    copied = 0
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in lookups and id(param) not in kernels:
                continue
            if not is_aligned(param):
                param.data = aligned(param.data)
                copied += 1
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and not is_aligned(buffer):
                module._buffers[name] = aligned(buffer)
                copied += 1
    return copied


def save_aligned(tensors: dict[str, Any], file: Path | str,
                 metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (torch tensors on the CPU, or numpy arrays) as a safetensors file
    with every tensor's data at a 64-byte boundary of the file; see the module docstring.
    Costs one write of the data (no copy of a contiguous tensor)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    blobs: list[memoryview] = []
    offset = 0
    for name, value in tensors.items():
        code, shape, blob = _raw(value)
        header[name] = {"dtype": code, "shape": shape,
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
        pad = -offset % ALIGN
        if pad:
            header[f"{PAD_PREFIX}{len(blobs)}"] = {"dtype": "U8", "shape": [pad],
                                                   "data_offsets": [offset, offset + pad]}
            blobs.append(memoryview(bytes(pad)))
            offset += pad
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)  # the data starts at a 64-byte boundary
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_header(f: BinaryIO) -> tuple[dict[str, Any], int]:
    """The JSON header of the safetensors file `f` reads from its start (its tensors by
    name, each with `dtype`, `shape` and `data_offsets` from the data's start, and
    `__metadata__`), and the offset in the file where the data starts. Raises ValueError
    (or struct.error) where it is not one."""
    (length,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("a safetensors header is a JSON object")
    return header, 8 + length


def without_padding(tensors: dict[str, Any]) -> dict[str, Any]:
    """A file's tensors without `save_aligned`'s padding."""
    return {k: v for k, v in tensors.items() if not k.startswith(PAD_PREFIX)}


def _raw(value: Any) -> tuple[str, list[int], memoryview]:
    """A tensor's safetensors dtype code, shape and bytes (little-endian, row-major)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().contiguous().cpu()
        code = _TORCH_CODES[tensor.dtype]
        flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else \
            torch.empty(0, dtype=torch.uint8)
        return code, list(tensor.shape), memoryview(flat.numpy().data).cast("B")
    array = np.asarray(value)  # (np.ascontiguousarray would make a 0-d array 1-d)
    flat_array = np.ascontiguousarray(array.reshape(-1))
    return _NUMPY_CODES[array.dtype.name], list(array.shape), \
        flat_array.view(np.uint8).data
