"""What wasm controllers cost, measured side by side in one run, Python and JavaScript guests.

  1. build time and size of a componentize-py and a componentize-js component
     (`aici-batch build x.py` / `x.js`);
  2. wasmtime compile time, cold (empty cache) and cached (deserialized from disk);
  3. per-sequence instantiation (Store + instance + constructor);
  4. p50/p99 of one trivial guest call (`sample(all)`): Python, JavaScript and WAT guests;
  5. end-to-end tokens/s of a segment-based wasm controller (Python and JavaScript) against
     the built-in JSON-schema controller on the same prompts and schemas (ratio near 1.0).

    python bench/controller_costs.py --schemas 16 --max-tokens 256 --repeats 2
    python bench/controller_costs.py --schemas 0      # 1-4 only (no model)

The JavaScript guest is skipped, with the reason, where its toolchain is not installed
(`make setup` or `npm ci --prefix controllers/js`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "jsonschemabench" / "Glaiveai2K"


class NullServices:
    """Host services for timing guest calls alone (no tokenizer work is asked of them)."""

    def vocab_size(self) -> int:
        return 49152

    def eos_token(self) -> int:
        return 2

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(t % 256) for t in tokens)

    def token_bytes(self, token: int) -> bytes:
        return bytes([token % 256])

    def tokens_matching(self, pattern: str) -> int:
        return 0

    def has_host_set(self, handle: int) -> bool:
        return False


def pct(values: list[float], q: float) -> float:
    from aici_cli.run.tally import percentile

    return round(percentile(values, q), 4)


def time_calls(components: dict[str, Any], arg: str, n: int, block: int = 100
               ) -> dict[str, list[float]]:
    """Each component's trivial call timed `n` times, in interleaved blocks of `block` calls
    so that every guest sees the same machine load (the figures are side by side)."""
    from aici_cli.control.actions import StepInput

    runners = {}
    for name, component in components.items():
        runners[name] = component.instantiate(arg, [1, 2, 3], NullServices())
        runners[name].mid_process(StepInput())
    times: dict[str, list[float]] = {name: [] for name in components}
    for start in range(0, n, block):
        for name, runner in runners.items():
            for i in range(start, min(n, start + block)):
                t0 = time.perf_counter()
                runner.mid_process(StepInput(tokens=(5 + i % 100,)))
                times[name].append((time.perf_counter() - t0) * 1000)
    for runner in runners.values():
        runner.close()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--schemas", type=int, default=16, help="0: skip the end-to-end runs")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "controller_costs")
    args = ap.parse_args()

    from aici_cli.control.componentize import build_controller
    from aici_cli.control.componentize.js import toolchain_problem
    from aici_cli.control.wasm import ControllerComponent

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    guests = {"python": ".py", "js": ".js"}
    js_problem = toolchain_problem()
    if js_problem is not None:
        print(f"skipping the JavaScript guest: {js_problem}", file=sys.stderr)
        report["js_skipped"] = js_problem
        del guests["js"]

    built: dict[str, dict[str, Path]] = {}
    report["build"] = {}
    for guest, suffix in guests.items():
        built[guest] = {}
        report["build"][guest] = {}
        for name in ("sample_all", "schema_segment"):
            res = build_controller(REPO / "bench" / "controllers" / f"{name}{suffix}",
                                   args.out / f"{name}_{guest}.wasm")
            built[guest][name] = res.out
            report["build"][guest][name] = {"seconds": round(res.seconds, 2),
                                            "mb": round(res.size / 1e6, 1)}

    report["compile_s"], report["instantiate_ms"] = {}, {}
    components: dict[str, Any] = {}
    for guest in guests:
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            ControllerComponent.load(built[guest]["sample_all"], cache_dir=Path(cache))
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            component = ControllerComponent.load(built[guest]["sample_all"],
                                                 cache_dir=Path(cache))
            cached = time.perf_counter() - t0
        report["compile_s"][guest] = {"cold": round(cold, 3), "cached": round(cached, 3)}
        components[f"{guest}_guest"] = component

    inst: dict[str, list[float]] = {guest: [] for guest in guests}
    for _ in range(20):  # interleaved, as the calls below
        for guest in guests:
            t0 = time.perf_counter()
            components[f"{guest}_guest"].instantiate("", [1, 2, 3], NullServices()).close()
            inst[guest].append((time.perf_counter() - t0) * 1000)
    report["instantiate_ms"] = {g: {"p50": pct(v, 50), "p99": pct(v, 99)} for g, v in inst.items()}

    sys.path.insert(0, str(REPO / "tests" / "support"))
    from wat import Guest, component, save  # the tests' WAT guests

    components["wat_guest"] = ControllerComponent.load(
        save(args.out, component(Guest("(call $sample-all)")))
    )
    calls = time_calls(components, "", args.calls)
    report["trivial_call_ms"] = {
        name: {"p50": pct(v, 50), "p99": pct(v, 99)} for name, v in calls.items()
    }

    if args.schemas > 0:
        end_to_end(args, {g: built[g]["schema_segment"] for g in guests}, report)
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


def end_to_end(args: argparse.Namespace, segment_wasm: dict[str, Path],
               report: dict[str, Any]) -> None:
    """The built-in JSON-schema controller against each guest's one-segment controller."""
    from aici_cli.core.config import EngineConfig, JobDefaults, RunConfig
    from aici_cli.run.batch import run_batch

    files = sorted(DATA.glob("*.json"))[: args.schemas]
    schemas = [json.loads(f.read_text()) for f in files]
    builtin_in = args.out / "builtin.jsonl"
    wasm_in = args.out / "wasm.jsonl"
    with builtin_in.open("w") as b, wasm_in.open("w") as w:
        for f, s in zip(files, schemas):
            msg = [{"role": "user", "content": f"Produce a JSON object matching: {json.dumps(s)}"}]
            b.write(json.dumps({"id": f.stem, "messages": msg, "json_schema": s}) + "\n")
            w.write(json.dumps({"id": f.stem, "messages": msg,
                                "controller_arg": json.dumps(s)}) + "\n")

    kinds = ["builtin", *(f"wasm_{g}" for g in segment_wasm)]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    engine = EngineConfig(batch_size=args.batch_size)
    defaults = JobDefaults(max_tokens=args.max_tokens)
    for _ in range(args.repeats):
        for kind in kinds:
            wasm = segment_wasm.get(kind.removeprefix("wasm_"))
            config = RunConfig(
                input=str(builtin_in if wasm is None else wasm_in),
                output=str(args.out / f"{kind}.results.jsonl"),
                engine=engine, defaults=defaults, quiet=True,
                controller=None if wasm is None else str(wasm),
            )
            runs[kind].append(run_batch(config).summary)
    tps = {k: [s["tokens_per_s"] for s in v] for k, v in runs.items()}
    report["end_to_end"] = {
        k: {"tokens_per_s_median": statistics.median(v), "min": min(v), "max": max(v),
            "output_tokens": runs[k][0]["output_tokens"],
            "forward_passes": runs[k][0]["forward_passes"]}
        for k, v in tps.items()
    }
    builtin = statistics.median(tps["builtin"])
    report["wasm_over_builtin"] = {
        k.removeprefix("wasm_"): round(statistics.median(tps[k]) / builtin, 3) for k in kinds[1:]
    }


if __name__ == "__main__":
    sys.exit(main())
