"""Linear layers that read one input side by side (q/k/v, gate/up) as one matrix.

At one token a step, a small model's matmuls are short: the default model's k and v
projections are 192 x 576, and each call pays a kernel launch and a thread fork/join for
a few microseconds of work. Stacking the parts along their output dimension makes one
call of the summed width: a Llama layer's 7 weight reads become 4 (q/k/v, o, gate/up,
down). Measured on the 2-core Xeon at int4, one token: a step's linear layers 14.3 ->
11.5 ms (p50).

The stacked matrix is built once from the parts' own storage (int4 codes stay codes) and
the parts are then re-pointed at slices of it, so the weights are held once, not twice.

Eager (ragged) passes of a Llama-family model stack them too (`stack_eager`): where a
pass's rows run the int kernels, q/k/v (gate/up) are one call over the layouts the load
keeps back to back (`vnni_layouts`), its output split into the parts' (views, no copy):
the activations are quantised once, not three times, and the 192-wide k and v projections
of the default model no longer pay a call each. Measured on the 32 held-out schemas at
batch 8 forced to AVX2 (their prompts ride in eager passes), two pairs alternating: 15.8 /
16.4 s against 17.2 / 18.1 s. Passes whose prompt tokens run the dense copies
(`dense_copies`, `prompt_tokens`), and layers of any other kind, call the parts.

Every kernel here computes each output column from its own weight row, so the stacked
output is bit for bit the parts' outputs side by side. `stack_linears` checks that on a
probe input before it keeps a stacked layer (a kernel layout that blocks rows across a
part's edge would fail it); where it fails, or a part is of another kind, the parts are
called one after another (`SideBySide`). A 16-bit dense layer with a bias is never stacked:
its bias is added inside the GEMM (addmm), and on a CPU with native bf16 that epilogue
rounds by the output width (a 96-wide stack of three 32-wide parts differs in the last
bit for some inputs, which a probe input need not show).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aici_cli.models.kernels import int_mm
from aici_cli.models.quant.quantize import Int4Linear, Int8Linear


class StackedParts:
    """The outputs of int4 layers `parts` (one input width, no bias) for one input, from
    one int-kernel call over `whole`, their layouts back to back (`int_mm.stack_int4` over
    their own storage), where the pass runs the int kernels; else each part's own call.
    Bit for bit the parts' outputs either way (a tile's outputs are its own rows').

    Not a module: the parts stay the model's (one owner each, one entry in its state)."""

    def __init__(self, parts: Sequence[Int4Linear], whole: int_mm.Tiled4) -> None:
        self.parts = list(parts)
        self.whole = whole
        self.widths = [p.out_features for p in parts]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        flat = x.reshape(-1, self.whole.k)
        if not all(p.runs_int_kernel(flat.shape[0], flat.dtype) for p in self.parts):
            return [p(x) for p in self.parts]  # a part on its dense copy (`dense_copies`)
        y = int_mm.int4_mm(flat, self.whole)
        lead = x.shape[:-1]
        return [part.view(*lead, width)
                for part, width in zip(y.split(self.widths, dim=-1), self.widths)]


# Per owner of stacked parts (a Llama-family attention and MLP): its attribute for them,
# and the parts' names, in output order.
EAGER_STACKS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj")))


def stack_eager(model: torch.nn.Module) -> int:
    """Give each module of `model` that declares an `EAGER_STACKS` attribute (set to None:
    the Llama family's attention and MLP) its parts as `StackedParts`, where they are int4
    layers on the int kernels, bias-free, whose layouts lie back to back in one storage.
    Returns how many it stacked."""
    done = 0
    for module in model.modules():
        for attr, names in EAGER_STACKS:
            if not hasattr(module, attr) or getattr(module, attr) is not None:
                continue
            parts = [getattr(module, n, None) for n in names]
            int4 = [p for p in parts if isinstance(p, Int4Linear) and p.bias is None]
            tiles = [t for t in (p.tiled() for p in int4) if t is not None]
            if len(tiles) != len(names) or len({t.k for t in tiles}) != 1:
                continue
            whole = int_mm.stack_int4(tiles)
            if whole is None or whole.codes.data_ptr() != tiles[0].codes.data_ptr():
                continue  # not back to back: a stacked copy would hold the weights twice
            setattr(module, attr, StackedParts(int4, whole))
            done += 1
    return done


class SideBySide(torch.nn.Module):
    """The parts called in turn, their outputs concatenated: y [.., sum of N]."""

    def __init__(self, parts: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def stack_linears(parts: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """One module computing `cat([p(x) for p in parts], -1)`: a stacked matrix where the
    parts are all `nn.Linear`, all `Int4Linear` or all `Int8Linear` of one input width
    (the parts then read slices of it), else `SideBySide`. Idempotent per set of parts:
    stacking the same parts again re-stacks their (already sliced) storage."""
    kinds = {type(p) for p in parts}
    widths = {_in_features(p) for p in parts}
    if len(kinds) != 1 or len(widths) != 1 or None in widths:
        return SideBySide(parts)
    kind = kinds.pop()
    if kind is torch.nn.Linear and any(getattr(p, "bias", None) is not None for p in parts) \
            and any(p.weight.dtype != torch.float32 for p in parts):  # see the docstring
        return SideBySide(parts)
    stacked: torch.nn.Module
    with torch.no_grad():
        if kind is torch.nn.Linear:
            stacked = _stack_dense([p for p in parts if isinstance(p, torch.nn.Linear)])
        elif kind is Int4Linear:
            stacked = _stack_int4([p for p in parts if isinstance(p, Int4Linear)])
        elif kind is Int8Linear:
            stacked = _stack_int8([p for p in parts if isinstance(p, Int8Linear)])
        else:
            return SideBySide(parts)
        if not _same_outputs(stacked, parts):
            return SideBySide(parts)
        _share_storage(stacked, parts)
    return stacked


def _in_features(p: torch.nn.Module) -> int | None:
    value = getattr(p, "in_features", None)
    return int(value) if isinstance(value, int) else None


def _out_features(p: torch.nn.Module) -> int:
    value = p.out_features
    assert isinstance(value, int)
    return value


def _bias(parts: Sequence[torch.nn.Module], like: torch.Tensor) -> torch.Tensor | None:
    """The parts' biases stacked (zeros for a part without one); None if none has one."""
    biases = [getattr(p, "bias", None) for p in parts]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else
                      like.new_zeros(_out_features(p))
                      for b, p in zip(biases, parts)])


def _stack_dense(parts: Sequence[torch.nn.Linear]) -> torch.nn.Linear:
    weight = torch.cat([p.weight.detach() for p in parts])  # [sum N, K]
    has_bias = any(p.bias is not None for p in parts)
    out = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias,
                          device="meta", dtype=weight.dtype)
    out.weight = torch.nn.Parameter(weight, requires_grad=False)
    bias = _bias(parts, weight[0])
    if bias is not None:
        out.bias = torch.nn.Parameter(bias, requires_grad=False)
    return out


def _stack_int4(parts: Sequence[Int4Linear]) -> Int4Linear:
    bias = _bias(parts, parts[0].scale_zero)  # of the activation dtype (maybe empty)
    # Parts on the VNNI kernel (bf16 passes of few rows: every pass of the compiled step)
    # stack only its layout, over their own storage where the load left them back to
    # back (quantize._group_vnni): the int4 kernel's buffers would be a copy no pass of
    # the stack reads (~0.25 s of a 1.1B Llama's first compiled step).
    tiled = [t for t in (p.tiled() for p in parts) if t is not None]
    whole = int_mm.stack_int4(tiled) if len(tiled) == len(parts) else None
    if whole is not None:
        return Int4Linear.vnni_only(whole, parts[0].scale_zero.dtype, bias)
    # packed: [N, ...] rows first in both kernels' layouts; scale_zero: [K/32, N, 2].
    return Int4Linear.from_buffers(torch.cat([p.packed for p in parts]),
                                   torch.cat([p.scale_zero for p in parts], dim=1), bias)


def _stack_int8(parts: Sequence[Int8Linear]) -> Int8Linear:
    # Tiles are whole rows of 16: parts on the int kernel stack as their layouts, back to
    # back (plain codes may be absent: `Int8Linear.vnni_only`).
    if all(p.vnni for p in parts):
        return Int8Linear.vnni_only(torch.cat([p.vnni_codes for p in parts]),
                                    torch.cat([p.vnni_scale for p in parts]),
                                    _bias(parts, parts[0].scale), parts[0].scale.dtype,
                                    parts[0].in_features)
    return Int8Linear.from_buffers(torch.cat([p.codes for p in parts]),
                                   torch.cat([p.scale for p in parts]),
                                   _bias(parts, parts[0].scale))


# The probe's verdict per kind, part shapes, dtype and device: what it checks (a kernel
# layout blocking rows across a part's edge) depends on those and this machine alone, and
# a model's layers repeat one shape (probing each of the default model's 60 stacks took
# 92 ms of the compiled step's first call; one per shape takes 3 ms).
_VERDICTS: dict[tuple[object, ...], bool] = {}


def _same_outputs(stacked: torch.nn.Module, parts: Sequence[torch.nn.Module]) -> bool:
    """The stacked layer gives exactly the parts' outputs side by side, at 1, 3 and 15 rows
    (probed once per shape of parts in a process: `_VERDICTS`)."""
    # The input the layer's kernel takes: the dense weight's dtype, or a quantized
    # layer's scales' (the int4/int8 kernels require activations of that dtype).
    p = parts[0]
    like = p.weight if isinstance(p, torch.nn.Linear) else (
        p.scale_zero if isinstance(p, Int4Linear) else p.scale)
    assert isinstance(like, torch.Tensor)
    key = (type(p), tuple((_out_features(q), _in_features(q)) for q in parts),
           like.dtype, like.device, getattr(stacked, "bias", None) is not None,
           getattr(p, "vnni", False))
    if key not in _VERDICTS:
        _VERDICTS[key] = _probe(stacked, parts, like)
    return _VERDICTS[key]


def _probe(stacked: torch.nn.Module, parts: Sequence[torch.nn.Module],
           like: torch.Tensor) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    # Outside a pass's prompt tokens (models/quant/prompt_tokens.py) no part runs its dense
    # copy: both sides on the kernel the stacked layer runs, whether or not copies exist.
    for rows in (1, 3, 15):
        x = torch.randn(rows, _in_features(parts[0]) or 0, generator=gen).to(like.device,
                                                                             like.dtype)
        if not torch.equal(stacked(x), torch.cat([q(x) for q in parts], dim=-1)):
            return False
    return True


def _share_storage(stacked: torch.nn.Module, parts: Sequence[torch.nn.Module]) -> None:
    """Re-point each part's large tensor at its rows of the stacked one (a view: rows are
    the first dimension, so a slice stays contiguous; in the int kernels' layouts, whole
    tiles of 16 rows, likewise); the parts' own copies are freed."""
    name = {Int4Linear: "packed", Int8Linear: "codes"}.get(type(stacked), "weight")
    big = getattr(stacked, name)
    whole = stacked.tiled() if isinstance(stacked, Int4Linear) else None
    # Output rows a row of the stored layout holds: 1 for [N, ...] layouts, 8 for CUDA's
    # int4 (tinygemm's [N/8, K/(16 tiles), 32, tiles/2]: rows in tiles of 8).
    unit = max(1, _out_features(stacked) // big.shape[0]) if big.dim() and big.shape[0] else 1
    start = 0
    for p in parts:
        rows = _out_features(p)
        if isinstance(p, Int4Linear) and p.vnni and whole is not None:
            # A stack of the int kernel alone: the parts keep any int4-kernel buffers,
            # and their layouts are (or become) its rows.
            p.use_vnni(int_mm.int4_rows(whole, start, rows))
        elif isinstance(p, Int8Linear) and isinstance(stacked, Int8Linear) \
                and big.numel() == 0:
            k = p.in_features
            p.use_vnni(stacked.vnni_codes[start * k:(start + rows) * k])
        elif name == "weight":
            p.weight = torch.nn.Parameter(big[start:start + rows], requires_grad=False)
        else:
            setattr(p, name, big[start // unit:(start + rows) // unit])
        start += rows
