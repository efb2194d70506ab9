"""One layer on each int-kernel variant this CPU runs, beside PyTorch's kernels
(docs/speed.md, "The int kernels").

For each variant (`AICI_BATCH_ISA`, in a process of its own: a process loads one build of
the operators), an int4 and an int8 [n, k] layer at --rows activation rows, bf16 and
float32: the median of --repeats timings of --calls calls each. Then, at the same ATen
capability as the slowest variant (avx2), PyTorch's int4 kernel with float32 activations
and the dense float32 `F.linear` over the same weights: what an AVX2 machine ran before.

    python bench/int_kernels.py                       # 5632 x 2048, 1 and 8 rows
    python bench/int_kernels.py --n 2048 --k 2048 --rows 1
    python bench/int_kernels.py --stream 40           # one row, weights from memory

`--stream L` times one-row products over L copies of the layer in turn (40 copies of
5632 x 2048: 260 MB of int4, far past any cache), as a decode step streams a model's
layers from memory, and reports the bytes read a second beside `sum`'s over a tensor of
that size (what the memory gives these threads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, time, torch
n, k, rows_list, calls, repeats, baseline, stream = json.loads(sys.argv[1])
from aici_cli.models.kernels import int_mm
from aici_cli.models.quant.quantize import Int4Linear, quantize_int4
torch.manual_seed(0)
w = torch.randn(n, k) / k ** 0.5
codes, d, m = quantize_int4(w)
out = {}

def timed(f):
    for _ in range(10):
        f()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        runs.append((time.perf_counter() - start) / calls * 1e3)
    return sorted(runs)[len(runs) // 2]

if baseline:
    layer = Int4Linear(codes, d, m, None, torch.float32)
    for rows in rows_list:
        x = torch.randn(rows, k)
        out[f"torch int4 float32, {rows} rows"] = timed(lambda: layer.few_rows(x))
        out[f"dense float32, {rows} rows"] = timed(lambda: torch.nn.functional.linear(x, w))
elif stream:
    assert int_mm.unusable() is None, int_mm.unusable()
    out["variant"] = int_mm.variant().name
    x = torch.randn(1, k)
    c8 = torch.randint(-127, 128, (n, k)).to(torch.int8)
    scale = torch.rand(n)
    copies = {
        "int4": ([int_mm.tile_int4(codes.clone(), d.clone(), m) for _ in range(stream)],
                 n * k * (0.5 + 2 / 32), lambda t: int_mm.int4_mm(x, t)),
        "int8": ([int_mm.tile_int8(c8.clone()) for _ in range(stream)],
                 n * k, lambda t: torch.ops.aici.int8_vnni_mm(x, t, scale, n)),
    }
    for name, (tiles, size, call) in copies.items():
        for _ in range(2):
            for t in tiles:
                call(t)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            for t in tiles:
                call(t)
            runs.append(time.perf_counter() - start)
        best = sorted(runs)[len(runs) // 2]
        out[f"{name} 1 row, {stream} layers"] = {
            "us_per_layer": round(best / stream * 1e6, 1),
            "gb_s": round(size * stream / best / 1e9, 1)}
    big = torch.ones(int(n * k * 0.5625 * stream) // 4)
    big.sum()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        big.sum()
        runs.append(time.perf_counter() - start)
    out["sum gb_s"] = round(big.numel() * 4 / sorted(runs)[len(runs) // 2] / 1e9, 1)
else:
    assert int_mm.unusable() is None, int_mm.unusable()
    out["variant"] = int_mm.variant().name
    t4 = int_mm.tile_int4(codes, d, m)
    c8 = int_mm.tile_int8(torch.randint(-127, 128, (n, k)).to(torch.int8))
    scale = torch.rand(n)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in rows_list:
            x = torch.randn(rows, k).to(dtype)
            name = str(dtype).removeprefix("torch.")
            out[f"int4 {name}, {rows} rows"] = timed(lambda: int_mm.int4_mm(x, t4))
            out[f"int8 {name}, {rows} rows"] = timed(
                lambda: torch.ops.aici.int8_vnni_mm(x, c8, scale, n))
print(json.dumps(out))
"""


def run(isa: str | None, spec: list[object]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if isa is None:  # PyTorch's kernels where an AVX2 machine runs them
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    else:
        env["AICI_BATCH_ISA"] = isa
        env.pop("ATEN_CPU_CAPABILITY", None)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5632)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--stream", type=int, default=0,
                    help="one-row products over this many copies of the layer (memory-bound)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from aici_cli.models.kernels import int_mm
    from aici_cli.models.kernels.cpu_features import cpu_features

    cpu = cpu_features()
    variants = int_mm.X86_VARIANTS if cpu.x86 else int_mm.ARM_VARIANTS
    rows = [int(r) for r in args.rows.split(",")]
    report: dict[str, object] = {"cpu": cpu.fingerprint, "shape": [args.n, args.k]}
    for v in variants:
        if cpu.missing(v.needs):
            report[v.name] = f"not on this CPU (lacks {', '.join(cpu.missing(v.needs))})"
            continue
        report[v.name] = run(v.name, [args.n, args.k, rows, args.calls, args.repeats, False,
                                      args.stream])
    if not args.stream:
        report["pytorch at avx2"] = run(None, [args.n, args.k, rows, args.calls,
                                               args.repeats, True, 0])
    for name, figures in report.items():
        print(f"{name}: {json.dumps(figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
