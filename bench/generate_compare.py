"""This engine against plain transformers `generate()` on the same loaded model.

For each batch size: the same unconstrained chat prompts (end-of-sequence ignored on both
sides, so both make every token), greedy, --max-tokens tokens; `generate()` runs static
left-padded batches, the engine its continuous one (drafts off, so both do one token per
row per step). Prints tok/s of each and the ratio; the engine may be compiled
(--compile on: its buckets are warmed first, not timed) and the weights quantised
(--quantize: the same modules serve `generate()`).

    python bench/generate_compare.py --device cuda --quantize none,int4 --batch-sizes 1,8,64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

TOPICS = ["a dragon", "the sea", "a city at night", "an old clock", "a robot", "the moon",
          "a lost key", "winter"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantize", default="none,int4")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "generate_compare.json")
    args = ap.parse_args()

    import torch
    from peers.common import generate_batch

    from aici_cli.core.config import EngineConfig
    from aici_cli.core.job import Job
    from aici_cli.engine import Engine
    from aici_cli.models.load import load_model

    rows: list[dict[str, Any]] = []
    for quantize in args.quantize.split(","):
        lm = load_model(args.model or None, args.device, args.dtype, quantize)
        # generate() is transformers' own: its model class, on the same weights.
        hf = load_model(args.model or None, args.device, args.dtype, quantize,
                        implementation="transformers")
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            messages = [[{"role": "user", "content": f"Write a story about {TOPICS[i % 8]}."}]
                        for i in range(bs)]
            # generate(): eos suppressed so every row makes max_tokens.
            started = time.perf_counter()
            _, counts, _ = generate_batch(hf.model, hf.tokenizer, messages, args.max_tokens,
                                          min_new_tokens=args.max_tokens)
            if lm.device.type == "cuda":
                torch.cuda.synchronize()
            hf_s = time.perf_counter() - started
            config = EngineConfig(batch_size=bs, draft_tokens=0, compile=args.compile)

            def jobs(n: int, messages: list[Any] = messages) -> list[Job]:
                return [Job(index=i + 1, id=str(i), max_tokens=n,
                            constraint=None, prompt=None, messages=m, ignore_eos=True)
                        for i, m in enumerate(messages)]

            if args.compile == "on":
                Engine(lm, config).run(jobs(4), lambda r: None)
            engine = Engine(lm, config)
            results: list[dict[str, Any]] = []
            started = time.perf_counter()
            engine.run(jobs(args.max_tokens), results.append)
            ours_s = time.perf_counter() - started
            ours_tokens = sum(r["stats"]["output_tokens"] for r in results)
            row = {"quantize": lm.quantize, "dtype": str(lm.dtype), "device": str(lm.device),
                   "batch": bs, "generate_tok_s": round(sum(counts) / hf_s, 1),
                   "engine_tok_s": round(ours_tokens / ours_s, 1), "compile": args.compile}
            row["ratio"] = round(row["engine_tok_s"] / max(row["generate_tok_s"], 1e-9), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del lm
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
