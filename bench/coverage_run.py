"""Coverage run over JSONSchemaBench schemas, in JSONSchemaBench's own terms.

For a sample of schemas from each subset it writes one prompt line per schema (a request
for a JSON object matching the schema, which is also enforced), runs `aici-batch` on the
default model, and reports per subset:
  declared coverage  share of schemas compiled without error;
  compliance         share of schemas whose output is valid JSON that validates (and
                     `unclosed`: counting only outputs the model finished itself);
  cut off            outputs the token limit cut (goal 0 at the default options), and
                     closed early (at the limit, on a loop); loops undone (the first
                     loop taken back, the model going on); outputs that are not JSON, and
                     closed outputs that fail their schema (goal 0 for both);
  controller share   the largest share of any line's time spent in its controller
                     (goal <= 10%), and the run's p99 controller ms per step beside the
                     forward pass's (with per-step records);
  forward passes per output token (below 1.0 by what fast-forward saved), tokens/s,
  grammar compile time p50/p99, and step time outside the forward pass p50/p99.

    python bench/coverage_run.py --half held --per-subset 20 --max-tokens 512
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_split import HALVES, in_half  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "jsonschemabench"
SUBSETS = ("Github_trivial", "Github_easy", "Glaiveai2K", "Snowplow", "WashingtonPost")
COMPILE_ERRORS = {"invalid_schema", "unsupported_schema"}


def prompt_for(schema: dict[str, Any]) -> list[dict[str, str]]:
    what = " ".join(
        str(schema.get(k)) for k in ("title", "description") if isinstance(schema.get(k), str)
    )
    text = json.dumps(schema)
    if len(text) > 3000:
        text = text[:3000] + " ..."
    ask = f"Produce a JSON object for: {what}\n" if what else "Produce a JSON object.\n"
    return [{"role": "user", "content": f"{ask}It must match this JSON Schema:\n{text}"}]


def sample_schemas(data: Path, subsets: list[str], per_subset: int,
                   seed: int, half: str = "held") -> list[tuple[str, str, dict[str, Any]]]:
    """`per_subset` schemas of each subset, drawn from one half of the fixed split
    (data_split.py): report on `held`, tune on `tune`."""
    rng = random.Random(seed)
    picked = []
    for subset in subsets:
        files = sorted(f for f in (data / subset).glob("*.json") if in_half(f, half))
        for f in rng.sample(files, min(per_subset, len(files))):
            try:
                schema = json.loads(f.read_text())
            except ValueError:
                continue
            picked.append((subset, f.stem, schema))
    return picked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--subsets", default=",".join(SUBSETS))
    ap.add_argument("--per-subset", type=int, default=20)
    ap.add_argument("--half", choices=HALVES, default="held",
                    help="which half of the fixed split (bench/data_split.py): report on "
                         "held, tune on tune")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-ff", action="store_true")
    ap.add_argument("--no-close-at-limit", action="store_true",
                    help="let the token limit cut values off (closing is on by default)")
    ap.add_argument("--no-loop-guard", action="store_true",
                    help="let values loop to the limit (the guard is on by default)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--raw-prompt", action="store_true",
                    help="the request as a plain `prompt` (a model without a chat template)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "coverage")
    args = ap.parse_args()

    from aici_cli.core.config import EngineConfig, JobDefaults, RunConfig
    from aici_cli.run.batch import run_batch
    from aici_cli.run.tally import percentile

    if not args.data.is_dir():
        print(f"no schemas at {args.data}", file=sys.stderr)
        return 2
    picked = sample_schemas(args.data, args.subsets.split(","), args.per_subset, args.seed,
                            args.half)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = args.out / "prompts.jsonl"
    with prompts.open("w") as f:
        for subset, name, schema in picked:
            asked = prompt_for(schema)
            line = ({"id": f"{subset}/{name}", "prompt": asked[0]["content"] + "\n"}
                    if args.raw_prompt else {"id": f"{subset}/{name}", "messages": asked})
            line["json_schema"] = schema
            f.write(json.dumps(line) + "\n")

    results: list[dict[str, Any]] = []
    config = RunConfig(
        input=str(prompts), output=str(args.out / "results.jsonl"), model=args.model,
        engine=EngineConfig(batch_size=args.batch_size, fast_forward=not args.no_ff,
                            close_at_limit=not args.no_close_at_limit,
                            loop_guard=not args.no_loop_guard, step_stats=True),
        defaults=JobDefaults(max_tokens=args.max_tokens),
        stats_out=str(args.out / "stats.json"), quiet=True,
    )
    t0 = time.perf_counter()
    outcome = run_batch(config, on_result=results.append)
    wall = time.perf_counter() - t0

    report: dict[str, Any] = {"subsets": {}, "summary": outcome.summary, "wall_s": wall}
    for subset in [*args.subsets.split(","), "all"]:
        rs = [r for r in results if subset == "all" or r["id"].startswith(subset + "/")]
        if not rs:
            continue
        compiled = [r for r in rs if r.get("error", {}).get("type") not in COMPILE_ERRORS]
        stopped = [r for r in compiled if r["finish_reason"] == "stop"]
        out_tokens = sum(r["stats"]["output_tokens"] for r in rs)
        passes = sum(r["stats"]["forward_passes"] for r in rs)
        report["subsets"][subset] = {
            "schemas": len(rs),
            "declared_coverage": round(len(compiled) / len(rs), 3),
            "compliance": round(sum(bool(r.get("valid")) for r in rs) / len(rs), 3),
            "finished_valid": f"{sum(bool(r.get('valid')) for r in stopped)}/{len(stopped)}",
            "truncated": sum(r["finish_reason"] == "length" for r in compiled),
            "closed_early": sum(bool(r["stats"].get("closed_early")) for r in rs),
            "closed_limit": sum(r["stats"].get("close_reason") == "limit" for r in rs),
            "closed_loop": sum(r["stats"].get("close_reason") == "loop" for r in rs),
            "loops_undone": sum(bool(r["stats"].get("loops_undone")) for r in rs),
            "not_json": sum(_not_json(r) for r in compiled),
            "closed_invalid": sum(bool(r["stats"].get("closed_early")) and not r.get("valid")
                                  for r in rs),
            "max_controller_share": max((_controller_share(r) for r in compiled), default=0.0),
            # Compliance counting only outputs the model finished itself as valid.
            "compliance_unclosed": round(sum(bool(r.get("valid")) and not r["stats"].get(
                "closed_early") for r in rs) / len(rs), 3),
            "passes_per_token": round(passes / out_tokens, 3) if out_tokens else None,
            "ff_tokens": sum(r["stats"]["ff_tokens"] for r in rs),
            "output_tokens": out_tokens,
        }
    report["grammar_compile_ms"] = outcome.summary.get("grammar_compile_ms")
    steps = outcome.summary["steps"]
    report["step_overhead_ms"] = steps["overhead_ms"]
    report["step_forward_ms"] = steps["forward_ms"]
    per_step = [s for r in results for s in r.get("steps") or ()]
    report["step_controller_ms_p99"] = percentile([s["controller_ms"] for s in per_step], 99)
    report["step_forward_ms_p99"] = percentile([s["forward_ms"] for s in per_step], 99)
    ttft = [r["stats"]["ttft_ms"] for r in results if r["finish_reason"] != "error"]
    report["ttft_ms"] = {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)}
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    print(f"{'subset':16} {'n':>4} {'declared':>9} {'compliance':>10} {'unclosed':>9} "
          f"{'stop&valid':>11} {'cut off':>8} {'closed':>7} {'(limit':>6} {'loop)':>5} "
          f"{'pass/tok':>9}")
    for subset, s in report["subsets"].items():
        print(f"{subset:16} {s['schemas']:>4} {s['declared_coverage']:>9.3f} "
              f"{s['compliance']:>10.3f} {s['compliance_unclosed']:>9.3f} "
              f"{s['finished_valid']:>11} {s['truncated']:>8} {s['closed_early']:>7} "
              f"{s['closed_limit']:>6} {s['closed_loop']:>5} {s['passes_per_token']!s:>9}")
    summ = outcome.summary
    print(f"tokens/s {summ['tokens_per_s']}, wall {summ['wall_s']} s, batched passes "
          f"{summ['forward_passes']}, output tokens {summ['output_tokens']}, "
          f"ff tokens {summ['ff_tokens']}")
    if report["grammar_compile_ms"]:
        c = report["grammar_compile_ms"]
        print(f"grammar compile ms p50/p99 {c['p50']}/{c['p99']} over {c['grammars']} schemas")
    print(f"step forward ms p50/p99 {steps['forward_ms']['p50']}/{steps['forward_ms']['p99']}; "
          f"outside forward p50/p99 {steps['overhead_ms']['p50']}/{steps['overhead_ms']['p99']}")
    whole = report["subsets"]["all"]
    print(f"loops undone {whole['loops_undone']}, not JSON {whole['not_json']}, closed and "
          f"invalid {whole['closed_invalid']}, largest controller share of a line "
          f"{whole['max_controller_share']:.1%}; per line-step p99: controller "
          f"{report['step_controller_ms_p99']} ms, forward {report['step_forward_ms_p99']} ms")
    return 0


def _not_json(result: dict[str, Any]) -> bool:
    try:
        json.loads(result["text"])
    except (ValueError, KeyError, TypeError):
        return True
    return False


def _controller_share(result: dict[str, Any]) -> float:
    """The share of a line's time spent in its controller (0 for an empty line)."""
    stats = result.get("stats") or {}
    total = stats.get("total_ms") or 0
    return round(stats.get("controller_ms", 0) / total, 3) if total else 0.0


if __name__ == "__main__":
    sys.exit(main())
