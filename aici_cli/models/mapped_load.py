"""Building a model from its memory-mapped safetensors file, without transformers'
loader and, when quantised, without ever holding its dense linear weights.

The model is built on the meta device (no memory): a Llama-architecture model as this
project's own `models/families/llama.py` (no `transformers.modeling_utils` import: ~1.8 s and
~130 MB less), any other through transformers' `from_config`. Its tensors are then mapped
from the file without a copy where the dtype matches (`mmap`: an embedding lookup pages in
the rows it reads only). Quantised, its linear layers are made from the GGUF blocks or
from the dense file a slice at a time: `from_pretrained` would read every tensor of the
bf16 copy (+170 MB RSS for the default model, ~3 s) before the linear ones could be thrown
away. Result for the default model at int4: the weights cost ~85 MB of RSS instead of 270.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from aici_cli.core.errors import ModelError
from aici_cli.models.families.llama import LlamaShape, RotaryEmbedding, build_on_meta
from aici_cli.models.families.transformers_build import (
    attention_implementation,
    fill_buffers,
    meta_buffers,
)
from aici_cli.models.gguf.block_embedding import BlockEmbedding
from aici_cli.models.gguf.entry_record import BASE_FILE, DENSE_FILE
from aici_cli.models.gguf.matrices import GgufMatrices
from aici_cli.models.quant import vnni_layouts
from aici_cli.models.quant.fused_linear import stack_eager
from aici_cli.models.quant.model_layers import quantize_model
from aici_cli.models.quant.quantize import module_name, set_module
from aici_cli.models.sources.model_files import missing_tensors_problem

_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}


class MappedSafetensors:
    """The tensors of a safetensors file as zero-copy views of its memory map.

    The format: an 8-byte little-endian header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the data."""

    def __init__(self, file: Path) -> None:
        with file.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (length,) = struct.unpack("<Q", self._map[:8])
        header = json.loads(self._map[8 : 8 + length])
        header.pop("__metadata__", None)
        self._start = 8 + length
        self.entries: dict[str, dict[str, Any]] = header

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = _ST_DTYPES[entry["dtype"]]
        lo, hi = entry["data_offsets"]
        count = (hi - lo) // dtype.itemsize
        if count == 0:
            return torch.empty(entry["shape"], dtype=dtype)
        # The map is read-only; torch warns that it cannot protect it, and nothing here
        # writes weights in place.
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._map, dtype=dtype, count=count,
                                    offset=self._start + lo)
        return flat.view(entry["shape"])


def load_mapped(path: Path, dtype: torch.dtype, mode: str, device: torch.device,
                own: bool) -> Any:
    """The model at `path` with its linear layers in `mode` (none, int8 or int4), the
    rest in `dtype` on `device`; `own`: built as `models/families/llama.py`'s model (the caller has
    checked `llama.unsupported`). A tensor the files lack is an error, as in
    `load._load_weights`. Quantised, a conversion's matrices come from its GGUF (or the
    layers kept from it) and its other tensors from `BASE_FILE`; unquantised, and for a
    model directory, every tensor from model.safetensors."""
    matrices = GgufMatrices.of(path) if mode != "none" else None
    weights = path / (BASE_FILE if matrices is not None else DENSE_FILE)
    if not weights.is_file():
        raise ModelError(f"cannot quantize the model at {path}: it has no single "
                         "model.safetensors file (sharded or .bin weights: use --quantize none)")
    model = _build_on_meta(path, dtype, own)
    dense = MappedSafetensors(weights)

    def dense_weight(name: str) -> torch.Tensor:
        return _to(dense.tensor(name), dtype, device)

    # Quantised, the linears need their real shapes only: their dense weights stay the map
    # (the quantizer reads them a slice at a time), or the GGUF's. Unquantised, every
    # tensor in `dtype`.
    for name, module in _linears(model) if mode != "none" else []:
        if f"{name}.weight" in dense.entries:
            module.weight = torch.nn.Parameter(dense.tensor(f"{name}.weight"),
                                               requires_grad=False)
        if module.bias is not None and f"{name}.bias" in dense.entries:
            module.bias = torch.nn.Parameter(dense_weight(f"{name}.bias"), requires_grad=False)
    blocks = _embedding_blocks(model, dense) if matrices is not None else None
    narrow = _narrow_embedding(model, dense, dtype, device) \
        if mode != "none" and blocks is None else None
    _assign_rest(model, dense, dtype, device, keep=narrow)
    # Buffers the file lacks are computed as transformers computes them (before the
    # linears are quantised: its init must see the modules it knows).
    unfilled = [] if own else fill_buffers(model, meta_buffers(model), device)
    # Before quantising: a weight the file lacks would fail there with torch's words.
    from_gguf = _from_gguf(model, matrices, blocks)
    _refuse_missing(path, [n for n, t in model.named_parameters() if t.is_meta
                           and n not in from_gguf] + unfilled)
    scales: vnni_layouts.Scales = {}
    vnni_layouts.build(model, mode, path, dtype, device, matrices)  # where they run, first
    quantize_model(model, mode, path, dtype, device, matrices, scales)
    vnni_layouts.attach(model, path, dtype, device, scales)
    stack_eager(model)  # q/k/v and gate/up as one call in eager passes, where they run
    if blocks is not None:
        set_module(model, blocks.removesuffix(".weight"),
                   _block_embedding(dense, blocks, dtype, device))
    elif narrow is not None:
        _widen_on_lookup(model, narrow, dtype)
    if own:
        _rebuild_rotary(model, device)
    _refuse_missing(path, [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                           if t.is_meta])
    model.generation_config = _generation_config(model, path, own)
    return model


def _linears(model: Any) -> list[tuple[str, torch.nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _from_gguf(model: Any, matrices: GgufMatrices | None, blocks: str | None) -> set[str]:
    """The parameters, absent from the dense file, that come from the GGUF: the linear
    layers' matrices it holds (the tied output projection's is the embedding's), and the
    embedding kept as `blocks`."""
    if matrices is None:
        return set()
    found = {f"{n}.weight" for n, _ in _linears(model) if f"{n}.weight" in matrices}
    embed = module_name(model, model.get_input_embeddings())
    output = module_name(model, model.get_output_embeddings())
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if tied and output is not None and f"{embed}.weight" in matrices:
        found.add(f"{output}.weight")
    return found | ({blocks} if blocks is not None else set())


def _embedding_blocks(model: Any, dense: MappedSafetensors) -> str | None:
    """The input embedding's weight name where the conversion kept it as the GGUF's
    blocks (`tensors`) and the model looks it up plainly."""
    embed = model.get_input_embeddings()
    name = module_name(model, embed)
    if name is None or type(embed) is not torch.nn.Embedding or embed.max_norm is not None:
        return None
    weight = f"{name}.weight"
    stored = any(f"{weight}:{kind}" in dense.entries for kind in ("q8", "q4"))
    return weight if stored and weight not in dense.entries else None


def _block_embedding(dense: MappedSafetensors, weight: str, dtype: torch.dtype,
                     device: torch.device) -> BlockEmbedding:
    """The embedding over its blocks, mapped from the file (a lookup pages in the rows
    it reads)."""
    kind = "q8" if f"{weight}:q8" in dense.entries else "q4"
    m = dense.tensor(f"{weight}:q4_m").to(device) if kind == "q4" else None
    return BlockEmbedding(dense.tensor(f"{weight}:{kind}").to(device),
                          dense.tensor(f"{weight}:{kind}_d").to(device), m, dtype)


def _refuse_missing(path: Path, names: list[str]) -> None:
    if names:
        raise ModelError(f"cannot load model from {path}: {missing_tensors_problem(names)}")


def _build_on_meta(path: Path, dtype: torch.dtype, own: bool) -> Any:
    """The model's modules, every tensor on meta."""
    if own:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        model: Any = build_on_meta(LlamaShape(raw))
        model.name_or_path = str(path)
        return model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attention_implementation(config))


def _generation_config(model: Any, path: Path, own: bool) -> Any:
    """generation_config.json's fields over the special tokens of config.json, as
    transformers' `GenerationConfig.from_model_config` merges them (transformers' own
    object for its models)."""
    file = path / "generation_config.json"
    if not own:
        from transformers import GenerationConfig

        return (GenerationConfig.from_pretrained(path, local_files_only=True)
                if file.is_file() else model.generation_config)
    fields = {key: getattr(model.config, key) for key in _SPECIAL_IDS
              if getattr(model.config, key, None) is not None}
    if file.is_file():
        fields |= json.loads(file.read_text(encoding="utf-8"))
    return SimpleNamespace(**fields)


_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _assign_rest(model: Any, dense: MappedSafetensors, dtype: torch.dtype,
                 device: torch.device, keep: str | None = None) -> None:
    """Every parameter and persistent buffer still on meta, from the file (tied ones
    follow their source); `keep`: a tensor that stays as the file stores it."""
    state = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.is_meta and name in dense.entries:
            state[name] = dense.tensor(name) if name == keep else _to(dense.tensor(name),
                                                                       dtype, device)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()


class WideningEmbedding(torch.nn.Embedding):
    """An embedding table kept narrower than the run (the file's bf16 in a float32 run),
    its looked-up rows widened: exactly the wide table's rows, since widening a float is
    exact."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True,
                         device="meta" if weight.is_meta else None)
        self.out_dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).to(self.out_dtype)


def _narrow_embedding(model: Any, dense: MappedSafetensors, dtype: torch.dtype,
                      device: torch.device) -> str | None:
    """The input embedding's weight name where it can stay the file's map: quantised, it
    is only looked up (the output projection is int8 even when tied to it), so on the CPU
    a table stored narrower than the run is not widened whole (a float32 copy of the
    default model's holds 113 MB); a lookup pages in the rows it reads."""
    embed = model.get_input_embeddings()
    name = module_name(model, embed)
    if device.type != "cpu" or name is None or type(embed) is not torch.nn.Embedding \
            or embed.padding_idx is not None or embed.max_norm is not None:
        return None
    entry = dense.entries.get(f"{name}.weight")
    stored = _ST_DTYPES.get(entry["dtype"]) if entry else None
    if stored is None or not stored.is_floating_point or stored.itemsize >= dtype.itemsize:
        return None
    return f"{name}.weight"


def _widen_on_lookup(model: Any, weight_name: str, dtype: torch.dtype) -> None:
    name = weight_name.removesuffix(".weight")
    set_module(model, name, WideningEmbedding(model.get_submodule(name).weight.detach(), dtype))


def _to(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A mapped tensor in the run's dtype and device: still the map where nothing changes."""
    if tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.to(device)


def _rebuild_rotary(model: Any, device: torch.device) -> None:
    """A `models/families/llama.py` model's rotary inverse frequencies are computed at construction,
    not stored: construct that module again, for real."""
    for name, module in list(model.named_modules()):
        if isinstance(module, RotaryEmbedding) and any(b.is_meta for b in module.buffers()):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child,
                    RotaryEmbedding(model.config, device))
