"""Batch invariance: how many of 16 JSON-schema outputs change with the batch, with and
without `--deterministic`, and what the mode costs in throughput.

The workload is the 16 first Glaive schemas of ../shared/data's held-out half (a short
request for a JSON object each, greedy, chat template of the default model). For each
dtype and mode it runs batch 1 and batch 8 (and the other sizes given) through the
engine, counts the lines whose text or per-token logprobs differ from batch 1, and times
batch 8 for the throughput ratio, both modes side by side in one process.

    python bench/determinism.py --dtypes bfloat16,float32 --batch-sizes 1,8 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "jsonschemabench" / "Glaiveai2K"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_split import HALVES, in_half  # noqa: E402


def short_request(stem: str) -> str:
    """A short request naming the schema's task: 'analyze_health_data_4ad104b4' ->
    'Give a JSON object for: analyze health data.' (the grammar enforces the schema)."""
    return f"Give a JSON object for: {stem.rsplit('_', 1)[0].replace('_', ' ')}."


def glaive_jobs(n: int, max_tokens: int, logprobs: int | None = 0,
                half: str = "held") -> list[Any]:
    """The n first Glaive schemas of `half` (by file name) as chat requests for a JSON
    object, greedy."""
    from aici_cli.core.constraint import Constraint
    from aici_cli.core.job import Job

    files = sorted(f for f in DATA.glob("*.json") if in_half(f, half))[:n]
    jobs = []
    for i, f in enumerate(files):
        schema = json.loads(f.read_text())
        ask = short_request(f.stem)
        jobs.append(Job(index=i + 1, id=f.stem, max_tokens=max_tokens,
                        constraint=Constraint("json_schema", schema),
                        prompt=None, messages=[{"role": "user", "content": ask}],
                        logprobs=logprobs))
    return jobs


def run(lm: Any, jobs: list[Any], **engine: Any) -> tuple[dict[str, Any], float, int]:
    """Results by id, wall seconds, tokens generated."""
    from aici_cli.core.config import EngineConfig
    from aici_cli.engine import Engine

    eng = Engine(lm, EngineConfig(**engine))
    eng.compiler  # noqa: B018 - build the tokenizer wrapper outside the timing
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    eng.run(jobs, out.append)
    wall = time.perf_counter() - t0
    tokens = sum(r["stats"]["output_tokens"] for r in out)
    return {r["id"]: r for r in out}, wall, tokens


def signature(result: dict[str, Any]) -> tuple[str, str]:
    """What must be identical: the text and every token's logprob (bit for bit)."""
    return result["text"], json.dumps(result.get("logprobs"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--lines", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--half", choices=HALVES, default="held",
                    help="schemas from this half of the fixed split (bench/data_split.py)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "determinism.json")
    args = ap.parse_args()

    from aici_cli.models.load import load_model

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    report: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        lm = load_model(None, "cpu", dtype)
        jobs = glaive_jobs(args.lines, args.max_tokens, half=args.half)
        for deterministic in (False, True):
            ref: dict[str, Any] | None = None
            for bs in sizes:
                res, wall, tokens = run(lm, jobs, batch_size=bs, deterministic=deterministic)
                if ref is None:
                    ref = res
                differ = sum(signature(res[k]) != signature(ref[k]) for k in ref)
                text_differ = sum(res[k]["text"] != ref[k]["text"] for k in ref)
                row = {"dtype": dtype, "deterministic": deterministic, "batch": bs,
                       "differ_from_batch_1": differ, "text_differs": text_differ,
                       "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 1)}
                report.append(row)
                print(json.dumps(row), flush=True)
    for dtype in args.dtypes.split(","):
        for bs in sizes:
            off, on = (next(r for r in report if r["dtype"] == dtype and r["batch"] == bs
                            and r["deterministic"] is d) for d in (False, True))
            print(f"{dtype} batch {bs}: deterministic costs "
                  f"{off['tok_per_s'] / on['tok_per_s']:.2f}x ({off['tok_per_s']} -> "
                  f"{on['tok_per_s']} tok/s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
