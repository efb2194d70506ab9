"""A fresh machine's first minute: runs on an empty cache folder, at the defaults and at
`--compile off`, and the next run on the cache the first left (copied elsewhere, as a CI
job restores it) against a run after `aici-batch prepare`.

Each run is a whole `aici-batch run` in a process of its own, with `AICI_BATCH_CACHE` a
new folder (the model's conversion, its kernels and verdicts made again on each side),
interleaved round by round:

- `defaults`: `--compile auto`, nothing prepared. Where the run starts a builder of the
  compiled steps after its last line (engine/forward/step_builds.py), the bench waits for
  it before the next run (its time is reported, outside the run's wall);
- `off`: `--compile off`;
- `restored`: the `defaults` run's folder, builder done, copied into a fresh one;
- `prepared`: the first round's restored folder after `aici-batch prepare` ran on it
  (outside the timings: it adds the one-row cache's step and checks the rest), copied;
- `demo`: `examples/prompts.jsonl` at the defaults on an empty folder, as `make demo`
  runs it: when its first result came (`first_result_s`, from the process's start).

The eval: the first --lines schemas of Glaiveai2K's tuning half (`data_split.py`), each
asked for as JSON under its schema, --max-tokens 256, --batch-size 8.

    python bench/cold_start.py --lines 64 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GLAIVE = REPO.parent / "shared" / "data" / "jsonschemabench" / "Glaiveai2K"
CLI = [sys.executable, "-m", "aici_cli"]


def eval_lines(n: int, path: Path) -> Path:
    """The first `n` schemas of the tuning half as run lines."""
    spec = importlib.util.spec_from_file_location("data_split", REPO / "bench" / "data_split.py")
    assert spec is not None and spec.loader is not None
    split = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(split)
    schemas = [p for p in sorted(GLAIVE.glob("*.json")) if split.in_half(p, "tune")][:n]
    with path.open("w") as f:
        for p in schemas:
            schema = json.loads(p.read_text())
            ask = f"Produce a JSON object matching this JSON Schema: {json.dumps(schema)}"
            f.write(json.dumps({"id": p.stem, "messages": [{"role": "user", "content": ask}],
                                "json_schema": schema}) + "\n")
    return path


def _builders(cache: Path) -> list[int]:
    """The builder processes of `cache` (by their command and `AICI_BATCH_CACHE`)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if b"step_builder" not in (proc / "cmdline").read_bytes():
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"AICI_BATCH_CACHE={cache}".encode() in env:
            found.append(int(proc.name))
    return found


def wait_for_builder(cache: Path) -> float:
    """Seconds until no builder of `cache` runs (0 where none started): a builder the
    run's engine started outlives it, niced, and would share the cores with the next."""
    started = time.perf_counter()
    time.sleep(1.0)
    while _builders(cache):
        time.sleep(1.0)
    waited = time.perf_counter() - started
    return 0.0 if waited < 1.5 else waited


def run(args: list[str], cache: Path, work: Path) -> dict[str, Any]:
    """One `aici-batch run`: its wall, and its summary's figures."""
    stats = work / "stats.json"
    env = {**os.environ, "AICI_BATCH_CACHE": str(cache)}
    started = time.perf_counter()
    done = subprocess.run([*CLI, "run", *args, "-o", str(work / "out.jsonl"), "-q",
                           "--stats-out", str(stats)], env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - started
    if done.returncode not in (0, 1):
        raise SystemExit(f"run failed: {done.stderr[-2000:]}")
    summary = json.loads(stats.read_text())
    return {"wall_s": round(wall, 2), "load_s": summary.get("load_s"),
            "lines_wall_s": summary.get("wall_s"), "first_result_s": summary.get("first_result_s"),
            "compiled_steps": summary.get("compiled_steps"),
            "eager_steps": summary.get("eager_steps"), "valid": summary.get("valid"),
            "builder_after_s": round(wait_for_builder(cache), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="the figures as JSON")
    opts = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cold-start-"))
    src = eval_lines(opts.lines, root / "eval.jsonl")
    common = [str(src), "--max-tokens", "256", "--batch-size", "8"]
    prepared = root / "prepared"
    rounds: list[dict[str, Any]] = []
    for i in range(opts.rounds):
        work = root / f"round{i}"
        work.mkdir()
        figures: dict[str, Any] = {}
        order = ("defaults", "off") if i % 2 == 0 else ("off", "defaults")
        for side in order:
            cache = work / f"cache-{side}"
            flags = ["--compile", "off"] if side == "off" else []
            figures[side] = run([*common, *flags], cache, work)
        shutil.copytree(work / "cache-defaults", work / "cache-restored", symlinks=True)
        if not prepared.exists():
            shutil.copytree(work / "cache-defaults", prepared, symlinks=True)
            t = time.perf_counter()
            subprocess.run([*CLI, "prepare", "-q"], check=True, capture_output=True,
                           env={**os.environ, "AICI_BATCH_CACHE": str(prepared)})
            print(f"prepare on the restored folder: {time.perf_counter() - t:.1f} s",
                  flush=True)
        figures["restored"] = run(common, work / "cache-restored", work)
        shutil.copytree(prepared, work / "cache-prepared", symlinks=True)
        figures["prepared"] = run(common, work / "cache-prepared", work)
        figures["demo"] = run([str(REPO / "examples" / "prompts.jsonl")], work / "cache-demo",
                              work)
        rounds.append(figures)
        print(json.dumps({"round": i + 1, **figures}), flush=True)
    walls = {side: [r[side]["wall_s"] for r in rounds] for side in rounds[0]}
    med = {side: statistics.median(w) for side, w in walls.items()}
    print(json.dumps({"median_wall_s": med,
                      "defaults_over_off": round(med["defaults"] / med["off"], 3),
                      "restored_over_prepared": round(med["restored"] / med["prepared"], 3),
                      "demo_first_result_s": [r["demo"]["first_result_s"] for r in rounds]}))
    if opts.out is not None:
        opts.out.write_text(json.dumps({"rounds": rounds, "median_wall_s": med}, indent=1))


if __name__ == "__main__":
    main()
