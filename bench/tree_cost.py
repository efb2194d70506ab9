"""What a change costs, through `aici-batch run` as a user runs it: this source tree against
another (`--before DIR`: a checkout of the commit before the change), alternating, on the
same lines, at the run's defaults (or the options after `--`).

Three workloads, each its own process and its summary's figures read back:

- `decode b1` / `decode b8`: 8 plain prompts, 128 tokens each (`ignore_eos`), greedy, at
  `--batch-size 1` and 8: the lines' tok/s (`tokens_per_s`, the run's wall without the load);
- `prefill`: 8 prompts of about 1,000 tokens each, 1 token each, at `--batch-size 8`:
  prompt tokens a second over the lines' wall;
- `short b1`: 32 prompts of about 40 tokens, 1 token each, at `--batch-size 1` (a
  classification eval's shape): prompt tokens a second.

    git worktree add /tmp/before HEAD~1
    python bench/tree_cost.py --before /tmp/before --rounds 3
    python bench/tree_cost.py --before /tmp/before -- --dtype float32

Each tree runs with PYTHONPATH at it (the same virtual environment). The compiled steps
are each tree's own (the packaged step's key covers the code it traces): prepare both
first (`aici-batch prepare`, once from each tree) for figures without builds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_invariance import PLAIN  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORDS = ["river", "stone", "cloud", "planet", "harbour", "lantern", "meadow", "engine",
         "violin", "glacier", "copper", "orchard"]


def decode_lines() -> list[dict[str, Any]]:
    return [{"id": f"d{i}", "prompt": PLAIN[i % len(PLAIN)], "max_tokens": 128,
             "ignore_eos": True} for i in range(8)]


def prefill_lines() -> list[dict[str, Any]]:
    """8 prompts of ~1,000 tokens, each its own words' order (no shared prefix)."""
    out = []
    for i in range(8):
        words = [WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(900)]
        out.append({"id": f"f{i}", "prompt": "Summarise: " + " ".join(words),
                    "max_tokens": 1})
    return out


def short_lines() -> list[dict[str, Any]]:
    return [{"id": f"s{i}", "prompt": "Is this review positive? " + " ".join(
        WORDS[(i + j * 5) % len(WORDS)] for j in range(30)), "max_tokens": 1}
        for i in range(32)]


def run(tree: Path, lines: list[dict[str, Any]], batch: int, extra: list[str],
        folder: Path) -> dict[str, Any]:
    src, stats = folder / "in.jsonl", folder / "stats.json"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = {**os.environ, "PYTHONPATH": str(tree), "AICI_BATCH_STEP_BUILDS": "off"}
    subprocess.run([sys.executable, "-m", "aici_cli", "run", str(src), "-o",
                    str(folder / "out.jsonl"), "--batch-size", str(batch), "--stats-out",
                    str(stats), *extra], env=env, check=False, capture_output=True,
                   cwd=tree)
    return json.loads(stats.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other source tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="options for every run (after --)")
    args = parser.parse_args()
    trees = {"after": REPO, "before": args.before.resolve()}
    work = {"decode b1": (decode_lines(), 1), "decode b8": (decode_lines(), 8),
            "prefill": (prefill_lines(), 8), "short b1": (short_lines(), 1)}
    figures: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, (lines, batch) in work.items():
                for label, tree in (trees.items() if r % 2 == 0 else
                                    reversed(list(trees.items()))):
                    stats = run(tree, lines, batch, args.extra, Path(tmp))
                    value = (stats["tokens_per_s"] if name.startswith("decode")
                             else stats["prompt_tokens"] / stats["wall_s"])
                    figures.setdefault((name, label), []).append(value)
                    print(json.dumps({"round": r, "work": name, "tree": label,
                                      "value": round(value, 1), "dtype": stats["dtype"],
                                      "quantize": stats["quantize"],
                                      "compiled_steps": stats["compiled_steps"],
                                      "eager_steps": stats["eager_steps"]}), flush=True)
    print(f"\n{'work':<10} {'after':>9} {'before':>9} {'after/before':>13}")
    for name in work:
        after = statistics.median(figures[(name, "after")])
        before = statistics.median(figures[(name, "before")])
        unit = "tok/s" if name.startswith("decode") else "prompt tok/s"
        print(f"{name:<10} {after:>9.1f} {before:>9.1f} {after / before:>12.2f}x  ({unit},"
              f" median of {args.rounds})")


if __name__ == "__main__":
    main()
