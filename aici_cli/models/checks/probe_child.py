"""The kernel probe's child (`probe`): one mode's layers, built as a run builds
them, computed at a run's row counts and judged against float32 over the same weights.

Run as `python -m aici_cli.models.checks.probe_child SPEC`; prints one JSON line, {"ok",
"reason", "step_ms", "max_error"}. A native fault kills this process, which is the point:
the parent reads the signal.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from aici_cli.models.device import DTYPES
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels.aligned import ALIGN
from aici_cli.models.kernels.probe import (
    INT8_ACTIVATIONS_TOLERANCE,
    PREFILL_ROWS,
    STEP_ROWS,
    TOLERANCE,
)
from aici_cli.models.quant import vnni_layouts
from aici_cli.models.quant.quantize import (
    GROUP,
    Int4Linear,
    Int8Linear,
    quantize_int4,
    quantize_int8,
)

# Fault injection for the test suite only: "segv", "hang" or "wrong", optionally
# ":<quantize>" to fault only in that mode (e.g. "segv:int4"). Unset, it does nothing.
FAULT_ENV = "AICI_BATCH_TEST_PROBE_FAULT"



def probe_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    mode, shapes = spec["mode"], spec["shapes"]
    _inject_fault(mode["quantize"])
    try:
        answer = probe(mode, shapes)
    except Exception as e:  # noqa: BLE001 - a kernel that raises is a verdict too
        answer = {"ok": False, "reason": f"its kernels raised {type(e).__name__}: "
                                         f"{str(e).splitlines()[0][:200] if str(e) else ''}"}
    print(json.dumps(answer), flush=True)


def probe(mode: dict[str, Any], shapes: dict[str, Any]) -> dict[str, Any]:
    """Every distinct linear layer of the model (and the output projection) in the mode,
    and attention: the worst relative error, and one decode step's linear time."""
    torch.manual_seed(0)
    device = torch.device("cuda" if mode["device"] == "cuda" else "cpu")
    dtype = DTYPES[mode["dtype"]]
    h, i, v = shapes["hidden"], shapes["intermediate"], shapes["vocab"]
    q_out, kv_out = shapes["heads"] * shapes["head_dim"], shapes["kv_heads"] * shapes["head_dim"]
    # (out, in, layers in one decode step using it, output projection?)
    layers = [(q_out, h, 1, False), (kv_out, h, 2, False), (h, q_out, 1, False),
              (i, h, 2, False), (h, i, 1, False), (v, h, 0, True)]
    worst, step_s = 0.0, 0.0
    tolerance = TOLERANCE[mode["dtype"]]
    if mode["quantize"] == int_mm.PROBE_QUANTIZE:
        tolerance = max(tolerance, INT8_ACTIVATIONS_TOLERANCE)
    for n, k, per_layer, output in layers:
        layer, weight = _layer(n, k, mode["quantize"], output, dtype, device)
        error = _error(layer, weight, k, dtype, device)
        if error > tolerance:
            return {"ok": False, "max_error": error,
                    "reason": f"its {n}x{k} layer computes {error:.3g} off float32 over the "
                              f"same weights (tolerance {tolerance:g})"}
        worst = max(worst, error)
        step_s += _seconds(layer, k, dtype, device) * (per_layer * shapes["layers"] or 1)
    error = _attention_error(shapes, dtype, device)
    if error > TOLERANCE[mode["dtype"]]:
        return {"ok": False, "max_error": error,
                "reason": f"its attention computes {error:.3g} off float32"}
    return {"ok": True, "max_error": max(worst, error), "step_ms": round(step_s * 1e3, 3)}


def _layer(n: int, k: int, quantize: str, output: bool, dtype: torch.dtype,
           device: torch.device) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                          torch.Tensor]:
    """The layer a run would build for an [n, k] weight, and its weights as float32
    (what the layer's codes say). As `model_layers.quantize_model`: the output projection,
    and any layer whose inputs are not whole groups, in int8."""
    w = torch.randn(n, k, device=device) / k ** 0.5
    vnni = quantize == int_mm.PROBE_QUANTIZE  # int4 layers (and int8 ones) on it
    if vnni and (why := int_mm.unusable()) is not None:
        raise ValueError(f"the VNNI kernels cannot run: {why}")
    kind = "int8" if quantize != "none" and (output or k % GROUP) else \
        "int4" if vnni else quantize
    if kind == "int4":
        codes, d, m = quantize_int4(w)
        built = Int4Linear(codes, d, m, None, dtype)
        layer = Int4Linear.from_buffers(_off_boundary(built.packed),
                                        _off_boundary(built.scale_zero), None)
        if vnni and not vnni_layouts.int4_layer(layer, d, m):
            raise ValueError(f"the int4 VNNI kernel takes no {n}x{k} layer")
        # weight = (q - 8) scale + zero, with the scale and zero as rounded to `dtype`
        sz = built.scale_zero.float()  # [K/32, N, 2]
        dq = ((codes.float().view(n, k // GROUP, GROUP) - 8) * sz[..., 0].t()[..., None]
              + sz[..., 1].t()[..., None])
        return layer, dq.reshape(n, k)
    if kind == "int8":
        codes, scale = quantize_int8(w)
        layer8 = Int8Linear.from_buffers(_off_boundary(codes), scale.to(dtype), None)
        if vnni:
            vnni_layouts.int8_layer(layer8)  # a shape that does not tile keeps the int8 kernel
        return layer8, codes.float() * scale.to(dtype).float()[:, None]
    dense = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(w)
    return dense, dense.weight.detach().float()


def _off_boundary(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` starting 40 bytes past a 64-byte boundary, as a tensor mapped from
    a safetensors file often does: the layer must cope (`aligned`)."""
    nbytes = t.numel() * t.element_size()
    buf = torch.empty(nbytes + 2 * ALIGN, dtype=torch.uint8, device=t.device)
    start = 40 + (-buf.data_ptr()) % ALIGN
    view = buf[start:start + nbytes].view(t.dtype).view(t.shape)
    view.copy_(t)
    return view


def _error(layer: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor, k: int,
           dtype: torch.dtype, device: torch.device) -> float:
    """The worst relative error over a prefill and one-token steps of STEP_ROWS rows."""
    worst = 0.0
    with torch.inference_mode():
        for rows in (PREFILL_ROWS, *STEP_ROWS):
            x = torch.randn(rows, k, device=device).to(dtype)
            y = layer(x).float()
            ref = x.float() @ weight.t()
            worst = max(worst, _relative(y, ref))
    return worst


def _attention_error(shapes: dict[str, Any], dtype: torch.dtype, device: torch.device) -> float:
    """Causal attention over a prefill and a one-token step, grouped heads as the model
    has them, against float32."""
    heads, kv, dim = shapes["heads"], shapes["kv_heads"], shapes["head_dim"]
    worst = 0.0
    with torch.inference_mode():
        for rows, keys in ((PREFILL_ROWS, PREFILL_ROWS), (8, PREFILL_ROWS + 1)):
            q = torch.randn(1, heads, rows, dim, device=device).to(dtype)
            kk = torch.randn(1, kv, keys, dim, device=device).to(dtype)
            vv = torch.randn(1, kv, keys, dim, device=device).to(dtype)
            k_all = kk.repeat_interleave(heads // kv, dim=1) if heads % kv == 0 else kk
            v_all = vv.repeat_interleave(heads // kv, dim=1) if heads % kv == 0 else vv
            causal = rows == keys
            y = F.scaled_dot_product_attention(q, k_all, v_all, is_causal=causal).float()
            ref = F.scaled_dot_product_attention(q.float(), k_all.float(), v_all.float(),
                                                 is_causal=causal)
            worst = max(worst, _relative(y, ref))
    return worst


def _relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y - ref).abs().max() / ref.abs().max().clamp(min=1e-6))


def _seconds(layer: Callable[[torch.Tensor], torch.Tensor], k: int, dtype: torch.dtype,
             device: torch.device) -> float:
    """The layer's median time at one row, on one thread: comparable between modes, and
    steady on a busy machine (where a pool's threads wait on each other)."""
    x = torch.randn(1, k, device=device).to(dtype)
    times = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.inference_mode():
        for _ in range(7):
            started = time.perf_counter()
            layer(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    torch.set_num_threads(threads)
    return sorted(times)[len(times) // 2]


def _inject_fault(quantize: str) -> None:
    fault = os.environ.get(FAULT_ENV)
    if not fault:
        return
    kind, _, only = fault.partition(":")
    if only and only != quantize:
        return
    if kind == "segv":
        ctypes.string_at(0)  # a read of address 0: SIGSEGV, as a faulting kernel dies
    elif kind == "hang":
        while True:
            time.sleep(1)
    elif kind == "wrong":  # every layer's outputs 1.5 times what they should be
        for cls in (Int8Linear, Int4Linear, torch.nn.Linear):
            cls.forward = _scaled(cls.forward)  # type: ignore[method-assign]


def _scaled(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda self, x: forward(self, x) * 1.5


if __name__ == "__main__":
    import sys

    probe_main(sys.argv[1])
