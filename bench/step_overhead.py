"""Where a one-token step's time goes: kernels, the time around them, and the step's Python.

For each batch size, runs one-token decode steps of the default model (greedy, drafts off,
end-of-sequence ignored, eager unless --compile) and profiles a window of them with
torch.profiler. Reported per step (medians over the window):

  step_ms        the whole engine step (plan, pass, masks, sampling, update)
  forward_ms     the forward pass as the engine times it
  outside_ms     step_ms - forward_ms: the step's Python (plan, masks, sampling, update)
  aten_share     of the profiled forward, the share inside ATen ops called from Python
                 (top-level ops: their kernels and the dispatch inside them); the rest is
                 the forward's Python between the ops (module calls, argument parsing,
                 tensor wrappers: what a compiled step removes)
  aten_ms        aten_share x forward_ms, and around_ms the rest; per layer too. The
                 profiler adds a cost to every op, so step_ms and forward_ms come from an
                 unprofiled run of the same steps and only the share from the profiled one
  top ops        the ATen ops with the most self time per step (profiled), and their calls

    python bench/step_overhead.py --batch-sizes 1,8 --quantize auto
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--warm-tokens", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48, help="profiled one-token steps")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "step_overhead.json")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from aici_cli.core.config import EngineConfig
    from aici_cli.core.job import Job
    from aici_cli.engine import Engine
    from aici_cli.models.load import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, "cpu", args.dtype, args.quantize)
    layers = int(lm.model.config.num_hidden_layers)

    def jobs(bs: int, n: int) -> list[Job]:
        return [Job(index=i + 1, id=str(i), max_tokens=n, constraint=None, prompt=None,
                    ignore_eos=True,
                    messages=[{"role": "user", "content": f"Tell a story, number {i}."}])
                for i in range(bs)]

    rows: list[dict[str, Any]] = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        engine = Engine(lm, EngineConfig(batch_size=bs, compile=args.compile, draft_tokens=0))
        engine.run(jobs(bs, args.warm_tokens), lambda r: None)  # first-pass costs
        engine.step_times.clear()
        engine.run(jobs(bs, args.tokens), lambda r: None)  # unprofiled: the times
        plain = [s for s in engine.step_times if s.kind == "decode"]
        engine.step_times.clear()
        _label_steps(engine)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.run(jobs(bs, args.tokens), lambda r: None)
        decode = [s for s in engine.step_times if s.kind == "decode"]
        steps = len(decode)
        # ATen ops on the engine's thread within a decode step (the mask worker's, and the
        # prefill step's, are not the one-token step's cost).
        aten = [e for e in prof.events() if e.name.startswith("aten::")
                and _step_of(e) == "step:decode"]
        # Top-level ops: no other ATen op encloses them.
        top_level = [e for e in aten if not _inside_aten(e)]
        profiled_aten = sum(e.cpu_time_total for e in top_level) / 1e3 / max(1, steps)
        share = profiled_aten / statistics.median(s.forward_ms for s in decode)
        by_op: dict[str, list[float]] = {}
        for e in aten:
            by_op.setdefault(e.name, []).append(e.self_cpu_time_total)
        top = sorted(by_op.items(), key=lambda kv: -sum(kv[1]))[: args.top]
        step_ms = statistics.median(s.step_ms for s in plain)
        forward_ms = statistics.median(s.forward_ms for s in plain)
        aten_ms = share * forward_ms
        row = {
            "batch": bs, "quantize": lm.quantize, "compile": args.compile,
            "threads": torch.get_num_threads(), "decode_steps": steps,
            "step_ms": round(step_ms, 2), "forward_ms": round(forward_ms, 2),
            "outside_ms": round(step_ms - forward_ms, 2), "aten_share": round(share, 3),
            "aten_ms": round(aten_ms, 2),
            "around_ms": round(forward_ms - aten_ms, 2),
            "per_layer_aten_us": round(aten_ms / layers * 1e3, 1),
            "per_layer_around_us": round((forward_ms - aten_ms) / layers * 1e3, 1),
            "top_ops": [{"op": name, "self_ms_per_step": round(sum(t) / 1e3 / max(1, steps), 3),
                         "calls_per_step": round(len(t) / max(1, steps), 1)}
                        for name, t in top],
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top_ops"}), flush=True)
        for op in row["top_ops"]:
            print(f"    {op['op']:40} {op['self_ms_per_step']:8.3f} ms/step "
                  f"{op['calls_per_step']:6.1f} calls/step", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _label_steps(engine: Any) -> None:
    """Each step's pass runs inside a profiler range named by its kind."""
    from torch.profiler import record_function

    runner = engine.runner
    execute = runner.execute_model

    def labelled(plan: Any) -> Any:
        with record_function(f"step:{plan.kind}"):
            return execute(plan)

    runner.execute_model = labelled


def _inside_aten(event: Any) -> bool:
    """Whether an ATen op encloses the event, at any depth."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _step_of(event: Any) -> str | None:
    """The step range enclosing a profiler event, if any."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("step:"):
            return str(parent.name)
        parent = parent.cpu_parent
    return None


if __name__ == "__main__":
    sys.exit(main())
