"""Throughput against batch size, and continuous refill against draining the batch.

Prompts ask for outputs of widely different lengths (a max_tokens drawn per line from
4..max), so a static batch idles while its longest row finishes. For each batch size the
same lines run twice in one process: with continuous refill (a finished row takes the
next prompt at once) and draining (new prompts only once every row is free), and
output tokens/s and row passes per token are reported side by side.

    python bench/scaling.py --batch-sizes 1,4,8,16,32 --lines 48 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,4,8,16,32")
    ap.add_argument("--lines", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "scaling.json")
    args = ap.parse_args()

    from aici_cli.core.config import EngineConfig
    from aici_cli.core.job import Job
    from aici_cli.engine import Engine
    from aici_cli.models.load import load_model

    lm = load_model(args.model)
    rng = random.Random(0)
    topics = ["the sea", "a city at night", "how bread is made", "a chess opening",
              "the history of maps", "a walk in the rain", "how a compiler works"]
    jobs = [
        Job(index=i + 1, id=str(i), prompt=None,
            messages=[{"role": "user", "content": f"Write about {topics[i % len(topics)]}."}],
            max_tokens=rng.randint(4, args.max_tokens))
        for i in range(args.lines)
    ]
    rows: list[dict[str, Any]] = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        for mode in ("refill", "drain"):
            engine = Engine(lm, EngineConfig(batch_size=bs))
            results: list[dict[str, Any]] = []

            def drained(e: Engine = engine) -> bool:
                return e.in_flight() == 0

            t0 = time.perf_counter()
            engine.run(jobs, results.append,
                       should_admit=(lambda: True) if mode == "refill" else drained)
            wall = time.perf_counter() - t0
            tokens = sum(r["stats"]["output_tokens"] for r in results)
            passes = sum(r["stats"]["forward_passes"] for r in results)
            rows.append({"batch": bs, "mode": mode, "wall_s": round(wall, 2),
                         "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
                         "batched_passes": len(engine.step_times),
                         "row_passes_per_token": round(passes / tokens, 3)})
            r = rows[-1]
            print(f"batch {bs:>3} {mode:6}: {r['tokens_per_s']:7.1f} tok/s, "
                  f"{r['batched_passes']:5} passes, wall {r['wall_s']:6.1f} s", flush=True)
        refill, drain = rows[-2], rows[-1]
        print(f"batch {bs:>3} refill/drain throughput: "
              f"{refill['tokens_per_s'] / drain['tokens_per_s']:.2f}x", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
