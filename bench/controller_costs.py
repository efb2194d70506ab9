"""What wasm controllers cost, measured side by side in one run.

  1. build time and size of a componentize-py component (`aici-batch build`);
  2. wasmtime compile time, cold (empty cache) and cached (deserialized from disk);
  3. per-sequence instantiation (Store + instance + constructor);
  4. p50/p99 of one trivial guest call (`sample(all)`), Python guest and WAT guest;
  5. end-to-end tokens/s of a segment-based wasm controller against the built-in
     JSON-schema controller on the same prompts and schemas (ratio should be near 1.0).

    python bench/controller_costs.py --schemas 16 --max-tokens 256 --repeats 2
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
    from aici_cli.stats import percentile

    return round(percentile(values, q), 4)


def time_calls(component: Any, arg: str, n: int) -> list[float]:
    from aici_cli.control.actions import StepInput

    runner = component.instantiate(arg, [1, 2, 3], NullServices())
    runner.mid_process(StepInput())
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        runner.mid_process(StepInput(tokens=(5 + i % 100,)))
        times.append((time.perf_counter() - t0) * 1000)
    runner.close()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--schemas", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "controller_costs")
    args = ap.parse_args()

    from aici_cli.config import EngineConfig, JobDefaults, RunConfig
    from aici_cli.control.build import build_controller
    from aici_cli.control.wasm import ControllerComponent
    from aici_cli.runner import run_batch

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}

    built = {}
    for name in ("sample_all", "schema_segment"):
        res = build_controller(REPO / "bench" / "controllers" / f"{name}.py",
                               args.out / f"{name}.wasm")
        built[name] = res.out
        report[f"build_{name}"] = {"seconds": round(res.seconds, 2), "mb": round(res.size / 1e6, 1)}

    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        ControllerComponent.load(built["sample_all"], cache_dir=Path(cache))
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        component = ControllerComponent.load(built["sample_all"], cache_dir=Path(cache))
        cached = time.perf_counter() - t0
    report["compile_s"] = {"cold": round(cold, 3), "cached": round(cached, 3)}

    inst = []
    for _ in range(20):
        t0 = time.perf_counter()
        component.instantiate("", [1, 2, 3], NullServices()).close()
        inst.append((time.perf_counter() - t0) * 1000)
    report["instantiate_ms"] = {"p50": pct(inst, 50), "p99": pct(inst, 99)}

    py_calls = time_calls(component, "", args.calls)
    sys.path.insert(0, str(REPO / "tests"))
    from wat import Guest, component, save  # the tests' WAT guests

    wat = ControllerComponent.load(save(args.out, component(Guest("(call $sample-all)"))))
    wat_calls = time_calls(wat, "", args.calls)
    report["trivial_call_ms"] = {
        "python_guest": {"p50": pct(py_calls, 50), "p99": pct(py_calls, 99)},
        "wat_guest": {"p50": pct(wat_calls, 50), "p99": pct(wat_calls, 99)},
    }

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

    runs: dict[str, list[dict[str, Any]]] = {"builtin": [], "wasm": []}
    engine = EngineConfig(batch_size=args.batch_size)
    defaults = JobDefaults(max_tokens=args.max_tokens)
    for _ in range(args.repeats):
        for kind in ("builtin", "wasm"):
            config = RunConfig(
                input=str(builtin_in if kind == "builtin" else wasm_in),
                output=str(args.out / f"{kind}.results.jsonl"),
                engine=engine, defaults=defaults, quiet=True,
                controller=str(built["schema_segment"]) if kind == "wasm" else None,
            )
            runs[kind].append(run_batch(config).summary)
    tps = {k: [s["tokens_per_s"] for s in v] for k, v in runs.items()}
    report["end_to_end"] = {
        k: {"tokens_per_s_median": statistics.median(v), "min": min(v), "max": max(v),
            "output_tokens": runs[k][0]["output_tokens"],
            "forward_passes": runs[k][0]["forward_passes"]}
        for k, v in tps.items()
    }
    report["wasm_over_builtin"] = round(
        statistics.median(tps["wasm"]) / statistics.median(tps["builtin"]), 3
    )
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
