"""One-token decode step time of bf16/int8/int4 weights, eager and compiled, interleaved.

On a shared machine the load changes from minute to minute, so configurations measured one
after another compare the load as much as the code. Here every configuration runs a short
burst of one-token steps in turn, round after round, in one process (both models
loaded), and the median step time of each is taken over all its rounds: each sees the
same mix of load. Unconstrained, greedy, drafts off, end-of-sequence ignored.

    python bench/decode_step.py --quantize none,int4 --compile off,on --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantize", default="none,int4")
    ap.add_argument("--compile", default="off,on")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--tokens", type=int, default=24, help="tokens per burst")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "decode_step.json")
    args = ap.parse_args()

    from aici_cli.core.config import EngineConfig
    from aici_cli.core.job import Job
    from aici_cli.engine import Engine
    from aici_cli.models.load import load_model

    models = {q: load_model(args.model, args.device, args.dtype, q)
              for q in args.quantize.split(",")}

    def jobs(bs: int, n: int) -> list[Job]:
        return [Job(index=i + 1, id=str(i), max_tokens=n,
                    constraint=None, prompt=None, ignore_eos=True,
                    messages=[{"role": "user", "content": f"Tell a story, number {i}."}])
                for i in range(bs)]

    configs = [(q, c, int(b)) for b in args.batch_sizes.split(",")
               for q in models for c in args.compile.split(",")]
    times: dict[tuple[str, str, int], list[float]] = {k: [] for k in configs}
    compile_s: dict[tuple[str, str, int], float] = {}
    engines = {}
    for q, c, bs in configs:  # one engine each; compiled ones warmed (compile timed apart)
        engine = Engine(models[q], EngineConfig(batch_size=bs, compile=c, draft_tokens=0))
        started = time.perf_counter()
        engine.run(jobs(bs, 8), lambda r: None)
        if c == "on":
            compile_s[(q, c, bs)] = round(time.perf_counter() - started, 1)
        engines[(q, c, bs)] = engine
    for _ in range(args.rounds):
        for key in configs:
            engine = engines[key]
            engine.step_times.clear()
            engine.run(jobs(key[2], args.tokens), lambda r: None)
            times[key] += [s.forward_ms for s in engine.step_times if s.kind == "decode"]
    rows: list[dict[str, Any]] = []
    base = {bs: statistics.median(times[(next(iter(models)), "off", bs)])
            for bs in {k[2] for k in configs} if (next(iter(models)), "off", bs) in times}
    for key in configs:
        q, c, bs = key
        p50 = statistics.median(times[key])
        row = {"quantize": q, "compile": c, "batch": bs, "forward_p50_ms": round(p50, 2),
               "steps": len(times[key]), "speedup": round(base[bs] / p50, 2),
               "compile_s": compile_s.get(key)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
