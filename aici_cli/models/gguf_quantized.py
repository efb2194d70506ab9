"""The quantised weights of a GGUF, kept beside its bf16 conversion (`QUANTIZED_FILE`).

A conversion stores each 4-bit (Q4_0, Q4_1) and 8-bit (Q8_0) matrix of the GGUF as its
own codes and block scales (`gguf_blocks`), under the Hugging Face name of the parameter,
so `--quantize int4` loads the GGUF's own 4-bit weights rather than requantising the
dequantised copy. Entry names, for parameter P:

    P:q4 [N, K/2] uint8, P:q4_d and P:q4_m [N, K/32] float16   (w = q * d + m)
    P:q8 [N, K] int8,    P:q8_d [N, K/32] float16               (w = q * d)

Each matrix is checked against transformers' own dequantised tensor (the one the bf16
copy holds) before it is kept: a tensor whose rows transformers reorders in a way found
here (llama's q/k permutation) is reordered alike; any other (an unknown reshaping, a
fused tensor) is left out, and loading quantises it from the bf16 copy instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from aici_cli.models import gguf_blocks
from aici_cli.models.aligned import save_aligned
from aici_cli.models.gguf_blocks import Int4Blocks, Int8Blocks

QUANTIZED_FILE = "aici-quantized.safetensors"


def write_blocks(gguf: Path, model: Any, dense: dict[str, Any], out_dir: Path) -> int:
    """Write `QUANTIZED_FILE` into `out_dir` from the block-quantised tensors of `gguf`;
    `dense` holds transformers' dequantised tensors by parameter name (as loaded into
    `model`). Returns the number of matrices kept (none: no file)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = GGUFReader(str(gguf))
    field = reader.get_field("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    entries: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        hf_name = names.get(tensor.name)
        if not gguf_blocks.is_block_type(kind) or hf_name not in dense:
            continue
        raw = np.asarray(tensor.data)
        order = _row_order(processor, tensor.name, raw.shape[0])
        if order is None:
            continue
        blocks = gguf_blocks.read_blocks(raw[order], kind)
        if not _matches(blocks, dense[hf_name]):
            continue
        if isinstance(blocks, Int4Blocks):
            entries |= {f"{hf_name}:q4": blocks.codes, f"{hf_name}:q4_d": blocks.d,
                        f"{hf_name}:q4_m": blocks.m}
        else:
            entries |= {f"{hf_name}:q8": blocks.codes, f"{hf_name}:q8_d": blocks.d}
    if entries:
        save_aligned(entries, out_dir / QUANTIZED_FILE)
    return sum(1 for k in entries if k.endswith((":q4", ":q8")))


def _row_order(processor: Any, name: str, rows: int) -> np.ndarray | None:
    """The row order transformers' tensor processor gives the tensor `name` (it moves
    whole rows, so whole rows of blocks follow), found by running it on row indices;
    None where what it does is not a reordering of rows."""
    index = np.arange(rows, dtype=np.float32)[:, None]
    try:
        result = processor.process(weights=index, name=name, tensor_key_mapping={},
                                   parsed_parameters={"tensors": {}})
    except Exception:  # noqa: BLE001 - a processor that needs more than rows: not ours
        return None
    moved = np.asarray(result.weights)
    if result.name != name or moved.shape != index.shape:
        return None
    order = moved[:, 0].astype(np.int64)
    return order if np.array_equal(np.sort(order), np.arange(rows)) else None


def _matches(blocks: Int4Blocks | Int8Blocks, dense: Any) -> bool:
    """Whether the blocks dequantise to transformers' tensor (as rounded to its dtype)."""
    import torch

    mine = torch.from_numpy(gguf_blocks.dequantize(blocks)).to(dense.dtype)
    return tuple(mine.shape) == tuple(dense.shape) and bool(torch.equal(mine, dense))
