"""`aici-batch report` of a big results file: its wall time and peak memory, and its
figures against the reference's (jsonschema alone checking every line).

    python bench/report_speed.py --lines 100000 --repeats 3

The results are bench/report_data.py's (the example eval run, repeated), written once
to out/. Each repeat is a fresh `aici-batch report FILE --json` process, timed from
start to exit (the interpreter's start and the imports included, as a CI job pays
them); the best and the median are printed with the peak RSS. The reference summary
is computed in this process with jsonschema-rs turned off, and compared figure by
figure with what the command printed: the fast check may only make it faster.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_data import REPO, write_run  # noqa: E402

OUT = REPO / "out"


def _aici_batch() -> list[str]:
    return [sys.executable, "-m", "aici_cli"]


def timed_report(path: Path) -> tuple[float, float, dict[str, Any]]:
    """(seconds, peak RSS in MB, the --json summary) of one `report` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run([*_aici_batch(), "report", str(path), "--json"], check=True,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    # ru_maxrss of the children is the largest any child reached: a fresh process that
    # stays under an earlier one reads as that one's.
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    summary: dict[str, Any] = json.loads(done.stdout)
    return seconds, peak, summary


def reference(path: Path) -> dict[str, Any]:
    """The summary with jsonschema, the reference, deciding every line."""
    from aici_cli.formats import schemas
    from aici_cli.report.summarize import report

    schemas._fast_check.cache_clear()
    sys.modules["jsonschema_rs"] = None  # type: ignore[assignment]  # its import now fails
    try:
        return report(path)
    finally:
        del sys.modules["jsonschema_rs"]
        schemas._fast_check.cache_clear()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the comparison with jsonschema alone (~1 min at 100,000)")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    path = OUT / f"report_run_{args.lines}.jsonl"
    if not path.exists():
        write_run(path, args.lines)
    runs = [timed_report(path) for _ in range(args.repeats)]
    times = [seconds for seconds, _, _ in runs]
    print(f"results: {path.name}, {args.lines:,} lines, {path.stat().st_size / 1e6:.1f} MB")
    print("| what | best s | median s | peak RSS MB |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| aici-batch report --json | {min(times):.2f} | {statistics.median(times):.2f} | "
          f"{max(peak for _, peak, _ in runs):.0f} |")
    if not args.no_reference:
        start = time.perf_counter()
        expected = json.loads(json.dumps(reference(path)))
        print(f"| the reference (jsonschema alone, in process) | "
              f"{time.perf_counter() - start:.2f} | | |")
        same = all(summary == expected for _, _, summary in runs)
        print("figures: the same as the reference's" if same else
              "figures: DIFFERENT from the reference's")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
