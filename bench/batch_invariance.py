"""Whether a line's text depends on its neighbours at the default options: the same greedy
lines at several batch sizes and orders, which lines differ from batch 1 and at which
token, and tok/s at each batch size.

The workload is issue 58's: the first N dev-half ("tune") Glaive schemas of
../shared/data (bench/data_split.py), each a short chat request for a JSON object held to
its schema, and N plain prompts, greedy, at the run's defaults (`--dtype auto`, `--quantize
auto`, `--compile auto`, drafts 4, the prefix cache on). One model is loaded per dtype and
every batch size runs on it, in one process, alternating rounds (`--rounds`), so the
tok/s of two settings are comparable.

    python bench/batch_invariance.py                          # 12 + 12 lines, batch 1 and 8
    python bench/batch_invariance.py --dtype bfloat16 --batch-sizes 1,8,3 --shuffle
    AICI_BATCH_ISA=avx2 python bench/batch_invariance.py --lines 6 --max-tokens 64

`--where` then takes each differing line and shows where its logits first part: the
line's batch-1 tokens are fed again through the engine's passes (`pass_probe.py`), alone
and beside the other lines' prompts, layer by layer.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from determinism import glaive_jobs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PLAIN = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "What causes the seasons on Earth?",
    "Give a recipe for pancakes.",
    "Describe the water cycle for a child.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "Name five programming languages and one strength of each.",
    "How do vaccines work?",
    "Write a haiku about autumn leaves.",
    "What is the difference between weather and climate?",
]


def plain_jobs(n: int, max_tokens: int, first_index: int) -> list[Any]:
    """n plain chat requests, greedy, no constraint."""
    from aici_cli.core.job import Job

    return [Job(index=first_index + i, id=f"plain{i}", max_tokens=max_tokens, prompt=None,
                messages=[{"role": "user", "content": PLAIN[i % len(PLAIN)]}], logprobs=0)
            for i in range(n)]


def workload(lines: int, max_tokens: int) -> list[Any]:
    """`lines` dev-half schemas, then `lines` plain prompts."""
    jobs = glaive_jobs(lines, max_tokens, logprobs=0, half="tune")
    return jobs + plain_jobs(lines, max_tokens, len(jobs) + 1)


def tokens_of(result: dict[str, Any]) -> list[int]:
    assert result["finish_reason"] != "error", result.get("error")
    return [e["id"] for e in result.get("logprobs") or []]


@contextmanager
def previous_paths(on: bool) -> Iterator[None]:
    """With `on`: attention as it was before a token's attention became one computation
    wherever it is fed (multi-token rows on SDPA, the compiled step on SDPA), to measure
    what that costs and what it fixes."""
    if not on:
        yield
        return
    from aici_cli.engine.forward import attention, decode_layer

    saved = attention._run_per_query, decode_layer.rows_attention_op
    attention._run_per_query = lambda *a, **k: False
    decode_layer.rows_attention_op = lambda *a, **k: None
    try:
        yield
    finally:
        attention._run_per_query, decode_layer.rows_attention_op = saved


def run_once(lm: Any, jobs: list[Any], batch_size: int, compile: str,
             drafts: int, order: list[int]) -> tuple[dict[str, list[int]], float, int]:
    """Each line's token ids by id, the wall seconds and the tokens generated."""
    from aici_cli.core.config import EngineConfig
    from aici_cli.engine import Engine

    engine = Engine(lm, EngineConfig(batch_size=batch_size, compile=compile,
                                     draft_tokens=drafts))
    engine.compiler  # noqa: B018 - the tokenizer wrapper, outside the timing
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    engine.run([jobs[i] for i in order], out.append)
    wall = time.perf_counter() - t0
    return ({r["id"]: tokens_of(r) for r in out}, wall,
            sum(r["stats"]["output_tokens"] for r in out))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first token index where a and b part (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(reference: dict[str, list[int]], got: dict[str, list[int]]) -> dict[str, int]:
    """The lines of `got` that differ from `reference`: id -> first differing token."""
    out = {}
    for key, tokens in reference.items():
        at = first_difference(tokens, got[key])
        if at is not None:
            out[key] = at
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--compile", default="auto")
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--lines", type=int, default=12, help="schemas, and as many plain prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--shuffle", action="store_true",
                    help="each run after the first takes the lines in another order")
    ap.add_argument("--before", action="store_true",
                    help="each run again with the previous attention paths, alternating")
    ap.add_argument("--where", action="store_true",
                    help="for each differing line, where its logits first part (pass_probe)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "batch_invariance.json")
    args = ap.parse_args()

    from aici_cli.models.load import load_model

    lm = load_model(args.model, "cpu", args.dtype, args.quantize)
    jobs = workload(args.lines, args.max_tokens)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"model {lm.name}: dtype {lm.dtype}, quantize {lm.quantize}, "
          f"{len(jobs)} lines, batch sizes {sizes}", flush=True)
    rng = random.Random(0)
    # A warm-up outside the figures: the kernels' first calls, the probe's verdicts.
    run_once(lm, jobs[:2], 2, args.compile, args.drafts, [0, 1])
    reference: dict[str, dict[str, list[int]]] = {}
    rows: list[dict[str, Any]] = []
    variants = ["now", "before"] if args.before else ["now"]
    for rnd in range(args.rounds):
        for bs in sizes:
            order = list(range(len(jobs)))
            if args.shuffle and reference:
                rng.shuffle(order)
            for variant in variants:
                with previous_paths(variant == "before"):
                    got, wall, tokens = run_once(lm, jobs, bs, args.compile, args.drafts,
                                                 order)
                ref = reference.setdefault(variant, got)
                differ = compare(ref, got)
                row = {"round": rnd, "paths": variant, "batch": bs,
                       "shuffled": order != sorted(order), "differ": len(differ),
                       "lines": len(jobs), "first_token": differ, "wall_s": round(wall, 2),
                       "tok_per_s": round(tokens / wall, 1),
                       # Whether wide passes ran on dense copies (made once, then kept).
                       "dense_copies": any(getattr(m, "dense", None) is not None
                                           for m in lm.model.modules())}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for variant in variants:
        for bs in sizes:
            mine = [r for r in rows if r["batch"] == bs and r["paths"] == variant]
            print(f"{variant}, batch {bs}: tok/s {[r['tok_per_s'] for r in mine]}, lines "
                  f"differing from the first run {[r['differ'] for r in mine]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": lm.name, "dtype": str(lm.dtype),
                                    "quantize": lm.quantize, "runs": rows}, indent=2) + "\n")
    if args.where and reference:
        from pass_probe import where_rows_part

        differing = sorted({k for r in rows for k in r["first_token"]})
        by_id = {j.id: j for j in jobs}
        for key in differing:
            print(where_rows_part(lm, by_id[key], reference["now"][key],
                                  [j for j in jobs if j.id != key][:7]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
