"""The loop guard's false-positive rate and recall, from the results of a run without it.

Reads results made with `--no-loop-guard --no-close-at-limit` (e.g. by
`bench/coverage_run.py --half held --no-loop-guard --no-close-at-limit`) and replays the
detector (`loops.find_loop`) over every prefix of each output's text, character by
character, as the guard would see it while the value is written:
  false positives  outputs that finished on their own (finish_reason stop) in which the
                   guard would have fired somewhere: the outputs it would have changed;
  recall           outputs cut off at max_tokens in which it fires.

    python bench/loop_guard.py out/coverage/results.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aici_cli.control.grammar.loops import find_loop  # noqa: E402


def first_loop(text: str) -> int | None:
    """The first character count at which the guard would fire, or None."""
    for n in range(1, len(text) + 1):
        if find_loop(text[:n]) is not None:
            return n
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results", type=Path, nargs="+")
    args = ap.parse_args()
    results = [json.loads(x) for p in args.results for x in p.read_text().splitlines() if x]
    stopped = [r for r in results if r["finish_reason"] in ("stop", "tool_calls")]
    cut = [r for r in results if r["finish_reason"] == "length"]
    fired_stopped = [r for r in stopped if first_loop(r["text"]) is not None]
    fired_cut = [r for r in cut if first_loop(r["text"]) is not None]
    print(f"finished on their own: {len(stopped)}; the guard would change "
          f"{len(fired_stopped)} ({len(fired_stopped) / max(1, len(stopped)):.1%})")
    for r in fired_stopped:
        at = first_loop(r["text"]) or 0
        print(f"  {r['id']}: fires at char {at}: ...{r['text'][max(0, at - 60):at]!r}")
    print(f"cut off at max_tokens: {len(cut)}; the guard fires in {len(fired_cut)} "
          f"({len(fired_cut) / max(1, len(cut)):.1%})")
    for r in cut:
        if r not in fired_cut:
            print(f"  missed {r['id']}: ...{r['text'][-80:]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
