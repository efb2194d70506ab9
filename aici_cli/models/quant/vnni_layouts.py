"""A quantised model's layers on the project's int kernels (`int_mm`): their layouts made
once and kept, q/k/v and gate/up back to back.

Where the kernels run (`int_mm.wanted`: bf16 or float32 activations on a CPU that runs a
variant and whose probe passed them), `build` makes every layer whose matrix tiles (rows
a multiple of 16, inputs of 32) straight in the kernels' layout, from the GGUF's codes,
and the conversion-cache entry keeps that layout alone (`packed_layers.vnni_file`): no
copy in PyTorch's int4 layout is made, kept or read (after a default run the default
model's entry holds ~1.2x its GGUF, against ~2.2x with both). Such a layer runs every
pass on the int kernels, and a pass of many rows on a dense copy widened from the tiles
(`dense_copies`). Making the layouts costs ~0.3 s for the default model (~4 s for a
1.1B Llama), reading them tens of ms.

Elsewhere (`attach`), and for a layer that does not tile, the layers `quantize_model`
built keep PyTorch's kernels, and those that tile gain the layout besides, for their
bf16 passes.

The compiled one-token step stacks each decoder layer's q/k/v and gate/up into one layer
(`fused_linear`). Their layouts are made, and kept, as one matrix per group, each part a
view of its rows: stacking them then copies nothing (474 ms of a 1.1B Llama's first
compiled step before).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from aici_cli.models.cache.packed_layers import (
    read_packed,
    unpack_int4_cpu,
    vnni_file,
    write_packed,
)
from aici_cli.models.gguf.matrices import GgufMatrices
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels.huge_pages import OnHugePages
from aici_cli.models.kernels.int_mm import Tiled4
from aici_cli.models.quant import model_layers
from aici_cli.models.quant.model_layers import Planned
from aici_cli.models.quant.quantize import Int4Linear, Int8Linear, set_module

# The layers the compiled step stacks (decode_layer.DecodeLayer), by their owner's name.
STACKED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))

Scales = dict[str, tuple[torch.Tensor, torch.Tensor]]  # int4 layer name -> its d, m


def build(model: Any, mode: str, path: Path, dtype: torch.dtype, device: torch.device,
          source: GgufMatrices | None) -> int:
    """Where the int kernels run here, replace every linear layer of `model` that `mode`
    quantises (`model_layers.plan`) and whose matrix tiles with one that runs on them alone,
    its layout read from the kept file or made now from `source` (or its dense weight)
    and kept. Returns the number of layers replaced; the others stay for
    `quantize_model`."""
    if mode == "none" or not int_mm.wanted(path, dtype, device):
        return 0
    todo = {p.name: p for p in model_layers.plan(model, mode, source) if _tiles(p.module)}
    if not todo:
        return 0
    file = vnni_file(path)
    stored = read_packed(file, device) if file is not None else {}
    # every step streams them: on 2 MiB pages (huge_pages)
    kept = OnHugePages(file, stored) if file is not None else stored
    made: dict[str, torch.Tensor] = {}
    done = 0
    for key, names in _planned_groups(model, todo):
        parts = [todo[n] for n in names]
        n, k = sum(p.module.out_features for p in parts), parts[0].module.in_features
        whole = _kept_int4(kept, key, n, k) or _tiled_int4(parts, key, device, made)
        if whole is None:
            continue  # parts that do not stack: each alone, below
        start = 0
        for p in parts:
            rows = int_mm.int4_rows(whole, start, p.module.out_features)
            set_module(model, p.name, Int4Linear.vnni_only(rows, dtype, p.bias(device)))
            start += p.module.out_features
            del todo[p.name]
        done += len(parts)
    for name, p in todo.items():
        n, k = p.module.out_features, p.module.in_features
        new: torch.nn.Module
        if p.kind == "int4":
            tiled = _kept_int4(kept, name, n, k) or _tiled_int4([p], name, device, made)
            assert tiled is not None  # one matrix that tiles
            new = Int4Linear.vnni_only(tiled, dtype, p.bias(device))
        else:
            codes, scale = kept.get(f"{name}.vnni8_codes"), kept.get(f"{name}.vnni8_scale")
            if codes is None or scale is None or codes.numel() != n * k \
                    or scale.shape != (n,) or scale.dtype != torch.float32:
                plain = model_layers.int8_parts(p, device)
                codes, scale = int_mm.tile_int8(plain["codes"]), plain["scale"]
                assert codes is not None
                made |= {f"{name}.vnni8_codes": codes, f"{name}.vnni8_scale": scale}
            new = Int8Linear.vnni_only(codes, scale, p.bias(device), dtype, k)
        set_module(model, name, new)
        done += 1
    if file is not None and made:
        write_packed(file, {**stored, **made})
    return done


def _tiles(module: torch.nn.Linear) -> bool:
    n, k = module.out_features, module.in_features
    return n > 0 and n % int_mm.TILE == 0 and k % int_mm.GROUP == 0


def _planned_groups(model: Any, todo: dict[str, Planned]) -> Iterator[tuple[str, list[str]]]:
    """(key, the parts' names) of every stack the compiled step makes whose parts are all
    int4 in `todo`, with one input width."""
    for name, module in model.named_modules():
        for owner, names in STACKED:
            if getattr(module, owner, None) is None:
                continue
            prefix = f"{name}.{owner}" if name else owner
            full = [f"{prefix}.{n}" for n in names]
            parts = [todo.get(n) for n in full]
            if all(p is not None and p.kind == "int4" for p in parts) \
                    and len({p.module.in_features for p in parts if p is not None}) == 1:
                yield f"{prefix}.{'+'.join(names)}", full


def _tiled_int4(parts: list[Planned], key: str, device: torch.device,
                made: dict[str, torch.Tensor]) -> Tiled4 | None:
    """`parts`' matrices in the layout, stacked, from their codes (recorded in `made`
    under `key`); None where they do not stack (some with zeros, some without)."""
    tiled = []
    for p in parts:
        one = int_mm.tile_int4(*model_layers.int4_codes(p, device))
        assert one is not None  # `_tiles`
        tiled.append(one)
    whole = int_mm.stack_int4(tiled) if len(tiled) > 1 else tiled[0]
    if whole is not None:
        made.update({f"{key}.vnni4_codes": whole.codes, f"{key}.vnni4_d": whole.d,
                     f"{key}.vnni4_m": whole.m})
    return whole


def attach(model: Any, path: Path, dtype: torch.dtype, device: torch.device,
           scales: Scales) -> int:
    """Put `model`'s quantised layers on the VNNI kernels where they run here, from the
    kept file or made now (`scales`: each int4 layer's d and m, weight = q d + m, as
    `quantize_model` built it). Returns the number of layers put on them."""
    left = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear)) and not m.vnni]
    if not left or not int_mm.wanted(path, dtype, device):
        return 0
    file = vnni_file(path)
    stored = read_packed(file, device) if file is not None else {}
    # every step streams them: on 2 MiB pages (huge_pages)
    kept = OnHugePages(file, stored) if file is not None else stored
    made: dict[str, torch.Tensor] = {}
    done = 0
    grouped: set[str] = set()
    for key, names, parts in _groups(model):
        n, k = sum(p.out_features for p in parts), parts[0].in_features
        whole = _kept_int4(kept, key, n, k) or _made_int4(parts, names, scales, made, key)
        if whole is None:
            continue
        start = 0
        for name, part in zip(names, parts):
            part.use_vnni(int_mm.int4_rows(whole, start, part.out_features))
            start += part.out_features
            grouped.add(name)
        done += len(parts)
    for name, module in model.named_modules():
        if getattr(module, "vnni", False):
            continue  # `build`'s
        if isinstance(module, Int4Linear) and name not in grouped:
            tiled = _kept_int4(kept, name, module.out_features, module.in_features) or \
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
        write_packed(file, {**stored, **made})
    return done


def _groups(model: Any) -> Iterator[tuple[str, list[str], list[Int4Linear]]]:
    """(key, the parts' names, the parts) of every stack the compiled step makes of int4
    layers with one input width."""
    for name, module in model.named_modules():
        for owner, names in STACKED:
            parent = getattr(module, owner, None)
            parts = [getattr(parent, n, None) for n in names]
            found = [p for p in parts if isinstance(p, Int4Linear) and not p.vnni]
            if parent is None or len(found) != len(names) \
                    or len({p.in_features for p in found}) != 1:
                continue
            prefix = f"{name}.{owner}" if name else owner
            yield f"{prefix}.{'+'.join(names)}", [f"{prefix}.{n}" for n in names], found


def _kept_int4(kept: Mapping[str, torch.Tensor], key: str, n: int, k: int) -> Tiled4 | None:
    """The kept layout under `key` (a layer's name, or a stack's), where it fits an [n, k]
    matrix."""
    codes, d, m = (kept.get(f"{key}.vnni4_{t}") for t in ("codes", "d", "m"))
    if codes is None or d is None or m is None:
        return None
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
