"""Tiny random-weight models of the architectures users bring, built with transformers'
own config classes and saved as Hugging Face directories (`save_pretrained`).

Each shares the tiny Llama's byte-level BPE tokenizer (tests/support/tiny_model.py), so
every string encodes and the chat template is the same. The weights are drawn with a fixed
seed and a wider spread than transformers' default (`initializer_range` 0.02 gives
near-uniform logits, where a float32 rounding could flip a greedy pick between two
almost equal tokens); each config sets the feature that sets its architecture apart
(QK-norm, attention biases, fused projections, soft-capping, sliding windows, an
embedding scale) small enough to matter within a 32-token run.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Shapes every architecture shares: small enough that building all eight takes ~1 s.
_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
)

# The tokenizer files copied from the tiny Llama's directory.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


def _common(ids: dict[str, Any]) -> dict[str, Any]:
    """The shared shapes, with the ids and any caller's overrides on top."""
    return _COMMON | ids


def _llama(ids: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    # Untied, unlike the suite's tiny Llama: the own module's other output layer.
    return LlamaForCausalLM(LlamaConfig(**_common(ids), tie_word_embeddings=False))


def _mistral(ids: dict[str, Any]) -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    # No window, as Mistral 7B v0.2 and later (v0.1's:
    # tests/models/families/test_architectures.py).
    return MistralForCausalLM(MistralConfig(**_common(ids), sliding_window=None))


def _qwen2(ids: dict[str, Any]) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # q/k/v biases (Qwen 2's own), tied embeddings as the small Qwen models have.
    return Qwen2ForCausalLM(Qwen2Config(**_common(ids), tie_word_embeddings=True))


def _qwen3(ids: dict[str, Any]) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # QK-norm, and its config's head_dim (128, as every Qwen 3 has: transformers' GGUF
    # reader assumes it), other than hidden / heads.
    return Qwen3ForCausalLM(Qwen3Config(**_common(ids), tie_word_embeddings=True))


def _gemma2(ids: dict[str, Any]) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # Caps low enough that the tiny model's logits reach them (the defaults, 50 and 30,
    # would leave them untouched), alternating sliding and full layers.
    return Gemma2ForCausalLM(Gemma2Config(
        **_common(ids), head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0))


def _gemma3(ids: dict[str, Any]) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Text only; embedding scale, QK-norm, sliding and full layers with their own RoPE.
    return Gemma3ForCausalLM(Gemma3TextConfig(
        **_common(ids), head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"]))


def _phi3(ids: dict[str, Any]) -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    # Fused qkv_proj and gate_up_proj.
    return Phi3ForCausalLM(Phi3Config(**_common(ids)))


def _olmo2(ids: dict[str, Any]) -> Any:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    # Norms after attention and MLP, QK-norm over all heads.
    return Olmo2ForCausalLM(Olmo2Config(**_common(ids)))


BUILDERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
    "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "olmo2": _olmo2,
}


def build_arch_model(arch: str, tokenizer_dir: Path, directory: Path,
                     **fields: Any) -> Path:
    """`arch`'s tiny model with the tokenizer of `tokenizer_dir`, saved to `directory`;
    `fields` override the config's (e.g. `initializer_range`). The global torch RNG is
    left untouched."""
    tok = json.loads((tokenizer_dir / "config.json").read_text())
    # The embedding padded past the tokenizer (as most models pad theirs, to a multiple of
    # 64): a GGUF's tokenizer rebuilt by transformers may add a token of its class's own
    # (Qwen 2's <|endoftext|>), which must still fall inside the model's vocabulary.
    vocab = -(-(tok["vocab_size"] + 1) // 64) * 64
    ids: dict[str, Any] = {"vocab_size": vocab, "bos_token_id": tok["bos_token_id"],
           "eos_token_id": tok["eos_token_id"], "pad_token_id": tok["eos_token_id"], **fields}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BUILDERS[arch](ids)
    model.generation_config.bos_token_id = ids["bos_token_id"]
    model.generation_config.eos_token_id = ids["eos_token_id"]
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory
