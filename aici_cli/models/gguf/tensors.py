"""A conversion's tensors: the ones no run quantises stored once, the GGUF's matrices left
where they are (`BASE_FILE`).

A run that quantises a GGUF's matrix needs the file's own blocks (or, for a type without
a kernel, its values), never a dense copy; a run that does not quantise reads a dense copy
made on its first use (`conversions.ensure_dense`). So a conversion dequantises only
what every run reads as it is (norms, biases: transformers' own conversion of them, in
bfloat16) and records, for each matrix a linear layer holds, where its data lies in the
GGUF: its type, byte offset and row order (`matrices` reads it from there). The input
embedding, which runs look up rather than multiply, is kept once: as the GGUF's own Q8_0,
Q4_0 or Q4_1 blocks (Q4_K: its sub-blocks, as 4-bit blocks) where the file has it so (a
lookup widens the rows it reads: `block_embedding`), else in bfloat16. Entry names, for parameter P:

    P                    a dense tensor, bfloat16
    P:q4, P:q4_d, P:q4_m the embedding's 4-bit blocks (`blocks.Int4Blocks`; d and
                         m float16, or float32 from a Q4_K)
    P:q8, P:q8_d         its 8-bit blocks (`blocks.Int8Blocks`)
    P:rows               int32: the GGUF row of each of the matrix P's rows, where
                         transformers reorders them (llama's q/k permutation)

and in the file's metadata, `MATRICES_KEY`: {P: {tensor, type, offset, bytes, dtype,
data_shape, rows}} for every matrix kept in the GGUF.

transformers' loader dequantises every tensor, then runs its architecture's tensor
processor on it. Here a matrix stays in the GGUF only where that processor moves whole
rows and nothing else (checked on a probe of the tensor's row count, `_row_order`); any
other (an unknown reshaping, a fused tensor) goes through transformers' own steps and is
stored dense, as before, and loading quantises it from there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aici_cli.core.errors import ModelError
from aici_cli.models.gguf import blocks, kquant
from aici_cli.models.gguf.entry_record import BASE_FILE
from aici_cli.models.gguf.matrices import MATRICES_KEY, STORED_DTYPE
from aici_cli.models.kernels.aligned import save_aligned
from aici_cli.models.progress import LoadProgress


def write_base(gguf: Path, model: Any, config: dict[str, Any], out_dir: Path,
               progress: LoadProgress) -> None:
    """Write `BASE_FILE` into `out_dir` for the GGUF `gguf` and `model`, built from its
    config (on meta: only its names and module types are read); `config`: the config
    dict transformers' loader parsed from the file (its tensor processors read it)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = GGUFReader(str(gguf))
    field = reader.get_field("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    names = get_gguf_hf_weights_map(model, processor)
    matrices, embedding, as_blocks = _matrix_names(model)
    dense: dict[str, torch.Tensor] = {}
    kept: dict[str, Any] = {}  # blocks and row orders, by entry name
    where: dict[str, dict[str, Any]] = {}
    # The loader's own loop (`load_gguf_checkpoint`), but for the matrices left in place.
    parsed: dict[str, Any] = {"tensors": dense, "config": config}
    for tensor in progress.steps(reader.tensors, len(reader.tensors),
                                 f"converting {gguf.name}"):
        hf_name = names.get(tensor.name)
        if hf_name in matrices and _keep_in_place(tensor, processor, hf_name, embedding,
                                                  as_blocks, where, kept):
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters=parsed)
        if result.name in names:
            dense[names[result.name]] = torch.from_numpy(np.copy(result.weights)) \
                .to(STORED_DTYPE)
    _refuse_missing(gguf, model, set(dense) | set(where))
    state = set(model.state_dict())
    tensors: dict[str, Any] = {k: v for k, v in dense.items() if k in state} | kept
    save_aligned(tensors, out_dir / BASE_FILE,
                 {"format": "pt", MATRICES_KEY: json.dumps(where, separators=(",", ":"))})


def _matrix_names(model: Any) -> tuple[set[str], str | None, bool]:
    """The weights runs may leave in the GGUF: every linear layer's, and the input
    embedding's (a tied output projection is quantised from it); the embedding's name;
    and whether it may be kept as blocks (a plain lookup: a subclass, such as Gemma's
    scaled embedding, reads `weight` itself)."""
    names = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    embed = model.get_input_embeddings()
    embed_name = next((n for n, m in model.named_modules() if m is embed), None)
    if embed_name is None:
        return names, None, False
    names.add(f"{embed_name}.weight")
    plain = type(embed) is torch.nn.Embedding and embed.max_norm is None
    return names, f"{embed_name}.weight", plain


def _keep_in_place(tensor: Any, processor: Any, hf_name: str, embedding: str | None,
                   as_blocks: bool, where: dict[str, dict[str, Any]],
                   kept: dict[str, Any]) -> bool:
    """Record where `tensor` (a 2-D GGUF matrix, the weight `hf_name`) lies; the input
    `embedding` is kept as its blocks where it may be (`as_blocks`). False where the
    tensor must (also) be stored dense: the processor does more than move its rows, the
    blocks reader disagrees with gguf's own dequantisation on its first row, or it is an
    embedding looked up from a dense table."""
    raw = np.asarray(tensor.data)
    if raw.ndim != 2:
        return False
    order = _row_order(processor, tensor.name, raw.shape[0])
    kind = tensor.tensor_type.name
    ours = blocks.is_block_type(kind) or kind in kquant.INT4_EXACT
    if order is None or (ours and not _reads_as_gguf(raw, kind)):
        return False
    moved = not np.array_equal(order, np.arange(raw.shape[0]))
    where[hf_name] = {"tensor": tensor.name, "type": kind, "offset": int(tensor.data_offset),
                      "bytes": int(tensor.n_bytes), "dtype": raw.dtype.str,
                      "data_shape": list(raw.shape), "rows": moved}
    if moved:
        kept[f"{hf_name}:rows"] = order.astype(np.int32)
    if hf_name != embedding:
        return True
    if not (as_blocks and ours):
        return False  # looked up from a dense copy: stored in bfloat16 as well
    read = _blocks(raw[order], kind)
    if isinstance(read, blocks.Int4Blocks):
        kept |= {f"{hf_name}:q4": read.codes, f"{hf_name}:q4_d": read.d,
                 f"{hf_name}:q4_m": read.m}
    else:
        kept |= {f"{hf_name}:q8": read.codes, f"{hf_name}:q8_d": read.d}
    return True


def _blocks(raw: np.ndarray, kind: str) -> blocks.Int4Blocks | blocks.Int8Blocks:
    """A Q4_0/Q4_1/Q8_0 tensor's blocks as they are; a Q4_K one's as 4-bit blocks of 32
    with float32 scales and offsets (`kquant`: their exact values; 4.5 + 2 bits a
    weight against bfloat16's 16)."""
    if blocks.is_block_type(kind):
        return blocks.read_blocks(raw, kind)
    codes, d, m = kquant.int4_parts(raw, kind)
    return blocks.Int4Blocks(codes=blocks.pack_codes(codes), d=d, m=m)


def _reads_as_gguf(raw: np.ndarray, kind: str) -> bool:
    """Whether the blocks reader (`blocks`, `kquant`) reads the first row of a
    block-type tensor as gguf's own dequantisation does (a cheap guard against a format
    the reader misreads)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    row = np.ascontiguousarray(raw[:1])
    mine = blocks.dequantize(_blocks(row, kind))
    return bool(np.array_equal(mine, dequantize(row, GGMLQuantizationType[kind])))


def _row_order(processor: Any, name: str, rows: int) -> np.ndarray | None:
    """The row order transformers' tensor processor gives the tensor `name` (it moves
    whole rows, so whole rows of blocks follow), found by running it on a probe of the
    tensor's row count: an index column and a column of distinct values; None where what
    it does is not a reordering of rows (or it renames the tensor, or gathers it)."""
    index = np.arange(rows, dtype=np.float32)
    probe = np.stack([index, index * 3.0 + 0.5], axis=1)
    try:
        result = processor.process(weights=probe.copy(), name=name, tensor_key_mapping={},
                                   parsed_parameters={"tensors": {}})
    except Exception:  # noqa: BLE001 - a processor that needs more than rows: not ours
        return None
    moved = np.asarray(result.weights)
    if result.name != name or moved.shape != probe.shape:
        return None
    order = moved[:, 0].astype(np.int64)
    if not np.array_equal(np.sort(order), np.arange(rows)) \
            or not np.array_equal(moved, probe[order]):
        return None
    return order


def _refuse_missing(gguf: Path, model: Any, provided: set[str]) -> None:
    """A parameter the GGUF lacks is an error here, as transformers' loader would leave
    it random; a tied output projection follows its embedding."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in model.state_dict() if k not in provided
               and not (tied and k == "lm_head.weight")]
    if missing:
        raise ModelError(f"cannot convert {gguf}: GGUF lacks tensors {missing[:3]}")
