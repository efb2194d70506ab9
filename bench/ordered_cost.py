"""What `--ordered` costs: the same lines (lengths drawn from 4..--max-tokens, so short
lines overtake long ones) run as written, in input order of admission only
(`--lookahead 1`), and with `--ordered`; wall time and tokens/s of each, from real
`aici-batch run` processes' `--stats-out` summaries, best of `--repeats`.

    python bench/ordered_cost.py --lines 32 --max-tokens 64 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODES = {"as written": [], "--lookahead 1": ["--lookahead", "1"], "--ordered": ["--ordered"]}


def _run(args: argparse.Namespace, work: Path, extra: list[str]) -> dict[str, Any]:
    stats = work / "stats.json"
    exe = Path(sys.executable).with_name("aici-batch")
    cmd = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else
                                                           ["-m", "aici_cli"]),
           "run", str(work / "in.jsonl"), "-o", str(work / "out.jsonl"), "-q",
           "--threads", str(args.threads), "--batch-size", str(args.batch_size),
           "--stats-out", str(stats), *extra]
    if args.model:
        cmd += ["--model", args.model]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    summary = json.loads(stats.read_text())
    order = [json.loads(line)["index"] for line in (work / "out.jsonl").open()]
    return {"wall_s": summary["wall_s"], "tokens_per_s": summary["tokens_per_s"],
            "in_input_order": order == sorted(order)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lines", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "ordered_cost.json")
    args = ap.parse_args()

    rng = random.Random(0)
    topics = ["the sea", "a city at night", "how bread is made", "a chess opening"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "in.jsonl").write_text("".join(
            json.dumps({"messages": [{"role": "user", "content": f"Write about {topics[i % 4]}."}],
                        "max_tokens": rng.randint(4, args.max_tokens)}) + "\n"
            for i in range(args.lines)))
        for name, extra in MODES.items():
            runs = [_run(args, work, extra) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["wall_s"])
            rows.append({"mode": name, **best})
            print(f"{name:14}: wall {best['wall_s']:6.2f} s, {best['tokens_per_s']:6.1f} tok/s, "
                  f"in input order: {best['in_input_order']}", flush=True)
    base = rows[0]["wall_s"]
    for row in rows:
        row["vs_as_written"] = round(row["wall_s"] / base, 3) if base else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
