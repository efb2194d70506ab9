"""What the compiled step's opaque norms cost: the default model's one-token step for B rows
through `torch.compile` of `decode_layer.all_layers_step`, its norms as `aici::rms_norm`
(models/kernels/native_norm.py: the eager passes' bits) against the norm modules inductor
fuses (its own order of sums), interleaved bursts in one process, median step time each.

    python bench/native_norm_cost.py --rows 1,8 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="steps a burst")
    ap.add_argument("--slots", type=int, default=256, help="cache slots (positions up to)")
    args = ap.parse_args()

    import torch

    from aici_cli.engine.forward.decode_layer import DecodeLayer, all_layers_step
    from aici_cli.models import load_model

    lm = load_model(None, "cpu", "auto", "auto")
    model, config = lm.model, lm.model.config
    native = [DecodeLayer(layer, config) for layer in model.model.layers]
    fused = [DecodeLayer(layer, config) for layer in model.model.layers]
    for mine, layer in zip(fused, model.model.layers):  # the modules themselves
        mine.input_norm, mine.post_norm = layer.input_layernorm, layer.post_attention_layernorm
    print(f"{lm.dtype} + {lm.quantize}; norms {type(native[0].input_norm).__name__} "
          f"against {type(fused[0].input_norm).__name__}")
    dim, heads = native[0].head_dim, native[0].kv_heads
    hidden = int(config.hidden_size)
    steps: dict[tuple[str, int], Any] = {}
    inputs: dict[int, tuple[Any, ...]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        keys = [torch.zeros(rows, heads, args.slots, dim) for _ in native]
        values = [torch.zeros(rows, heads, args.slots, dim) for _ in native]
        pos = torch.full((rows,), args.slots // 2, dtype=torch.long)
        cos, sin = torch.ones(rows, 1, dim), torch.zeros(rows, 1, dim)
        mask = torch.ones(rows, 1, 1, args.slots, dtype=torch.bool)
        inputs[rows] = (torch.randn(rows, hidden), cos, sin, keys, values, pos,
                        torch.ones(rows, dtype=torch.bool), mask)
        for name, layers in (("native", native), ("fused", fused)):
            fn = torch.compile(lambda *a, _l=layers: all_layers_step(_l, *a), fullgraph=True,
                               dynamic=False)
            started = time.perf_counter()
            with torch.inference_mode():
                fn(*inputs[rows])
            print(f"compiled {name} for {rows} rows in {time.perf_counter() - started:.1f} s",
                  flush=True)
            steps[(name, rows)] = fn
    times: dict[tuple[str, int], list[float]] = {k: [] for k in steps}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for key, fn in steps.items():
                started = time.perf_counter()
                for _ in range(args.steps):
                    fn(*inputs[key[1]])
                times[key].append((time.perf_counter() - started) / args.steps * 1e3)
    for rows in inputs:
        a, b = statistics.median(times[("native", rows)]), statistics.median(times[("fused", rows)])
        print(f"{rows} rows: native norms {a:.2f} ms a step, fused {b:.2f} ms: {a / b:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
