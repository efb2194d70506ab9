"""Declared coverage with and without `--schema-fallback relax`, over JSONSchemaBench.

Compiles every schema of the data set with the model's tokenizer (the default model's
unless --model), as `aici-batch run` would: first as it is, then, for those that do not
compile, with relax. Reports per subset how many compile each way, what still fails and
why, and what relaxing cost; --out writes the details (every relaxed schema's steps).

    python bench/relax_coverage.py
    python bench/relax_coverage.py --subsets WashingtonPost --out out/relax.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "jsonschemabench"
SUBSETS = ("Github_trivial", "Github_easy", "Glaiveai2K", "Snowplow", "WashingtonPost")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--subsets", default=",".join(SUBSETS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--json-permissive", action="store_true",
                    help="compile as `aici-batch run --json-permissive` does")
    ap.add_argument("--out", type=Path, default=None, help="write the details here (JSON)")
    args = ap.parse_args()

    from aici_cli.control.grammar import GrammarCompiler
    from aici_cli.core.constraint import Constraint
    from aici_cli.core.errors import GrammarError
    from aici_cli.models import load_model
    from aici_cli.run.tally import percentile

    if not args.data.is_dir():
        print(f"no schemas at {args.data}", file=sys.stderr)
        return 2
    lm = load_model(args.model, device="cpu")
    compiler = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids),
                               strict_json=not args.json_permissive)

    rows: dict[str, dict[str, Any]] = {}
    relaxed: list[dict[str, Any]] = []
    relax_ms: list[float] = []
    for subset in args.subsets.split(","):
        files = sorted((args.data / subset).glob("*.json"))
        row: dict[str, Any] = {"schemas": len(files), "compiled": 0, "compiled_relaxed": 0,
                               "not_json": 0, "failed": Counter(), "failed_relaxed": Counter()}
        for f in files:
            try:
                schema = json.loads(f.read_text(encoding="utf-8"))
            except ValueError:
                row["not_json"] += 1
                continue
            constraint = Constraint("json_schema", schema)
            try:
                compiler.compile(constraint)
                row["compiled"] += 1
                row["compiled_relaxed"] += 1
                continue
            except GrammarError as e:
                row["failed"][e.type] += 1
            t0 = time.perf_counter()
            try:
                grammar = compiler.compile(constraint, relax=True)
            except GrammarError as e:
                row["failed_relaxed"][e.type] += 1
                relaxed.append({"schema": f"{subset}/{f.name}", "error": e.type,
                                "message": e.message})
                continue
            finally:
                relax_ms.append((time.perf_counter() - t0) * 1000.0)
            row["compiled_relaxed"] += 1
            relaxed.append({"schema": f"{subset}/{f.name}", "relaxed": grammar.relaxed})
        rows[subset] = row

    total = {key: sum(r[key] for r in rows.values())
             for key in ("schemas", "compiled", "compiled_relaxed", "not_json")}
    total["failed"] = sum((r["failed"] for r in rows.values()), Counter())
    total["failed_relaxed"] = sum((r["failed_relaxed"] for r in rows.values()), Counter())
    rows["all"] = total

    print(f"{'subset':16} {'schemas':>8} {'compiled':>9} {'%':>7} {'relaxed':>9} {'%':>7}  "
          "still failing (relax)")
    for subset, r in rows.items():
        n = r["schemas"] or 1
        failing = ", ".join(f"{k} {v}" for k, v in sorted(r["failed_relaxed"].items()))
        print(f"{subset:16} {r['schemas']:>8} {r['compiled']:>9} "
              f"{100 * r['compiled'] / n:>6.2f}% {r['compiled_relaxed']:>9} "
              f"{100 * r['compiled_relaxed'] / n:>6.2f}%  {failing or '-'}")
    if relax_ms:
        steps = [len(x["relaxed"]) for x in relaxed if "relaxed" in x]
        print(f"relaxing: {len(relax_ms)} schemas, ms p50 {percentile(relax_ms, 50):.0f}, "
              f"max {max(relax_ms):.0f}; steps p50 {percentile(steps, 50) if steps else 0}, "
              f"max {max(steps, default=0)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"subsets": rows, "relaxed": relaxed, "relax_ms": relax_ms}
        args.out.write_text(json.dumps(report, indent=2, default=dict) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
