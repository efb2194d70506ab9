"""What transformers' own loader decides for a model that the project's loaders must decide
the same way: the attention implementation the architecture can run, and which of its
tensors come from the config rather than from the weights.

`load.py` (through `from_pretrained`) and `mapped_load.py` (a model built on meta, then
mapped from its file) both ask here, so a model loads alike on either path.
"""

from __future__ import annotations

from typing import Any

import torch


def attention_implementation(config: Any) -> str:
    """SDPA where the architecture's transformers class accepts it, else eager.

    transformers refuses SDPA for some architectures (Gemma 2: its attention logits are
    soft-capped, which SDPA cannot do) and raises when asked for it; eager attention is
    what it falls back to itself when no implementation is named.
    """
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:  # not a causal LM transformers knows: its own error comes later
        return "sdpa"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def meta_buffers(model: torch.nn.Module) -> list[str]:
    """The buffers still on meta once the file's tensors are in: candidates for
    `fill_buffers` (rotary frequencies, Gemma's embedding scale, which no checkpoint
    stores)."""
    return [name for name, buf in model.named_buffers() if buf.is_meta]


def fill_buffers(model: Any, names: list[str], device: torch.device) -> list[str]:
    """Compute the buffers `names` of a transformers model on `device` as `from_pretrained`
    does for tensors its checkpoint lacks: with the model's own `initialize_weights`,
    after flagging every other tensor as loaded so that nothing read from the file is
    initialised again (transformers' init functions skip flagged tensors). A buffer holds
    a value computed from the config, never a random one, so where init fills it, its
    absence from the weights is no loss.

    Returns the floating buffers init left unfilled (they start as NaN, where
    `from_pretrained` leaves uninitialised memory): the caller reports them as missing.
    """
    if not names:
        return []
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor._is_hf_initialized = True
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        fresh = (torch.full_like(old, float("nan"), device=device)
                 if old.is_floating_point() else torch.zeros_like(old, device=device))
        parent.register_buffer(child, fresh,
                               persistent=child not in parent._non_persistent_buffers_set)
    for module in model.modules():
        # A module flagged whole (by transformers' own load) is skipped by init.
        if getattr(module, "_is_hf_initialized", False):
            module._is_hf_initialized = False
    model.initialize_weights()
    return [name for name in names
            if (buf := model.get_buffer(name)).is_floating_point() and bool(buf.isnan().any())]
