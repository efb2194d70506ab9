"""Llama-family causal LMs in plain PyTorch, without transformers' model classes: Llama,
Mistral, Qwen 2, Qwen 3 and Gemma 3 text (`models/families/decoder_shape.py` says which configs,
and the switches that tell them apart: projection biases, QK-norm, sliding windows, and
Gemma's embedding scale, offset norms, GELU and four norms a layer).

Importing `transformers.modeling_utils` costs ~1.8 s and ~130 MB of RSS on a 2-core CPU
(torch.distributed.tensor, torch._dynamo, scipy and sympy come with it), more than the
default model's whole first pass. A run on a model of this architecture builds this one
instead (`models/mapped_load.py`).

It is transformers' `LlamaForCausalLM` (`MistralForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`, `Gemma3ForCausalLM`) op for op: the same module names and tensor
shapes (a checkpoint loads by name, the quantizer, the fused decode layer and the
deterministic mode's tiled linears find what they look for), the same RMSNorm, RoPE and
residual order, the same SDPA call, so its logits are transformers' bit for bit
(`tests/models/families/test_llama.py`). It runs what the engine needs: a forward pass over
packed tokens with the engine's cache and attention function (`set_attention`), or a plain
causal pass over `input_ids` without a cache. It does not generate(), train or shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aici_cli.models.families.decoder_shape import DecoderShape, unsupported

__all__ = ["DecoderShape", "LlamaShape", "LlamaCausalLM", "build_on_meta", "unsupported"]

# Every supported config (Llama, Mistral, Qwen 2, Qwen 3) as one shape; the old name stays.
LlamaShape = DecoderShape

Device = torch.device | str | None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: scaled by (1 + weight) in float32, then cast (Llama's casts first
    and scales in the input's dtype); the weight starts at 0."""

    def __init__(self, size: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden * (1.0 + self.weight.float())).type_as(x)


def make_norm(config: DecoderShape, size: int, device: Device) -> nn.Module:
    norm = OffsetRMSNorm if config.norm_offset else RMSNorm
    return norm(size, config.rms_norm_eps, device)


class ScaledEmbedding(nn.Embedding):
    """Gemma's embedding: rows times sqrt(hidden), the factor rounded to the weight's
    dtype first (bfloat16 makes sqrt(3072) 55.5), as transformers does."""

    def __init__(self, rows: int, size: int, scale: float, device: Device = None) -> None:
        super().__init__(rows, size, device=device)
        # Computed, not stored in checkpoints: a CPU tensor even while the model is on meta.
        self.embed_scale = nn.Buffer(torch.tensor(scale), persistent=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * self.embed_scale.to(self.weight.dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE: cos/sin [.., T, head_dim] for position ids [.., T], in x's dtype.
    Where layer kinds have RoPE bases of their own (Gemma 3), one table per kind,
    named as transformers names them (`sliding_attention_inv_freq`, ...)."""

    def __init__(self, config: DecoderShape, device: Device = None) -> None:
        super().__init__()
        dim = config.head_dim
        thetas = config.rope_thetas or {"": config.rope_theta}
        for kind in sorted(thetas):
            if torch.device(device or "cpu").type == "meta":  # arange on meta imports dynamo
                inv_freq = torch.empty(dim // 2, device=device)
            else:
                steps = torch.arange(0, dim, 2, dtype=torch.float, device=device)
                inv_freq = 1.0 / (thetas[kind] ** (steps / dim))
            prefix = f"{kind}_" if kind else ""
            setattr(self, f"{prefix}inv_freq", nn.Buffer(inv_freq, persistent=False))
            # transformers keeps a copy (for dynamic RoPE; default RoPE never reads it).
            setattr(self, f"{prefix}original_inv_freq",
                    nn.Buffer(inv_freq.clone(), persistent=False))
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, kind: str = ""
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`kind`: the layer kind whose table to use (where there is one per kind)."""
        inv_freq = getattr(self, f"{kind}_inv_freq" if kind else "inv_freq")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device,
                                                              dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, unsqueeze_dim: int = 1
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k: [B, heads, T, D]; cos/sin: [B, T, D] (unsqueezed to broadcast over heads)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


AttentionFn = Callable[..., tuple[torch.Tensor, Any]]


def causal_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Plain causal attention over one unpadded sequence per batch row, as transformers'
    SDPA attention runs it on CPU with no mask. q: [B, H, T, D]; returns [B, T, H, D].
    `sliding_window` w (Mistral): a query sees itself and the w - 1 keys before it, as
    transformers' sliding-window mask says; a pass no longer than w is plain causal."""
    if attention_mask is not None:
        raise ValueError("this model takes no attention mask outside the engine's passes")
    groups = int(module.num_key_value_groups)  # type: ignore[arg-type]
    length = query.shape[2]
    window = kwargs.get("sliding_window")
    mask = None
    if window is not None and length > window:
        at = torch.arange(length, device=query.device)
        gap = at[:, None] - at[None, :]  # query index - key index
        mask = (gap >= 0) & (gap < window)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                         is_causal=mask is None and length > 1,
                                         scale=scaling, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


class Attention(nn.Module):
    def __init__(self, config: DecoderShape, layer_idx: int, device: Device = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.scaling
        self.is_causal = True
        kinds = config.layer_types
        self.layer_type = kinds[layer_idx] if kinds else "full_attention"
        # Mistral: every layer's window (no kinds); Gemma 3: its sliding layers'.
        self.sliding_window = (config.sliding_window
                               if not kinds or self.layer_type == "sliding_attention" else None)
        heads, kv_heads, bias = (config.num_attention_heads, config.num_key_value_heads,
                                 config.qkv_bias)
        hidden, dim = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(hidden, heads * dim, bias=bias, device=device)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=bias, device=device)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=bias, device=device)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=config.o_bias, device=device)
        # Qwen 3, Gemma 3: RMSNorm over each head's D before RoPE (one weight for all heads).
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if config.qk_norm:
            self.q_norm = make_norm(config, dim, device)
            self.k_norm = make_norm(config, dim, device)
        self.attend: AttentionFn = causal_attention
        # q, k and v from one call where the quantised layers allow it (set after loading:
        # quant/fused_linear.stack_eager); None: each projection's own call.
        self.qkv: Callable[[torch.Tensor], list[torch.Tensor]] | None = None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: Any, cache: Any) -> torch.Tensor:
        shape = hidden.shape[:-1]
        split = (*shape, -1, self.head_dim)
        if self.qkv is not None:
            q, k, v = self.qkv(hidden)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        q, k = q.view(split), k.view(split)  # [B, T, heads, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, T, D]
        v = v.view(split).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, _ = self.attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                             sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(*shape, -1).contiguous())


class MLP(nn.Module):
    def __init__(self, config: DecoderShape, device: Device = None) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, device=device)
        self.act_fn: nn.Module = (nn.GELU(approximate="tanh")
                                  if config.hidden_act == "gelu_pytorch_tanh" else nn.SiLU())
        # gate and up from one call where the quantised layers allow it (as `Attention.qkv`)
        self.gate_up: Callable[[torch.Tensor], list[torch.Tensor]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderShape, layer_idx: int, device: Device = None) -> None:
        super().__init__()
        size = config.hidden_size
        self.self_attn = Attention(config, layer_idx, device)
        self.mlp = MLP(config, device)
        self.input_layernorm = make_norm(config, size, device)
        self.post_attention_layernorm = make_norm(config, size, device)
        self.sandwich = config.sandwich_norms
        if self.sandwich:  # Gemma 3: post_attention_layernorm then norms the attention's out
            self.pre_feedforward_layernorm = make_norm(config, size, device)
            self.post_feedforward_layernorm = make_norm(config, size, device)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: Any, cache: Any) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, attention_mask, cache)
        if self.sandwich:
            hidden = hidden + self.post_attention_layernorm(attended)
            mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
            return hidden + self.post_feedforward_layernorm(mlp)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaBody(nn.Module):
    """transformers' `LlamaModel`: embedding, decoder layers, final norm."""

    def __init__(self, config: DecoderShape, device: Device = None) -> None:
        super().__init__()
        rows, size = config.vocab_size, config.hidden_size
        self.embed_tokens = (nn.Embedding(rows, size, device=device)
                             if config.embed_scale is None
                             else ScaledEmbedding(rows, size, config.embed_scale, device))
        self.layers = nn.ModuleList(DecoderLayer(config, i, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.hidden_size, device)
        self.rotary_emb = RotaryEmbedding(config, device)


@dataclass
class CausalOutput:
    # [B, kept positions, vocab]; with `project=False`, the final (normed) hidden states
    # of those positions instead, [B, kept, hidden] (the engine's masked projection
    # projects them itself: engine/logits/masked_projection.py).
    logits: torch.Tensor


class LlamaCausalLM(nn.Module):
    """The model: `model` (the body) and `lm_head`, as transformers names them."""

    def __init__(self, config: DecoderShape, device: Device = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                 device=device)
        self.generation_config: Any = None  # the loader sets generation_config.json's fields
        self.name_or_path = ""

    def set_attention(self, attend: AttentionFn) -> None:
        """Every layer's attention through `attend(module, q, k, v, mask, scaling=...)`."""
        for layer in self.model.layers:
            layer.self_attn.attend = attend  # type: ignore[union-attr]

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: Any = None, cache: Any = None, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor = 0, project: bool = True,
                **kwargs: Any) -> CausalOutput:
        """input_ids: [B, T]; position_ids default 0..T-1. `cache` (the engine's row cache)
        takes each layer's keys and values; without it attention is causal over the
        input alone. `logits_to_keep`: the last n positions (0: all), or their indices.
        `project` False: the kept positions' final hidden states, not their logits."""
        body = self.model
        hidden = body.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=hidden.device)[None]
        kinds = self.config.layer_types if self.config.rope_thetas else None
        if kinds is None:
            cos, sin = body.rotary_emb(hidden, position_ids)
            tables = {"full_attention": (cos, sin), "sliding_attention": (cos, sin)}
        else:  # a table per layer kind
            tables = {kind: body.rotary_emb(hidden, position_ids, kind) for kind in set(kinds)}
        for layer in body.layers:
            kind = str(layer.self_attn.layer_type)  # type: ignore[union-attr]
            # The engine hands Gemma-style models a mask per layer kind.
            mask = attention_mask[kind] if isinstance(attention_mask, dict) else attention_mask
            hidden = layer(hidden, *tables[kind], mask, cache)
        hidden = body.norm(hidden)
        keep = (slice(-logits_to_keep, None) if isinstance(logits_to_keep, int)
                else logits_to_keep)
        kept = hidden[:, keep, :]
        return CausalOutput(logits=self.lm_head(kept) if project else kept)


def build_on_meta(config: DecoderShape) -> LlamaCausalLM:
    """The model with every tensor on the meta device, for a loader to assign (the
    rotary table too, which checkpoints do not hold: `RotaryEmbedding(config, device)`
    computes it). Tensors are made with `device=` rather than under a `torch.device`
    mode, whose meta factories run Python reference kernels (importing torch._dynamo)."""
    with _no_random_init():
        return LlamaCausalLM(config, "meta")


@contextmanager
def _no_random_init() -> Iterator[None]:
    """nn.Linear and nn.Embedding built without their random initialisation: on meta
    tensors it runs torch's Python reference kernels, whose first use imports
    torch._dynamo (~0.8 s), and every tensor is assigned from the file anyway."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = _skip  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def _skip(self: nn.Module) -> None:
    return None
