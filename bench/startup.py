"""Start to first token and peak memory of a fresh `aici-batch run` of one line and one
token, side by side with other builds of the tool, in one run.

    python bench/startup.py --rounds 5 --quantize int4
    python bench/startup.py --rounds 5 --other /path/to/other/checkout/.venv/bin/aici-batch

Each round runs every executable once, in turn (the machine's load moves between rounds,
so the sides see the same load within one); a round's first run is not warmed apart, so
run once before measuring where caches are cold (a GGUF's conversion, the kept int4
layers). Reports per executable the median wall time from spawn to exit and the median
peak RSS (the child's own `ru_maxrss`, from `wait4`), and each round's figures.
Not a test: timings here are noisy; the ratio within a round is what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(exe: str, line_file: Path, extra: list[str]) -> tuple[float, int]:
    """(seconds from spawn to exit, peak RSS in bytes) of one run."""
    cmd = [exe, "run", str(line_file), "--max-tokens", "1", "-q", *extra]
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        if code not in (0, 1):
            err.seek(0)
            raise SystemExit(f"{exe} failed ({code}): {err.read().decode()[-500:]}")
    return seconds, usage.ru_maxrss * 1024  # kilobytes on Linux


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--other", action="append", default=[],
                    help="another aici-batch executable to run side by side (repeatable)")
    ap.add_argument("--out", type=Path, default=Path("out/startup.json"))
    args = ap.parse_args()
    ours = shutil.which("aici-batch") or str(Path(sys.executable).parent / "aici-batch")
    exes = [ours, *args.other]
    extra = ["--quantize", args.quantize, "--dtype", args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        line_file = Path(tmp) / "one.jsonl"
        line_file.write_text('{"prompt": "Hello"}\n')
        for exe in exes:  # warm: page cache, conversions, kept layers
            one_run(exe, line_file, extra)
        runs: dict[str, list[tuple[float, int]]] = {exe: [] for exe in exes}
        for r in range(args.rounds):
            for exe in exes:
                runs[exe].append(one_run(exe, line_file, extra))
            print(f"round {r + 1}: " + ", ".join(
                f"{exe}: {runs[exe][-1][0]:.2f} s {runs[exe][-1][1] / 2**20:.0f} MiB"
                for exe in exes), flush=True)
    rows = []
    for exe in exes:
        secs = statistics.median(s for s, _ in runs[exe])
        rss = statistics.median(m for _, m in runs[exe]) / 2**20
        rows.append({"exe": exe, "seconds": round(secs, 3), "peak_rss_mib": round(rss, 1),
                     "rounds": [[round(s, 3), round(m / 2**20, 1)] for s, m in runs[exe]]})
        print(f"{exe}: median {secs:.2f} s, peak RSS {rss:.0f} MiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
