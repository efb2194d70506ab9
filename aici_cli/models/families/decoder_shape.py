"""Which config.json files `models/families/llama.py` builds, and their fields as that module reads
them: Llama, Mistral, Qwen 2, Qwen 3 and Gemma 3, the decoder families that differ from
Llama's layer only by a few switches.

- llama: q/k/v/o biases per `attention_bias`, MLP biases per `mlp_bias`;
- mistral: no biases; `sliding_window` on every layer (4096 where the file leaves the
  key out, none where it is null);
- qwen2: q/k/v biases always, none on o; refused where a layer slides;
- qwen3: q/k/v/o biases per `attention_bias`; an RMSNorm over each head's dims of q and
  k before RoPE (QK-norm); head_dim 128 unless stated; refused where a layer slides;
- gemma3_text (Gemma 3 text-only): the embedding times sqrt(hidden) in the model's
  dtype; RMSNorms that scale by (1 + weight) in float32; GELU (tanh) in the MLP; four
  norms a layer (after attention, before and after the MLP too); QK-norm; scores scaled
  by query_pre_attn_scalar^-0.5; sliding and full layers (`layer_types`, else every
  sixth full) with RoPE bases of their own. Refused with soft-capped logits, scaled RoPE
  (the 4B and larger models) or bidirectional attention.

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
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}

# config.json keys every supported model states (the rest have transformers' defaults).
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "vocab_size")

# transformers' config defaults that differ between the families.
_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768,
                  "gemma3_text": 131072}
GEMMA3 = "gemma3_text"
# Gemma 3's RoPE bases by layer kind where the file states none (Gemma3TextConfig's).
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def unsupported(raw: dict[str, Any]) -> str | None:
    """Why the model whose config.json is `raw` is not built as `models/families/llama.py` (None:
    it is); such a model loads through transformers instead."""
    kind = raw.get("model_type")
    if kind not in ARCHITECTURES or raw.get("architectures") != [ARCHITECTURES[kind]]:
        return f"architecture {raw.get('architectures')!r}"
    missing = [key for key in _REQUIRED if not isinstance(raw.get(key), int)]
    if missing:
        return f"config.json lacks {', '.join(missing)}"
    if kind == GEMMA3:
        return _gemma3_unsupported(raw)
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


def _gemma3_unsupported(raw: dict[str, Any]) -> str | None:
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        return f"activation {raw.get('hidden_activation')!r}"
    ropes = raw.get("rope_parameters") or {}
    for rope in (*(r or {} for r in ropes.values()), raw.get("rope_scaling") or {}):
        rope_kind = rope.get("rope_type", rope.get("type", "default"))
        if rope_kind != "default":  # Gemma 3 4B and larger: linear scaling (global layers)
            return f"RoPE type {rope_kind!r}"
    if raw.get("attn_logit_softcapping") or raw.get("final_logit_softcapping"):
        return "soft-capped logits"
    if raw.get("use_bidirectional_attention"):
        return "bidirectional attention"
    if not isinstance(raw.get("sliding_window", 4096), int):
        return "no sliding window"
    if raw.get("quantization_config"):
        return "quantization_config"
    return None


def _gemma3_layer_types(raw: dict[str, Any], layers: int) -> list[str]:
    """`layer_types`, else Gemma3TextConfig's pattern: every `sliding_window_pattern`-th
    layer (6 unless stated) full, the others sliding."""
    if raw.get("layer_types"):
        return [str(t) for t in raw["layer_types"]]
    pattern = int(raw.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(layers)]


def _gemma3_thetas(raw: dict[str, Any]) -> dict[str, float]:
    """RoPE base per layer kind: rope_parameters' (transformers 5), else rope_theta and
    rope_local_base_freq (older files), else the defaults."""
    ropes = raw.get("rope_parameters") or {}
    older = {"full_attention": raw.get("rope_theta"),
             "sliding_attention": raw.get("rope_local_base_freq")}
    return {kind: float((ropes.get(kind) or {}).get("rope_theta")
                        or older[kind] or _GEMMA3_THETA[kind])
            for kind in _GEMMA3_THETA}


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
        self.layer_types: list[str] | None = (["full_attention"] * self.num_hidden_layers
                                              if kind in ("qwen2", "qwen3") else None)
        # Gemma-style switches (module docstring); Llama's values elsewhere.
        self.hidden_act = "silu"
        self.norm_offset = False  # RMSNorm scales by (1 + weight), in float32
        self.sandwich_norms = False  # norms after attention and MLP, and before the MLP
        self.embed_scale: float | None = None  # the embedding times sqrt(hidden)
        self.scaling = self.head_dim ** -0.5
        # RoPE base per layer kind where the kinds differ (None: `rope_theta` for all).
        self.rope_thetas: dict[str, float] | None = None
        if kind == GEMMA3:
            self._gemma3(raw)

    def _gemma3(self, raw: dict[str, Any]) -> None:
        self.head_dim = int(raw.get("head_dim") or 256)
        self.hidden_act = "gelu_pytorch_tanh"
        self.norm_offset = self.sandwich_norms = self.qk_norm = True
        self.embed_scale = self.hidden_size ** 0.5
        self.scaling = float(raw.get("query_pre_attn_scalar", 256)) ** -0.5
        self.tie_word_embeddings = bool(raw.get("tie_word_embeddings", True))
        self.attention_bias = self.qkv_bias = self.o_bias = bool(
            raw.get("attention_bias", False))
        self.sliding_window = int(raw.get("sliding_window", 4096))
        self.layer_types = _gemma3_layer_types(raw, self.num_hidden_layers)
        self.rope_thetas = _gemma3_thetas(raw)
        self.rope_theta = self.rope_thetas["full_attention"]
        self.final_logit_softcapping = None
        self.attn_logit_softcapping = None

    def __getattr__(self, name: str) -> Any:  # only for names not set above
        raw = self.__dict__.get("_raw", {})
        if name in raw:
            return raw[name]
        raise AttributeError(name)

    def get_text_config(self) -> DecoderShape:
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(self._raw)
