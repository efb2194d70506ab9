"""Throughput of a Ray run with 1 and 2 workers against the local run, on the same input.

Each configuration is one `aici-batch run` over the same lines, in a process of its own:
locally with every core, then with `--ray auto` (a local Ray instance of its own) and W
workers, each reserved `cores / W` CPUs (`--cpus-per-worker`: Ray's `num_cpus` and as many
torch threads), so the workers split the machine instead of fighting over it. Reported
per configuration: output tokens/s over the run (models already loaded), the start-up
before it (Ray, workers loading the model), and the driver's own cost per line (from a
result leaving its worker to its line written, transfer included: the summary's
`ray.driver_ms_per_line`).

    python bench/ray_scaling.py --lines 32 --max-tokens 64 --workers 1,2 --repeats 2

Needs the `ray` extra. On a machine of C cores the workers share those C cores, so the
total cannot exceed the local run's; what it shows is the cost of the distribution.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TOPICS = ["the sea", "a city at night", "how bread is made", "a chess opening",
          "the history of maps", "a walk in the rain", "how a compiler works"]


def write_input(path: Path, lines: int, max_tokens: int) -> None:
    rng = random.Random(0)
    path.write_text("".join(json.dumps({
        "id": f"l{i}",
        "messages": [{"role": "user", "content": f"Write about {TOPICS[i % len(TOPICS)]}."}],
        "max_tokens": rng.randint(max_tokens // 4, max_tokens),
    }) + "\n" for i in range(lines)))


def run(src: Path, work: Path, name: str, args: argparse.Namespace,
        workers: int | None, cores: int) -> dict[str, Any]:
    """One `aici-batch run` in a process of its own (with --ray auto it starts, and
    stops, its own local Ray instance), as a user runs it."""
    stats = work / f"{name}.stats.json"
    cmd = [sys.executable, "-m", "aici_cli", "run", str(src), "-o", str(work / f"{name}.jsonl"),
           "--device", "cpu", "--dtype", args.dtype, "--batch-size", str(args.batch_size),
           "--stats-out", str(stats), "-q"]
    if args.model:
        cmd += ["--model", args.model]
    if workers is not None:
        cmd += ["--ray", "auto", "--workers", str(workers),
                "--cpus-per-worker", f"{cores / workers:g}"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    total = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}")
    summary = json.loads(stats.read_text())
    row: dict[str, Any] = {
        "config": name, "lines": summary["lines"], "errors": summary["errors"],
        "output_tokens": summary["output_tokens"], "run_s": summary["wall_s"],
        "tokens_per_s": summary["tokens_per_s"], "startup_s": round(total - summary["wall_s"], 2),
    }
    if "ray" in summary:
        row["driver_ms_per_line"] = summary["ray"]["driver_ms_per_line"]
        row["workers"] = [{k: w[k] for k in ("worker", "lines", "tokens_per_s")}
                          for w in summary["ray"]["workers"]]
    return row


def _print(row: dict[str, Any], repeat: int) -> None:
    overhead = row.get("driver_ms_per_line")
    extra = (f", driver {overhead['p50']:.2f} / {overhead['p99']:.2f} ms per line "
             "(p50 / p99)" if overhead else "")
    print(f"#{repeat + 1} {row['config']:8}: {row['tokens_per_s']:7.1f} tok/s over "
          f"{row['run_s']:6.1f} s (+{row['startup_s']:.1f} s start-up){extra}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lines", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", default="1,2", help="worker counts to run, e.g. 1,2")
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved; the best counts")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "ray_scaling.json")
    args = ap.parse_args()

    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = work / "in.jsonl"
        write_input(src, args.lines, args.max_tokens)
        configs: list[tuple[str, int | None]] = [("local", None)]
        configs += [(f"ray x{w}", int(w)) for w in args.workers.split(",")]
        best: dict[str, dict[str, Any]] = {}
        # Interleaved repeats, best of each: a shared machine's load comes and goes.
        for repeat in range(args.repeats):
            for name, workers in configs:
                row = run(src, work, name.replace(" ", ""), args, workers, cores)
                row["config"] = name
                _print(row, repeat)
                if name not in best or row["tokens_per_s"] > best[name]["tokens_per_s"]:
                    best[name] = row
        rows = [best[name] for name, _ in configs]
    local = rows[0]["tokens_per_s"]
    for row in rows[1:]:
        row["vs_local"] = round(row["tokens_per_s"] / local, 3) if local else None
        print(f"best {row['config']:8}: {row['tokens_per_s']:7.1f} tok/s, "
              f"{row['vs_local']:.2f}x the local run", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cores": cores, "lines": args.lines,
                                    "repeats": args.repeats,
                                    "max_tokens": args.max_tokens,
                                    "batch_size": args.batch_size, "rows": rows},
                                   indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
