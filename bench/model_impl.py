"""The project's own Llama module against transformers' LlamaForCausalLM, side by side in
one process: the engine's eager decode speed on one stream and on a batch, per weight
form, rounds interleaved (the machine is noisy), plus the two load paths' start-up.

    python bench/model_impl.py --rounds 3 --max-tokens 64 --quantize none,int4

Both run the same packed passes through the same cache and attention; their logits are
equal bit for bit (tests/test_llama.py), so the difference is the Python around the ops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROMPT = "Write a long story about a robot who learns to paint."


def decode_rate(lm: Any, batch: int, max_tokens: int) -> float:
    """Generated tokens per second of `batch` greedy lines of `max_tokens` each."""
    from aici_cli.core.config import EngineConfig
    from aici_cli.core.job import Job
    from aici_cli.core.sampling import Sampling
    from aici_cli.engine.engine import Engine

    jobs = [Job(index=i, id=str(i), prompt=None, max_tokens=max_tokens,
                sampling=Sampling(temperature=0.0, top_p=1.0, seed=i), ignore_eos=True,
                messages=[{"role": "user", "content": f"{PROMPT} ({i})"}])
            for i in range(batch)]
    results: list[dict[str, Any]] = []
    engine = Engine(lm, EngineConfig(batch_size=batch, draft_tokens=0, compile="off"))
    started = time.perf_counter()
    engine.run(jobs, results.append)
    elapsed = time.perf_counter() - started
    return sum(r["stats"]["output_tokens"] for r in results) / elapsed


def start_up(implementation: str, quantize: str) -> float:
    """Seconds for a fresh process to import the loader and load the default model."""
    code = ("import time; t = time.perf_counter(); from aici_cli.models.load import load_model; "
            f"load_model(None, quantize={quantize!r}, implementation={implementation!r}); "
            "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--quantize", default="none,int4")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "model_impl.json")
    args = ap.parse_args()

    from aici_cli.models.load import load_model

    impls = ("auto", "transformers")
    rows: list[dict[str, Any]] = []
    for quantize in args.quantize.split(","):
        models = {impl: load_model(None, quantize=quantize, implementation=impl)
                  for impl in impls}
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            decode_rate(models["auto"], batch, 8)  # warm both (allocator, kernels)
            decode_rate(models["transformers"], batch, 8)
            rates: dict[str, list[float]] = {impl: [] for impl in impls}
            for _ in range(args.rounds):
                for impl in impls:
                    rates[impl].append(decode_rate(models[impl], batch, args.max_tokens))
            ratio = statistics.median(a / b for a, b in zip(rates["auto"],
                                                            rates["transformers"]))
            rows.append({"quantize": quantize, "batch": batch, "own_tok_s": rates["auto"],
                         "transformers_tok_s": rates["transformers"],
                         "median_ratio": round(ratio, 3)})
            print(f"{quantize:5} batch {batch:3}: own {statistics.median(rates['auto']):7.1f}"
                  f" tok/s, transformers {statistics.median(rates['transformers']):7.1f} tok/s,"
                  f" ratio {ratio:.2f}", flush=True)
        loads = {impl: [start_up(impl, quantize) for _ in range(args.rounds)] for impl in impls}
        print(f"{quantize:5} load (import + model + tokenizer): own "
              f"{statistics.median(loads['auto']):.2f} s, transformers "
              f"{statistics.median(loads['transformers']):.2f} s", flush=True)
        rows.append({"quantize": quantize, "load_s": loads})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
