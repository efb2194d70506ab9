"""Which config.json files `models/llama.py` builds, and their fields as that module reads
them: Llama, Mistral, Qwen 2 and Qwen 3, the decoder families that differ from Llama's
layer only by a few switches.

- llama: q/k/v/o biases per `attention_bias`, MLP biases per `mlp_bias`;
- mistral: no biases; `sliding_window` on every layer (4096 where the file leaves the
  key out, none where it is null);
- qwen2: q/k/v biases always, none on o; refused where a layer slides;
- qwen3: q/k/v/o biases per `attention_bias`; an RMSNorm over each head's dims of q and
  k before RoPE (QK-norm); head_dim 128 unless stated; refused where a layer slides.

Each field takes the default of that family's transformers config class where the file
leaves it out (Qwen 3's head_dim 128, Mistral's window 4096, each family's
max_position_embeddings), so a model reads the same here as through transformers.
Qwen models whose layers slide (`use_sliding_window`) take transformers' path: the
engine gives such models a mask per layer kind, which this model does not take.
"""

from __future__ import annotations

from typing import Any

# model_type -> the architecture name config.json states with it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# config.json keys every supported model states (the rest have transformers' defaults).
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "vocab_size")

# transformers' config defaults that differ between the families.
_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}


def unsupported(raw: dict[str, Any]) -> str | None:
    """Why the model whose config.json is `raw` is not built as `models/llama.py` (None:
    it is); such a model loads through transformers instead."""
    kind = raw.get("model_type")
    if kind not in ARCHITECTURES or raw.get("architectures") != [ARCHITECTURES[kind]]:
        return f"architecture {raw.get('architectures')!r}"
    missing = [key for key in _REQUIRED if not isinstance(raw.get(key), int)]
    if missing:
        return f"config.json lacks {', '.join(missing)}"
    if raw.get("hidden_act", "silu") != "silu":
        return f"activation {raw.get('hidden_act')!r}"
    for rope in (raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}):
        rope_kind = rope.get("rope_type", rope.get("type", "default"))
        if rope_kind != "default":
            return f"RoPE type {rope_kind!r}"
    if raw.get("pretraining_tp", 1) != 1 or raw.get("quantization_config"):
        return "pretraining_tp or quantization_config"
    if kind in ("qwen2", "qwen3") and (raw.get("use_sliding_window")
                                       or "sliding_attention" in (raw.get("layer_types") or [])):
        return "sliding-window layers"
    if kind == "mistral" and raw.get("layer_types"):
        return "layer_types (alternating attention)"
    return None


class DecoderShape:
    """A supported config.json as attributes: the fields the model reads, with the
    family's transformers defaults, and every other key of the file as it is
    (`getattr(config, key)`)."""

    _attn_implementation = "sdpa"

    def __init__(self, raw: dict[str, Any]) -> None:
        self._raw = dict(raw)
        kind = str(raw.get("model_type", "llama"))
        self.model_type = kind
        self.hidden_size = int(raw["hidden_size"])
        self.intermediate_size = int(raw["intermediate_size"])
        self.num_hidden_layers = int(raw["num_hidden_layers"])
        self.num_attention_heads = int(raw["num_attention_heads"])
        self.num_key_value_heads = int(raw.get("num_key_value_heads")
                                       or self.num_attention_heads)
        default_dim = 128 if kind == "qwen3" else self.hidden_size // self.num_attention_heads
        self.head_dim = int(raw.get("head_dim") or default_dim)
        self.vocab_size = int(raw["vocab_size"])
        self.rms_norm_eps = float(raw.get("rms_norm_eps", 1e-6))
        rope = raw.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        bias = bool(raw.get("attention_bias", False))
        self.attention_bias = bias if kind in ("llama", "qwen3") else kind == "qwen2"
        self.qkv_bias = self.attention_bias  # Qwen 2: q/k/v only
        self.o_bias = self.attention_bias and kind != "qwen2"
        self.mlp_bias = bool(raw.get("mlp_bias", False)) if kind == "llama" else False
        self.qk_norm = kind == "qwen3"
        self.tie_word_embeddings = bool(raw.get("tie_word_embeddings", False))
        self.max_position_embeddings = int(raw.get("max_position_embeddings")
                                           or _MAX_POSITIONS[kind])
        # Mistral: every layer's window (None: none); Qwen's windows are refused above.
        window = raw.get("sliding_window", 4096) if kind == "mistral" else None
        self.sliding_window = int(window) if window else None
        self.use_sliding_window = self.sliding_window is not None
        self.layer_types = (["full_attention"] * self.num_hidden_layers
                            if kind in ("qwen2", "qwen3") else None)

    def __getattr__(self, name: str) -> Any:  # only for names not set above
        raw = self.__dict__.get("_raw", {})
        if name in raw:
            return raw[name]
        raise AttributeError(name)

    def get_text_config(self) -> DecoderShape:
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(self._raw)
