"""Whether a line's text depends on how it was run, through `aici-batch run` as a user runs
it: the same 24 greedy lines (12 dev-half Glaive schemas of `bench/data_split.py`, 12 plain
prompts) at `--batch-size 1`, at `--batch-size 8`, on a local Ray cluster of 2 workers, and
killed with SIGKILL after a few results and then `--resume`d, each at the run's defaults
(or the options after `--`). Every run is compared with the batch-1 run line by line (text
and finish reason) and its tok/s printed, so a change's cost and what it fixes read off one
table.

    python bench/line_independence.py                       # the four runs, 128 tokens
    python bench/line_independence.py --runs b1,b8 --max-tokens 64
    python bench/line_independence.py -- --dtype float32 --quantize none

Each run is a process of its own (a Ray run starts its own local cluster); `--cache`
gives every run that folder as AICI_BATCH_CACHE (default: the user's cache, so prepared
compiled steps are used as a user's runs would use them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_invariance import PLAIN  # noqa: E402
from data_split import in_half  # noqa: E402
from determinism import DATA, short_request  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "aici_cli"]
RUNS = ("b1", "b8", "ray2", "resume")


def lines(n: int, max_tokens: int) -> list[dict[str, Any]]:
    """n dev-half Glaive schemas (by file name) and n plain prompts, greedy."""
    files = sorted(p for p in DATA.glob("*.json") if in_half(p, "tune"))[:n]
    out = [{"id": f"g{i}", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": short_request(p.stem)}],
            "json_schema": json.loads(p.read_text())} for i, p in enumerate(files)]
    out += [{"id": f"p{i}", "max_tokens": max_tokens,
             "messages": [{"role": "user", "content": PLAIN[i % len(PLAIN)]}]}
            for i in range(n)]
    return out


def read(path: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[r["id"]] = r
    return out


def run(name: str, src: Path, folder: Path, extra: list[str], env: dict[str, str]
        ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """One run: its results by id and its summary (`--stats-out`)."""
    out, stats = folder / f"{name}.jsonl", folder / f"{name}.stats.json"
    base = [*CLI, "run", str(src), "-o", str(out), "--stats-out", str(stats), *extra]
    if name == "b1":
        cmd = [*base, "--batch-size", "1"]
    elif name == "b8":
        cmd = [*base, "--batch-size", "8"]
    elif name == "ray2":
        cmd = [*base, "--batch-size", "8", "--ray", "auto", "--workers", "2",
               "--cpus-per-worker", "1"]
    else:
        cmd = [*base, "--batch-size", "8"]
        kept = _killed_after(cmd, out, env, results=6)
        cmd = [*cmd, "--resume"]
    subprocess.run(cmd, env=env, check=False, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    summary = json.loads(stats.read_text()) if stats.is_file() else {}
    if name == "resume":
        summary["before_resume"] = kept
    return read(out), summary


def _killed_after(cmd: list[str], out: Path, env: dict[str, str], results: int) -> int:
    """Start `cmd` and SIGKILL its process group once `out` holds `results` lines: the
    whole lines it held then."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    while proc.poll() is None:
        if out.is_file() and out.read_text().count("\n") >= results:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    return out.read_text().count("\n") if out.is_file() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lines", type=int, default=12, help="schemas, and as many plain prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"of {', '.join(RUNS)}")
    ap.add_argument("--cache", default=None, help="AICI_BATCH_CACHE for every run")
    ap.add_argument("--json", default=None, help="write the comparison here")
    ap.add_argument("extra", nargs="*", help="options for every run (after --)")
    args = ap.parse_args()
    env = {**os.environ, "AICI_BATCH_STEP_BUILDS": "off"}
    if args.cache:
        env["AICI_BATCH_CACHE"] = args.cache
    names = [r for r in args.runs.split(",") if r]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        src = folder / "lines.jsonl"
        src.write_text("".join(json.dumps(x) + "\n" for x in lines(args.lines,
                                                                   args.max_tokens)))
        got = {name: run(name, src, folder, args.extra, env) for name in names}
    reference, _ = got[names[0]]
    table = {}
    print(f"{'run':8} {'lines':>5} {'differ':>6} {'tok/s':>7}  first differing")
    for name in names:
        results, summary = got[name]
        differ = sorted(k for k, r in reference.items()
                        if k not in results or (results[k]["text"], results[k]["finish_reason"])
                        != (r["text"], r["finish_reason"]))
        workers = len((summary.get("ray") or {}).get("workers") or [])
        table[name] = {"lines": len(results), "differ": differ,
                       "tokens_per_s": summary.get("tokens_per_s"),
                       "ray_workers": workers, "before_resume": summary.get("before_resume"),
                       "made_with": next(iter(results.values()), {}).get("made_with")}
        how = (f" ({workers} Ray workers)" if workers else
               f" ({summary['before_resume']} lines before the kill)"
               if "before_resume" in summary else "")
        print(f"{name:8} {len(results):5d} {len(differ):6d} "
              f"{summary.get('tokens_per_s') or 0:7.1f}  {', '.join(differ[:6])}{how}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
