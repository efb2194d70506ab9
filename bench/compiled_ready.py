"""How soon the compiled step is ready, and what a short run gains from it.

Three ways to run the same one-stream job (a plain prompt, greedy, `ignore_eos`), each a
whole `aici-batch run` in a process of its own, interleaved round by round:

- `eager`: `--compile off`;
- `packaged`: `--compile auto` with the AOTInductor package already built (the first
  round's `--compile on` builds it when missing, outside the timings);
- `torch.compile`: `--compile on` with the package path switched off, inductor's disk
  cache warm (what `--compile on` did before packages).

For each: the whole run's wall time, the lines' wall time, decode tok/s and step p50
(`--stats-out`). Then, in this process, the packaged step's ready time: building the
decode layers over the loaded model (`DecodeLayer`: q/k/v and gate/up stacked) and loading
the package (torch's C++ loader, the model's weights handed over), each timed.

    python bench/compiled_ready.py --tokens 128 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# `--compile on` as before packages: the packaged step never loads or builds.
NO_PACKAGE = ("import sys; from aici_cli.engine.forward import compiled; "
              "compiled.CompiledDecode._packaged = lambda *a: None; "
              "from aici_cli.cli.main import main; sys.argv[0] = 'aici-batch'; main()")


def run(kind: str, job: Path, tmp: Path, extra: list[str]) -> dict[str, Any]:
    stats = tmp / f"{kind}.stats.json"
    args = ["run", str(job), "-o", str(tmp / f"{kind}.jsonl"), "--stats-out", str(stats),
            *extra]
    if kind == "eager":
        cmd = [sys.executable, "-m", "aici_cli", *args, "--compile", "off"]
    elif kind == "packaged":
        cmd = [sys.executable, "-m", "aici_cli", *args, "--compile", "auto"]
    else:
        cmd = [sys.executable, "-c", NO_PACKAGE, *args, "--compile", "on"]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
    wall = time.perf_counter() - started
    summary = json.loads(stats.read_text())
    step = summary.get("steps", {}).get("step_ms", {})
    return {"wall_s": wall, "lines_s": summary.get("wall_s"),
            "tok_s": summary.get("tokens_per_s"), "compiled_steps": summary.get("compiled_steps"),
            "step_p50_ms": step.get("p50")}


def ready_time(extra: list[str]) -> dict[str, float]:
    """The packaged step's ready time in this process, over a loaded default model."""
    sys.path.insert(0, str(REPO))  # this checkout's aici_cli, as the runs above import
    import torch

    from aici_cli.engine.forward import packaged_step
    from aici_cli.engine.forward.decode_layer import DecodeLayer
    from aici_cli.models import load_model

    quantize = extra[extra.index("--quantize") + 1] if "--quantize" in extra else "auto"
    lm = load_model(None, quantize=quantize)
    t0 = time.perf_counter()
    layers = [DecodeLayer(layer, lm.model.config) for layer in lm.model.model.layers]
    t1 = time.perf_counter()
    step = packaged_step.load(packaged_step.package_file(lm.model, 1, 8), layers)
    t2 = time.perf_counter()
    assert step is not None, "no package: run with --compile on first"
    del torch
    return {"decode_layers_s": t1 - t0, "package_load_s": t2 - t1, "ready_s": t2 - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantize", default=None, help="as `run --quantize` (default: auto)")
    args = ap.parse_args()
    extra = ["--quantize", args.quantize] if args.quantize else []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        job = tmp / "one.jsonl"
        job.write_text(json.dumps({"id": "one", "prompt": "Once upon a time",
                                   "max_tokens": args.tokens, "ignore_eos": True}) + "\n")
        # Builds the package where it is missing (not timed).
        subprocess.run([sys.executable, "-m", "aici_cli", "run", str(job), "-o",
                        str(tmp / "build.jsonl"), "--compile", "on", *extra], check=True,
                       cwd=REPO, capture_output=True)
        rows: dict[str, list[dict[str, Any]]] = {"eager": [], "packaged": [],
                                                 "torch.compile": []}
        for _ in range(args.rounds):
            for kind in rows:
                rows[kind].append(run(kind, job, tmp, extra))
    print(f"one stream, {args.tokens} tokens, medians of {args.rounds} interleaved rounds")
    print("| step | whole run s | lines s | tok/s | step p50 ms | compiled steps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind, runs in rows.items():
        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[key] or 0.0 for r in runs)
        print(f"| {kind} | {med('wall_s'):.2f} | {med('lines_s'):.2f} | {med('tok_s'):.1f} | "
              f"{med('step_p50_ms'):.2f} | {runs[-1]['compiled_steps']} |")
    ready = [ready_time(extra) for _ in range(3)]
    print("packaged step ready (median of 3): " + ", ".join(
        f"{k} {statistics.median(r[k] for r in ready):.3f}" for k in ready[0]))


if __name__ == "__main__":
    main()
