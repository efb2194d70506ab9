"""A quantised model's layers on the VNNI kernels (`int_mm`): their layouts made once
and kept, q/k/v and gate/up back to back.

Where the kernels run (`int_mm.wanted`: bf16 on an AVX512-VNNI CPU whose probe
passed them), every int4 layer gets the int4 kernel's layout of its matrix and every int8
layer (the output projection) the int8 one's, as buffers its bf16 passes read. Making
them costs ~3.8 s for a 1.1B Llama (0.2 s for the default model), so a conversion-cache
entry keeps them in one file beside the other kernels' (`packed_layers.vnni_file`): a
later run reads them instead (as the packed int4 layers are kept).

The compiled one-token step stacks each decoder layer's q/k/v and gate/up into one layer
(`fused_linear`). Their layouts are made, and kept, as one matrix per group, each part a
view of its rows: stacking them then copies nothing (474 ms of a 1.1B Llama's first
compiled step before).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from aici_cli.models.cache.packed_layers import (
    read_packed,
    unpack_int4_cpu,
    vnni_file,
    write_packed,
)
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels.int_mm import Tiled4
from aici_cli.models.quant.quantize import Int4Linear, Int8Linear

# The layers the compiled step stacks (decode_layer.DecodeLayer), by their owner's name.
STACKED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))

Scales = dict[str, tuple[torch.Tensor, torch.Tensor]]  # int4 layer name -> its d, m


def attach(model: Any, path: Path, dtype: torch.dtype, device: torch.device,
           scales: Scales) -> int:
    """Put `model`'s quantised layers on the VNNI kernels where they run here, from the
    kept file or made now (`scales`: each int4 layer's d and m, weight = q d + m, as
    `quantize_model` built it). Returns the number of layers put on them."""
    if not int_mm.wanted(path, dtype, device):
        return 0
    file = vnni_file(path)
    kept = read_packed(file, device) if file is not None else {}
    made: dict[str, torch.Tensor] = {}
    done = 0
    grouped: set[str] = set()
    for key, names, parts in _groups(model):
        whole = _kept_int4(kept, key, parts) or _made_int4(parts, names, scales, made, key)
        if whole is None:
            continue
        start = 0
        for name, part in zip(names, parts):
            part.use_vnni(int_mm.int4_rows(whole, start, part.out_features))
            start += part.out_features
            grouped.add(name)
        done += len(parts)
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear) and name not in grouped:
            tiled = _kept_int4(kept, name, [module]) or \
                _made_int4([module], [name], scales, made, name)
            if tiled is not None:
                module.use_vnni(tiled)
                done += 1
        elif isinstance(module, Int8Linear):
            # "vnni8": another key than an int4 layer's of the same name (`--quantize
            # int8` and int4 runs share the file)
            codes = kept.get(f"{name}.vnni8_codes")
            if codes is None or codes.numel() != module.codes.numel():
                codes = int_mm.tile_int8(module.codes)
                if codes is not None:
                    made[f"{name}.vnni8_codes"] = codes
            if codes is not None:
                module.use_vnni(codes)
                done += 1
    if file is not None and made:
        write_packed(file, {**kept, **made})
    return done


def _groups(model: Any) -> Iterator[tuple[str, list[str], list[Int4Linear]]]:
    """(key, the parts' names, the parts) of every stack the compiled step makes of int4
    layers with one input width."""
    for name, module in model.named_modules():
        for owner, names in STACKED:
            parent = getattr(module, owner, None)
            parts = [getattr(parent, n, None) for n in names]
            found = [p for p in parts if isinstance(p, Int4Linear)]
            if parent is None or len(found) != len(names) \
                    or len({p.in_features for p in found}) != 1:
                continue
            prefix = f"{name}.{owner}" if name else owner
            yield f"{prefix}.{'+'.join(names)}", [f"{prefix}.{n}" for n in names], found


def _kept_int4(kept: dict[str, torch.Tensor], key: str,
               parts: list[Int4Linear]) -> Tiled4 | None:
    """The kept layout of `parts` stacked (under `key`), where it fits their shapes."""
    codes, d, m = (kept.get(f"{key}.vnni4_{t}") for t in ("codes", "d", "m"))
    if codes is None or d is None or m is None:
        return None
    n, k = sum(p.out_features for p in parts), parts[0].in_features
    groups = k // int_mm.GROUP
    shape = (n // int_mm.TILE, groups, int_mm.TILE)
    fits = codes.dtype == torch.uint8 and codes.numel() * 2 == n * k \
        and d.shape == shape and d.dtype == torch.float16 \
        and m.dtype == torch.float16 and (m.numel() == 0 or m.shape == shape)
    return Tiled4(codes, d, m, n, k) if fits else None


def _made_int4(parts: list[Int4Linear], names: list[str], scales: Scales,
               made: dict[str, torch.Tensor], key: str) -> Tiled4 | None:
    """`parts` stacked in the layout, from their packed codes and scales (recorded in
    `made` under `key`); None where one does not tile or unpack here."""
    tiled = []
    for name, part in zip(names, parts):
        codes = unpack_int4_cpu(part.packed, part.out_features, part.in_features)
        if codes is None or name not in scales:
            return None
        one = int_mm.tile_int4(codes, *scales[name])
        if one is None:
            return None
        tiled.append(one)
    whole = int_mm.stack_int4(tiled) if len(tiled) > 1 else tiled[0]
    if whole is not None:
        made.update({f"{key}.vnni4_codes": whole.codes, f"{key}.vnni4_d": whole.d,
                     f"{key}.vnni4_m": whole.m})
    return whole


def int4_layer(layer: Int4Linear, d: torch.Tensor, m: torch.Tensor) -> bool:
    """Put one int4 layer on the kernel (its scales d, m); False where it does not tile
    or unpack here."""
    tiled = _made_int4([layer], ["layer"], {"layer": (d, m)}, {}, "layer")
    if tiled is not None:
        layer.use_vnni(tiled)
    return tiled is not None


def int8_layer(layer: Int8Linear) -> bool:
    """Put one int8 layer on the kernel; False where it does not tile."""
    codes = int_mm.tile_int8(layer.codes)
    if codes is not None:
        layer.use_vnni(codes)
    return codes is not None
