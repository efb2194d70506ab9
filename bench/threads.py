"""`--threads` under a competing load: forward-step time and tokens/s with each thread
count, on an idle CPU and beside busy processes (a CI runner running jobs side by side).

Each configuration is a real `aici-batch run` subprocess (its own torch thread pool, as
a user gets it), on the same lines; the figures come from its `--stats-out` summary. The
competing load is `--busy` processes spinning in pure Python, started before the run and
stopped after it.

    python bench/threads.py --threads 1,2 --busy 0,1 --lines 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _spin() -> None:
    while True:
        pass


def _run(args: argparse.Namespace, threads: int, work: Path, busy: int) -> dict[str, Any]:
    stats = work / f"stats-{busy}-{threads}.json"
    exe = Path(sys.executable).with_name("aici-batch")
    cmd = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else
                                                           ["-m", "aici_cli"]),
           "run", str(work / "in.jsonl"), "-o", str(work / "out.jsonl"), "-q",
           "--threads", str(threads), "--batch-size", str(args.batch_size),
           "--max-tokens", str(args.max_tokens), "--stats-out", str(stats)]
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    if done.returncode != 0 or not stats.exists():
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    summary = json.loads(stats.read_text())
    return {"threads": threads, "process_s": round(time.perf_counter() - t0, 2),
            "forward_ms_p50": summary["steps"]["forward_ms"]["p50"],
            "step_ms_p50": summary["steps"]["step_ms"]["p50"],
            "tokens_per_s": summary["tokens_per_s"], "wall_s": summary["wall_s"],
            "load_s": summary["load_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="thread counts to compare")
    ap.add_argument("--busy", default="0,1", help="competing busy processes, per row")
    ap.add_argument("--lines", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "threads.json")
    args = ap.parse_args()

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        topics = ["the sea", "a city at night", "how bread is made", "a chess opening"]
        (work / "in.jsonl").write_text("".join(
            json.dumps({"messages": [{"role": "user",
                                      "content": f"Write about {topics[i % 4]}."}]}) + "\n"
            for i in range(args.lines)))
        for busy in (int(b) for b in args.busy.split(",")):
            spinners = [multiprocessing.Process(target=_spin, daemon=True)
                        for _ in range(busy)]
            for p in spinners:
                p.start()
            try:
                for threads in (int(t) for t in args.threads.split(",")):
                    row = {"busy": busy, **_run(args, threads, work, busy)}
                    rows.append(row)
                    print(f"busy {busy}  --threads {threads}: forward p50 "
                          f"{row['forward_ms_p50']:7.1f} ms, step p50 {row['step_ms_p50']:7.1f}"
                          f" ms, {row['tokens_per_s']:6.1f} tok/s, wall {row['wall_s']:.1f} s",
                          flush=True)
            finally:
                for p in spinners:
                    p.terminate()
                    p.join()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"loadavg_at_end": os.getloadavg(), "rows": rows}, indent=2)
                        + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
