"""One Llama-family decoder layer (Llama, Mistral, Qwen 2, Qwen 3, and Gemma 3 as
models/families/llama.py builds it) for B rows of one token each, as the compiled step runs it,
and the compiled graphs of a model's layers (kept per model, for every engine on it).

Per layer and step: norm, q/k/v as one stacked matrix (models/quant/fused_linear.py),
HF's own RoPE, the new key and value written into the row cache, attention over the slots
the mask covers (the whole capacity, or the step's span: compiled.py) with a mask by
position (in float32 with the int kernels' library, its operator over each row's own
slots, as the eager passes attend), o, norm, gate/up as one stacked matrix, down, both
residuals: 4 weight reads, not 7. Qwen 3's and Gemma 3's q/k norms run between the
split and RoPE. Gemma 3 (`sandwich` norms) norms the attention's output and the MLP's
output before each residual add, and its MLP's input with a norm of its own; its sliding
layers take the step's sliding tables (their own RoPE base, a mask that also hides the
slots before the window), its full layers the step's plain ones.

On CPU all layers are one graph: one call a step instead of 30, and inductor fuses each
layer's residual add into the next layer's norm. Measured on the 2-core Xeon (default
model, int4, batch 1, interleaved): 15.0 ms a step against 18.5 ms with a graph per layer;
it compiles in ~48 s cold and ~5.5 s from inductor's disk cache (a graph per layer: ~30 s
and ~3.5 s). On CUDA each layer is called through a graph per layer *signature*
(submodule types, tensor shapes and dtypes, head counts: all layers of a Llama model share
one), replayed as CUDA graphs.

Every graph has a code object of its own (per model, and per signature), so dynamo's
guards on the layers' modules can be dropped on CPU (they cost ~45 us a layer a call): a
graph can only ever see the layers it was made for, and a model's modules do not change
once it is loaded.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from aici_cli.models.kernels.native_norm import native_norm
from aici_cli.models.kernels.rows_attention import rows_attention as rows_attention_op
from aici_cli.models.quant.fused_linear import stack_linears


def slides(layer: Any) -> bool:
    """Whether decoder layer `layer` is one of its model's sliding layers where layer kinds
    differ (Gemma 3's `layer_types`); a window on every layer (Mistral v0.1) is the step's
    plain mask, not a kind."""
    return getattr(layer.self_attn, "layer_type", None) == "sliding_attention"


class DecodeLayer(torch.nn.Module):
    """A Llama decoder layer's parts as `layer_step` calls them, over the same weights the
    model's own modules read (the stacked matrices are their storage)."""

    def __init__(self, layer: Any, config: Any) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        # Each norm one opaque call where the int kernels' library is loaded, computing
        # what the module does op for op (native_norm.py): the eager passes' bits.
        self.input_norm = native_norm(layer.input_layernorm)
        self.post_norm = native_norm(layer.post_attention_layernorm)
        self.qkv = stack_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        # Qwen 3's per-head RMSNorm of q and k before RoPE (None: the layer has none).
        self.q_norm = native_norm(getattr(attn, "q_norm", None))
        self.k_norm = native_norm(getattr(attn, "k_norm", None))
        self.o_proj = attn.o_proj
        # Gemma 3's norms before and after the MLP (None: a Llama layer, whose
        # `post_norm` is the MLP's input norm; with them it norms the attention's output).
        sandwich = bool(getattr(layer, "sandwich", False))
        self.pre_mlp_norm = native_norm(layer.pre_feedforward_layernorm) if sandwich else None
        self.post_mlp_norm = native_norm(layer.post_feedforward_layernorm) if sandwich else None
        # Whether the layer attends under the step's sliding tables (`all_layers_step`).
        self.sliding = slides(layer)
        # Plain causal attention from slot 0, no window: the one-token rows' operator may
        # attend for it (`layer_step`), as it does in eager passes.
        self.causal = not self.sliding and getattr(attn, "sliding_window", None) is None
        self.gate_up = stack_linears([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn
        self.intermediate = int(mlp.down_proj.in_features)
        self.head_dim = int(attn.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.scaling = float(attn.scaling)
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb

    def signature(self) -> tuple[Any, ...]:
        """What a graph of this layer depends on; layers of equal signature share one."""
        tensors = [*self.named_parameters(), *self.named_buffers()]
        return (tuple((name, type(m)) for name, m in self.named_modules()),
                tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in tensors),
                self.intermediate, self.head_dim, self.heads, self.kv_heads, self.scaling,
                self.rope, type(self.act_fn))


def layer_step(layer: DecodeLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_buf: torch.Tensor, v_buf: torch.Tensor, pos: torch.Tensor,
               valid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One decoder layer for B rows of one token each. h: [B, hidden]; cos/sin: [B, 1, D];
    k_buf/v_buf: the layer's cache [rows, kv_heads, C, D] (written in place at (row b,
    slot pos[b]) for valid rows); mask: [B, 1, 1, S] bool over the first S <= C slots,
    the ones attended (every pos[b] < S). Returns the new h."""
    rows, heads, kv_heads, dim = h.shape[0], layer.heads, layer.kv_heads, layer.head_dim
    qkv = layer.qkv(layer.input_norm(h))  # [B, (heads + 2 kv_heads) D]
    q = qkv[:, : heads * dim].view(rows, heads, 1, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, 1, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, 1, dim)
    if layer.q_norm is not None and layer.k_norm is not None:  # over D: the head axis
        q, k = layer.q_norm(q), layer.k_norm(k)  # is as good as transformers' [B, 1, H, D]
    q, k = layer.rope(q, k, cos, sin)  # HF's own RoPE: [B, heads, 1, D]
    at = torch.arange(rows, device=h.device)
    slot = torch.where(valid, pos, torch.zeros_like(pos))
    keep = valid[:, None, None]
    k_buf[at, :, slot] = torch.where(keep, k[:, :, 0], k_buf[at, :, slot])
    v_buf[at, :, slot] = torch.where(keep, v[:, :, 0], v_buf[at, :, slot])
    # Query heads stacked per key/value head, as rows_attention's one-token group.
    qg = q[:, :, 0].reshape(rows, kv_heads, heads // kv_heads, dim)
    span = mask.shape[-1]
    k_span, v_span = k_buf[:rows].narrow(2, 0, span), v_buf[:rows].narrow(2, 0, span)
    # The eager passes' operator where they call it (float32, plain causal attention), so
    # a row's token has the same bits compiled or eager, whatever its neighbours
    # (attention.py); an idle row attends to nothing (length 0), its output unused.
    o = (rows_attention_op(qg, k_span, v_span, torch.where(valid, pos + 1, 0), layer.scaling)
         if layer.causal else None)
    if o is None:
        o = F.scaled_dot_product_attention(qg, k_span, v_span, attn_mask=mask,
                                           scale=layer.scaling)
    attended = layer.o_proj(o.reshape(rows, heads * dim))
    if layer.pre_mlp_norm is not None and layer.post_mlp_norm is not None:  # Gemma 3
        h = h + layer.post_norm(attended)
        gate_up = layer.gate_up(layer.pre_mlp_norm(h))  # [B, 2 I]
        mid = layer.act_fn(gate_up[:, : layer.intermediate]) * gate_up[:, layer.intermediate :]
        return h + layer.post_mlp_norm(layer.down_proj(mid))
    h = h + attended
    gate_up = layer.gate_up(layer.post_norm(h))  # [B, 2 I]
    mid = layer.act_fn(gate_up[:, : layer.intermediate]) * gate_up[:, layer.intermediate :]
    return h + layer.down_proj(mid)


# A step's RoPE tables and mask for one layer kind: cos [B, 1, D], sin [B, 1, D],
# mask [B, 1, 1, C] bool.
Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def layer_tables(layer: DecodeLayer, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 sliding: Tables | None) -> Tables:
    """The tables `layer` attends with: the sliding ones for a sliding layer, else the
    plain ones (a Python choice per layer: the graph holds no branch)."""
    if layer.sliding:
        assert sliding is not None, "a model with sliding layers needs the sliding tables"
        return sliding
    return cos, sin, mask


def all_layers_step(layers: list[DecodeLayer], h: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    pos: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor,
                    sliding: Tables | None = None) -> torch.Tensor:
    """`layer_step` through every layer in turn; `keys`/`values`: each layer's cache;
    `sliding`: the sliding layers' tables where the model has such layers (Gemma 3;
    None: every layer takes `cos`, `sin`, `mask`)."""
    for layer, k_buf, v_buf in zip(layers, keys, values):
        c, s, m = layer_tables(layer, cos, sin, mask, sliding)
        h = layer_step(layer, h, c, s, k_buf, v_buf, pos, valid, m)
    return h


StepFn = Callable[..., torch.Tensor]

# Inductor rounds a fused chain of 16-bit elementwise ops (RoPE, the MLP's act(gate) * up,
# the residual adds) once, where eager rounds after each op: a bf16 step's tokens would
# part from the eager passes' by a bit at one row. With the casts emulated each op rounds
# as eager does (float32 graphs are unchanged: there is no cast to emulate).
EAGER_ROUNDING: dict[str, bool] = {"emulate_precision_casts": True}

# Dynamo's guards on the layers' modules are dropped (module docstring); size asserts cost
# about as much as the guards.
_CPU_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    "size_asserts": False, **EAGER_ROUNDING}


class LayerGraphs:
    """A model's decode layers and their compiled graph(s), made on first use (compiling
    imports the compiler stack)."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.device = device
        self.layers = [DecodeLayer(layer, model.config) for layer in model.model.layers]
        groups: dict[tuple[Any, ...], int] = {}
        self.group = [groups.setdefault(layer.signature(), len(groups))
                      for layer in self.layers]
        self._compiled: dict[int, StepFn] = {}  # CUDA: per signature
        self._whole: StepFn | None = None  # CPU: all layers
        # CPU: the packaged step per row count and whether the cache has one row (export
        # specializes a size of 1: packaged_step.py), used before `_whole`.
        self.packaged: dict[tuple[int, bool], StepFn] = {}

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor], pos: torch.Tensor,
                valid: torch.Tensor, mask: torch.Tensor,
                sliding: Tables | None = None) -> torch.Tensor:
        """Every layer for B rows of one token each (shapes as in `layer_step`; `sliding`
        as in `all_layers_step`)."""
        if self.device.type != "cuda":
            packaged = self.packaged.get((h.shape[0], keys[0].shape[0] == 1))
            if packaged is not None:
                return packaged(self.layers, h, cos, sin, keys, values, pos, valid, mask,
                                sliding)
            if self._whole is None:
                self._whole = torch.compile(_own_code(all_layers_step, f"{id(self):x}"),
                                            fullgraph=True, options=_CPU_OPTIONS)
                # The cache capacity (it doubles as lines grow) is symbolic from the
                # first compile: a growth replaces the buffers without a recompile.
                for buf in (*keys, *values):
                    torch._dynamo.mark_dynamic(buf, 2)
                for m in (mask, *(sliding[2:] if sliding is not None else ())):
                    torch._dynamo.mark_dynamic(m, 3)
            return self._whole(self.layers, h, cos, sin, keys, values, pos, valid, mask,
                               sliding)
        # CUDA: a layer's kind picks its inputs, not its graph (both kinds share one).
        for layer, group, k_buf, v_buf in zip(self.layers, self.group, keys, values):
            c, s, m = layer_tables(layer, cos, sin, mask, sliding)
            h = self._graph(group)(layer, h, c, s, k_buf, v_buf, pos, valid, m)
        return h

    def _graph(self, group: int) -> StepFn:
        fn = self._compiled.get(group)
        if fn is None:
            step = _own_code(layer_step, f"{id(self):x}_{group}")
            fn = torch.compile(step, mode="reduce-overhead", fullgraph=True)
            self._compiled[group] = fn
        return fn


def _own_code(fn: Any, tag: str) -> Any:
    """A copy of function `fn` with a code object of its own: dynamo keeps compiled graphs
    per code object, so no other signature's layers ever reach this copy's graphs."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


_BY_MODEL: weakref.WeakKeyDictionary[Any, LayerGraphs] = weakref.WeakKeyDictionary()


def layer_graphs(model: Any, device: torch.device) -> LayerGraphs:
    """The model's decode layers and graphs, made once per model: every engine on the
    model reuses its graphs (a second engine recompiles nothing)."""
    graphs = _BY_MODEL.get(model)
    if graphs is None:
        graphs = _BY_MODEL[model] = LayerGraphs(model, device)
    return graphs
