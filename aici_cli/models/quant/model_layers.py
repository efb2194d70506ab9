"""A model's linear layers replaced by quantised ones (`quantize_model`): which kind each
becomes (`plan`), where its codes come from (the GGUF's blocks, else its dense weight),
and the layers kept in their kernels' layout in a conversion-cache entry
(`packed_layers`), so that a later run reads them instead of building them again.

Where the project's int kernels run, `vnni_layouts.build` takes the layers that tile
first (kept in their layout alone); `quantize_model` builds the rest on PyTorch's
kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aici_cli.models.cache.packed_layers import KEPT, packed_file, read_packed, write_packed
from aici_cli.models.gguf.matrices import GgufMatrices
from aici_cli.models.quant.quantize import (
    GROUP,
    Int4Linear,
    Int8Linear,
    module_name,
    pack_int4,
    quantize_int4,
    quantize_int8,
    set_module,
)


@dataclass(frozen=True)
class Planned:
    """One linear layer of a model to quantise: its kind (`int4`, `int8`) and where its
    matrix comes from."""

    name: str  # the module's dotted name
    module: torch.nn.Linear
    kind: str
    weight_name: str  # its matrix's (a tied output projection's is the embedding's)
    source: GgufMatrices | None  # the GGUF that holds it, else the module's dense weight

    def bias(self, device: torch.device) -> torch.Tensor | None:
        b = self.module.bias
        return b.detach().to(device) if b is not None else None


def plan(model: Any, mode: str, source: GgufMatrices | None) -> list[Planned]:
    """`model`'s linear layers (those not quantised yet) as `mode` quantises them: the
    decoder layers' in `mode`, the output projection, a GGUF's more-bits matrices and a
    width that is not whole groups in int8."""
    output = model.get_output_embeddings()
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    embed_name = module_name(model, model.get_input_embeddings())
    planned = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        weight_name = f"{name}.weight"
        if module is output and tied and embed_name is not None:
            weight_name = f"{embed_name}.weight"  # the tied projection's matrix is there
        from_gguf = source if source is not None and weight_name in source else None
        kind = "int8" if module is output or module.in_features % GROUP or (
            from_gguf is not None and from_gguf.int8_only(weight_name)) else mode
        planned.append(Planned(name, module, kind, weight_name, from_gguf))
    return planned


def quantize_model(model: Any, mode: str, path: Path, dtype: torch.dtype,
                   device: torch.device | None = None,
                   source: GgufMatrices | None = None,
                   scales: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
    """Replace the linear layers of `model` in place (those still `torch.nn.Linear`: the
    int kernels' layers, `vnni_layouts.build`, come first where they run), onto `device`
    (default: where each one is), as `plan` says. A matrix `source` holds (a
    conversion's GGUF) is built from there; the others are quantised from their dense
    weights. A conversion-cache entry keeps the layers in their kernels' layout
    (`packed_layers`): a later run reads them instead. `scales`, where given, gets each
    int4 layer's d and m (weight = q d + m: `vnni_layouts`). Returns the number of layers
    replaced."""
    if mode == "none":
        return 0
    planned = plan(model, mode, source)
    if not planned:
        return 0
    keep = packed_file(path, mode, device) if device is not None else None
    kept = read_packed(keep, device) if keep is not None and device is not None else {}
    to_keep: dict[str, torch.Tensor] = {}
    computed = 0
    for p in planned:
        at = device if device is not None else p.module.weight.device
        parts = _kept_parts(kept, p.name, p.kind, p.module)
        if parts is None:
            computed += 1
            parts = _int4_parts(p, at) if p.kind == "int4" else int8_parts(p, at)
        to_keep |= {f"{p.name}.{k}": v for k, v in parts.items()}
        bias = p.bias(at)
        new: torch.nn.Module = (
            Int4Linear.from_parts(parts["packed"], parts["d"], parts["m"], bias, dtype)
            if p.kind == "int4" else Int8Linear(parts["codes"], parts["scale"], bias, dtype))
        if scales is not None and p.kind == "int4":
            scales[p.name] = (parts["d"], parts["m"])
        set_module(model, p.name, new)
    if keep is not None and computed:
        write_packed(keep, to_keep)
    return len(planned)


def _kept_parts(kept: dict[str, torch.Tensor], name: str, kind: str,
                module: torch.nn.Linear) -> dict[str, torch.Tensor] | None:
    """The layer `name`'s kept tensors (`packed_layers.KEPT`), or None where they are
    missing or do not fit its shape."""
    parts = {k: kept.get(f"{name}.{k}") for k in KEPT[kind]}
    if any(v is None for v in parts.values()):
        return None
    found: dict[str, torch.Tensor] = {k: v for k, v in parts.items() if v is not None}
    n, k = module.out_features, module.in_features
    floats = (torch.float16, torch.float32)
    if kind == "int4":
        packed, d, m = found["packed"], found["d"], found["m"]
        fits = packed.numel() * packed.element_size() * 2 == n * k \
            and d.shape == m.shape == (n, k // GROUP) and d.dtype in floats \
            and m.dtype in floats  # 4 bits a weight
    else:
        codes, scale = found["codes"], found["scale"]
        fits = codes.shape == (n, k) and codes.dtype == torch.int8 \
            and scale.shape == (n,) and scale.dtype == torch.float32
    return found if fits else None


def int4_codes(p: Planned, device: torch.device) -> tuple[torch.Tensor, ...]:
    """An int4 layer's codes [N, K] (0..15), d and m [N, K/32] (weight = q d + m): the
    GGUF's 4-bit codes and scales as they are (a Q5_K's: `kquant`), else the matrix's
    dense values (the GGUF's rounded to bfloat16, as a dense copy holds them) quantised
    here."""
    q4 = p.source.int4(p.weight_name) if p.source is not None else None
    if q4 is not None:
        return tuple(t.to(device) for t in q4)
    dense = p.source.dense(p.weight_name) if p.source is not None \
        else p.module.weight.detach()
    return quantize_int4(dense.to(device))


def _int4_parts(p: Planned, device: torch.device) -> dict[str, torch.Tensor]:
    """An int4 layer's kept tensors: `int4_codes`, packed for the int4 kernel."""
    codes, d, m = int4_codes(p, device)
    return {"packed": pack_int4(codes), "d": d, "m": m}


def int8_parts(p: Planned, device: torch.device) -> dict[str, torch.Tensor]:
    """An int8 layer's codes [N, K] int8 and scale [N] float32, one per output channel."""
    # The GGUF's 8-bit blocks have one scale per 32 inputs, the kernel one per channel:
    # requantised from the exact block values (their bf16 copy would round them first),
    # a slice of rows at a time so the float copy never exists whole (113 MB for the
    # default model's output projection).
    if p.source is not None:
        rows = p.source.row_source(p.weight_name)
    else:
        weight = p.module.weight.detach()

        def rows(lo: int, hi: int) -> torch.Tensor:
            return weight[lo:hi].float()

    n = p.module.out_features
    codes = torch.empty(n, p.module.in_features, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    for lo in range(0, n, _ROWS_AT_ONCE):
        hi = min(n, lo + _ROWS_AT_ONCE)
        codes[lo:hi], scale[lo:hi] = quantize_int8(rows(lo, hi).cpu())
    return {"codes": codes.to(device), "scale": scale.to(device)}


# Rows requantised at once: bounds the float copies to a few MB.
_ROWS_AT_ONCE = 2048
