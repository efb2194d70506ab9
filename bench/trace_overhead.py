"""What host-side tracing costs: the engine's hooks with tracing off, and a run with
`--trace FILE` on, side by side on the same lines.

  1. the no-op hooks alone (tracing off): ns per call of each hook, and per step;
  2. the hooks that run often with tracing on (a step's span, a guest call's);
  3. end to end, tracing off against on (and, with it on, the time spent inside the
     tracer's hooks: its own cost, which a shared machine's noise does not blur),
     without a controller (spans: run, lines, steps) and with a wasm controller (a WAT
     guest answering `sample(all)`: one `mid-process` span per token); modes alternate
     within each repeat so that drift hits both alike.

    python bench/trace_overhead.py --model default --lines 32 --max-tokens 64 --repeats 3
    python bench/trace_overhead.py --model tiny --lines 64 --max-tokens 32

`tiny` is the tests' random 2-layer model (steps of a few ms: the worst case for a
per-step cost); `default` is SmolLM2-135M. Results land in out/trace_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))  # tiny_model.py, wat.py


def hook_costs() -> dict[str, float]:
    """ns per call of each no-op hook (what the engine pays with tracing off)."""
    from aici_cli.engine import NO_TRACE

    n = 200_000
    gens: list[Any] = [None] * 8

    def admission() -> None:
        with NO_TRACE.admission(None):  # type: ignore[arg-type]
            pass

    calls = {
        "step": lambda: NO_TRACE.step(None, None, gens),  # type: ignore[arg-type]
        "first_token": lambda: NO_TRACE.first_token(None),  # type: ignore[arg-type]
        "admitted": lambda: NO_TRACE.admitted(None),  # type: ignore[arg-type]
        "admission": admission,
        "empty lambda (baseline)": lambda: None,
    }
    return {name: min(timeit.repeat(f, number=n, repeat=5)) / n * 1e9
            for name, f in calls.items()}


def traced_hook_costs(tmp: Path) -> dict[str, float]:
    """µs per call of the hooks that run often with tracing on (a real `RunTracer`
    writing to a file): a step serving 8 lines, a guest call's span."""
    from types import SimpleNamespace

    from aici_cli.core.config import RunConfig
    from aici_cli.core.line_stats import StepTimes
    from aici_cli.core.sampling import Sampling
    from aici_cli.engine import StepClock
    from aici_cli.run.tracing import open_tracing

    tracer = open_tracing(RunConfig(input="-", trace=str(tmp / "hooks.jsonl")))
    assert tracer is not None
    jobs = [SimpleNamespace(index=i, id=str(i), messages=None, max_tokens=8,
                            sampling=Sampling(), stop=(), n=1, constraint=None)
            for i in range(8)]
    gens: list[Any] = [SimpleNamespace(job=j, sample=0, started=time.perf_counter(),
                                       controller=None) for j in jobs]
    for g in gens:
        tracer.admitted(g)
    clock = StepClock()
    clock.mark("committed")
    times = StepTimes(kind="decode", rows=8, tokens=8)
    call = tracer._call_trace(tracer.lines[0])
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        tracer.step(clock, times, gens)
    step_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        call("mid-process", t0, t0)
    call_us = (time.perf_counter() - t0) / n * 1e6
    tracer.close()
    return {"step (8 lines linked)": step_us, "guest call span": call_us}


def instrument_tracer() -> dict[str, float]:
    """Time spent inside the tracer's hooks on the engine's threads (step spans, line spans,
    guest-call spans), summed into the returned dict's "s": tracing's own cost, apart from
    the noise of a shared machine. (The export thread's encoding is not in it.)"""
    from aici_cli.run import tracing

    spent = {"s": 0.0}

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - t0
        return wrapper

    for name in ("step", "admitted", "first_token", "_finished"):
        setattr(tracing.RunTracer, name, timed(getattr(tracing.RunTracer, name)))
    make_call = tracing.RunTracer._call_trace
    tracing.RunTracer._call_trace = lambda self, line: timed(make_call(self, line))  # type: ignore[method-assign]
    return spent


def run_once(model: str | None, dtype: str, inp: Path, work: Path, controller: Path | None,
             trace: bool, spent: dict[str, float]) -> dict[str, Any]:
    from aici_cli.core.config import EngineConfig, JobDefaults, RunConfig
    from aici_cli.run.batch import run_batch

    trace_file = work / "trace.jsonl" if trace else None
    config = RunConfig(input=str(inp), output=str(work / "out.jsonl"), model=model,
                       device="cpu", dtype=dtype, quiet=True,
                       engine=EngineConfig(batch_size=8),
                       defaults=JobDefaults(),
                       controller=str(controller) if controller else None,
                       trace=str(trace_file) if trace_file else None)
    spent["s"] = 0.0
    t0 = time.perf_counter()
    outcome = run_batch(config)
    wall = time.perf_counter() - t0
    s = outcome.summary
    spans = 0
    if trace_file is not None:
        for line in trace_file.read_text().splitlines():
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    spans += len(ss["spans"])
    return {"wall_s": wall, "engine_wall_s": s["wall_s"], "tokens_per_s": s["tokens_per_s"],
            "forward_passes": s["forward_passes"], "step_ms_mean": s["steps"]["step_ms"]["mean"],
            "step_ms_p50": s["steps"]["step_ms"]["p50"], "output_tokens": s["output_tokens"],
            "spans": spans, "hook_s": round(spent["s"], 4),
            "hook_pct_of_engine_wall": round(100 * spent["s"] / s["wall_s"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' or a --model value ('default')")
    ap.add_argument("--lines", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "out" / "trace_overhead.json"))
    args = ap.parse_args()

    hooks = hook_costs()
    print("no-op hooks (tracing off), ns per call:")
    for name, ns in hooks.items():
        print(f"  {name:<24} {ns:7.1f}")

    with tempfile.TemporaryDirectory(prefix="trace-bench-") as tmp_name:
        tmp = Path(tmp_name)
        traced = traced_hook_costs(tmp)
        spent = instrument_tracer()
        print("hooks with tracing on, µs per call:")
        for name, us in traced.items():
            print(f"  {name:<24} {us:7.1f}")
        if args.model == "tiny":
            from tiny_model import build_tiny_model

            model, dtype = str(build_tiny_model(tmp / "tiny")), "float32"
        else:
            model, dtype = (None if args.model == "default" else args.model), "bfloat16"
        inp = tmp / "in.jsonl"
        inp.write_text("".join(json.dumps({"prompt": f"Line {i}: tell me about number {i}.",
                                           "max_tokens": args.max_tokens}) + "\n"
                               for i in range(args.lines)))
        from wat import Guest, component, save

        wasm = save(tmp, component(Guest("(call $sample-all)")))
        results: dict[str, list[dict[str, Any]]] = {}
        modes = [("plain", None, False), ("plain+trace", None, True),
                 ("wasm", wasm, False), ("wasm+trace", wasm, True)]
        run_once(model, dtype, inp, tmp, None, False, spent)  # warm: load, compile
        run_once(model, dtype, inp, tmp, wasm, False, spent)
        for _ in range(args.repeats):
            for name, controller, trace in modes:
                work = tmp / name
                work.mkdir(exist_ok=True)
                r = run_once(model, dtype, inp, work, controller, trace, spent)
                results.setdefault(name, []).append(r)

    table = {}
    for name, runs in results.items():
        table[name] = {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
    for base in ("plain", "wasm"):
        off, on = table[base], table[f"{base}+trace"]
        on["overhead_step_mean_pct"] = round(
            100 * (on["step_ms_mean"] / off["step_ms_mean"] - 1), 2)
        on["overhead_engine_wall_pct"] = round(
            100 * (on["engine_wall_s"] / off["engine_wall_s"] - 1), 2)
    print(f"\n{args.lines} lines x {args.max_tokens} tokens, model {args.model}, batch 8, "
          f"median of {args.repeats}:")
    cols = ["engine_wall_s", "step_ms_mean", "forward_passes", "spans", "hook_s",
            "hook_pct_of_engine_wall", "overhead_engine_wall_pct"]
    print(f"  {'mode':<12}" + "".join(f"{c:>25}" for c in cols))
    for name, row in table.items():
        print(f"  {name:<12}" + "".join(f"{row.get(c, ''):>25}" for c in cols))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "hooks_ns": hooks,
                               "traced_hooks_us": traced, "runs": results,
                               "median": table}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
