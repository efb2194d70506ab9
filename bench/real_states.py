"""The states real models leave a constrained value in: where a loop began, and where the
token limit cut the value, recorded from runs with the loop guard and closing off.

`bench/closing_walk.py` draws its states from random walks; these are the ones models
write (a key repeated inside its own value, a recursive record nesting deeper each cycle,
list items again and again). From each `coverage_run.py` output directory given (a run
with `--no-close-at-limit --no-loop-guard`, on the `tune` half) it keeps, per line:

  loop    the output up to where its first loop began (`loops.find_loop` on each
          prefix: the start of the first unit, the shallow state a close starts from);
  limit   the whole output, where the limit cut it before the value was complete (one
          that did not loop: with the guard on, a loop is closed where it began).

and writes them as JSONL (`schema`, `text`, `kind`, `id`, `model`), the schema inline, so
that a replay needs neither the data nor the model: `closing_walk.py --real FILE`, and
tests/control/grammar/test_closing_walk.py over tests/data/real_states.jsonl.

    python bench/coverage_run.py --half tune --max-tokens 512 --no-close-at-limit \\
        --no-loop-guard --out out/coverage-tune-raw
    python bench/real_states.py out/coverage-tune-raw --out tests/data/real_states.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Prefixes looked at for the first loop: one every this many characters (a loop's span
# is at least loops.MIN_SPAN = 40, so none is missed by more than a step).
STEP = 8


def first_loop_start(text: str) -> int | None:
    """Where the first loop of `text` begins (the start of its first unit), or None."""
    from aici_cli.control.grammar.loops import find_loop

    for end in range(STEP, len(text) + STEP, STEP):
        loop = find_loop(text[:end])
        if loop is not None:
            return min(end, len(text)) - loop.span
    return None


def states_of(run: Path) -> list[dict[str, Any]]:
    schemas = {}
    for line in (run / "prompts.jsonl").read_text().splitlines():
        row = json.loads(line)
        schemas[row["id"]] = row["json_schema"]
    out = []
    for line in (run / "results.jsonl").read_text().splitlines():
        result = json.loads(line)
        text = result.get("text") or ""
        if result.get("id") not in schemas or not text:
            continue
        model = (result.get("made_with") or {}).get("model", "?")
        base = {"id": result["id"], "model": model, "schema": schemas[result["id"]]}
        start = first_loop_start(text)
        if start is not None and start > 0:
            out.append({**base, "kind": "loop", "text": text[:start]})
        # With the guard on, a looping value is closed where its loop began and never
        # reaches the limit: only values that did not loop are recorded there.
        if start is None and result.get("finish_reason") == "length" \
                and result.get("json") is None:
            out.append({**base, "kind": "limit", "text": text})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="coverage_run.py output directories")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--most", type=int, default=60, help="states kept (loops first)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    states = [s for run in args.runs for s in states_of(run)]
    states.sort(key=lambda s: (s["kind"] != "loop", s["id"]))
    kept = states[: args.most]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(s) + "\n" for s in kept))
    loops = sum(s["kind"] == "loop" for s in kept)
    print(f"{len(states)} states ({sum(s['kind'] == 'loop' for s in states)} loops); "
          f"kept {len(kept)} ({loops} loops) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
