"""A small agentic evaluation: questions that need a tool (a fact in a made-up key-value
table, a product of two 3-digit numbers), answered by real `aici-batch run` processes
with the calculator and lookup MCP server of tests/support/mcp_servers.py (written with
the `mcp` package) behind `--mcp`, and without tools; and the batch's throughput with a
tool that answers at once against one that takes `--delay` seconds a call.

    python bench/agent_tools.py --models default --lines 16 --batch-size 8 --delay 1

`--models` takes comma-separated `--model` values: `default`, a short name, a hub id, a
model directory or a GGUF file (`--models default,path/to/model.gguf`); each model's row
is keyed by that value. `--skip-throughput` measures accuracy alone.

Accuracy: a line is right when its final answer holds the expected value; a line that
fails (an error instead of text) is wrong, and the row counts those by error type (a
model whose tool calls the constraint cannot write fails every tooled line). Throughput:
the same 16 lines at batch 8, each making its calls (one round) to the instant server,
then to the slow one, after a warm-up run (a first run builds the compiled step), best of
`--repeats`; the ratio of their wall times says how much of the tools' time the batch
hides (the rows keep decoding while calls are out). Results land in out/.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SERVERS = REPO / "tests" / "support" / "mcp_servers.py"
sys.path.insert(0, str(SERVERS.parent))
from mcp_servers import TABLE  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "The value stored under a key in the local table.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                       "required": ["key"]}}},
    {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]


def questions(n: int) -> list[tuple[str, str]]:
    """`n` (question, expected answer) pairs, half lookups, half products."""
    rng = random.Random(0)
    keys = [k for k in TABLE if " " not in k]
    out = []
    for i in range(n):
        if i % 2 == 0:
            key = keys[(i // 2) % len(keys)]
            out.append((f"What is the value stored under the key {key}?", TABLE[key]))
        else:
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            out.append((f"What is {a} times {b}?", str(a * b)))
    return out


def lines(pairs: list[tuple[str, str]], tools: bool, max_tokens: int) -> str:
    out = []
    for i, (question, _) in enumerate(pairs):
        line: dict[str, Any] = {"id": f"q{i}", "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": question}]}
        if tools:
            line.update(tools=TOOLS, tool_choice="required")
        out.append(json.dumps(line) + "\n")
    return "".join(out)


def run(work: Path, text: str, model: str | None, extra: list[str]) -> tuple[
        dict[str, Any], dict[str, dict[str, Any]]]:
    """One `aici-batch run` of `text`: its summary and its results by id."""
    src, out, stats = work / "in.jsonl", work / "out.jsonl", work / "stats.json"
    src.write_text(text)
    cmd = [sys.executable, "-m", "aici_cli", "run", str(src), "-o", str(out), "-q",
           "--stats-out", str(stats), *extra, *(["--model", model] if model else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    return json.loads(stats.read_text()), results


def server(delay: float) -> str:
    return "calc=" + shlex.join([sys.executable, str(SERVERS), "calc", "--delay", str(delay)])


def accuracy(pairs: list[tuple[str, str]], results: dict[str, dict[str, Any]]) -> float:
    right = sum(expected in results[f"q{i}"].get("text", "").replace(",", "")
                for i, (_, expected) in enumerate(pairs))
    return round(right / len(pairs), 3)


def failures(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's failed lines: how many, by error type, and the first error's message."""
    first = summary.get("first_error") or {}
    return {"count": summary.get("errors", 0), "types": summary.get("error_types", {}),
            **({"first": first.get("message", "")} if first else {})}


def throughput(work: Path, pairs: list[tuple[str, str]], model: str | None,
               batch: list[str], max_tokens: int, delay: float,
               repeats: int) -> dict[str, Any]:
    """Wall times of one round of calls a line, an instant tool against a slow one (`delay`
    seconds a call), after a run that builds what a first run builds (the compiled step's
    graphs for these row counts, cached on disk): best of `repeats`, interleaved."""
    row: dict[str, Any] = {}
    text = lines(pairs, True, max_tokens)
    run(work, text, model, [*batch, "--mcp", server(0), "--max-tool-rounds", "1"])
    walls: dict[str, list[float]] = {"instant": [], "slow": []}
    for _ in range(repeats):
        for label, seconds in (("instant", 0.0), ("slow", delay)):
            summary, _ = run(work, text, model, [*batch, "--mcp", server(seconds),
                                                 "--max-tool-rounds", "1"])
            walls[label].append(summary["wall_s"])
            # No "tools" when no line made a call (every line failed).
            row[f"{label}_tool_ms"] = summary.get("tools", {}).get("calc", {}).get("ms")
            row[f"{label}_failed_lines"] = failures(summary)
    # Best of, and every run: a run's wide prefill passes (and whether the int4 layers'
    # dense copy is made) follow when lines arrive, so walls vary.
    for label, runs in walls.items():
        row[f"wall_s_{label}_tool"] = min(runs)
        row[f"wall_s_{label}_tool_runs"] = runs
    row["slow_over_instant"] = round(min(walls["slow"]) / min(walls["instant"]), 3)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="default",
                    help="comma-separated --model values ('default': the default model)")
    ap.add_argument("--lines", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--delay", type=float, default=1.0, help="the slow tool's seconds a call")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="throughput runs of each tool")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true",
                    help="measure accuracy alone (no instant/slow tool runs)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "agent_tools.json")
    args = ap.parse_args()
    pairs = questions(args.lines)
    batch = ["--batch-size", str(args.batch_size), "--seed", "0"]
    report: dict[str, Any] = {"lines": args.lines, "batch_size": args.batch_size,
                              "delay_s": args.delay, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            model = None if name == "default" else name
            row: dict[str, Any] = {}
            if not args.skip_accuracy:
                plain_summary, plain = run(work, lines(pairs, False, args.max_tokens),
                                           model, batch)
                summary, tooled = run(work, lines(pairs, True, args.max_tokens), model,
                                      [*batch, "--mcp", server(0), "--max-tool-rounds", "2"])
                row["accuracy_without_tools"] = accuracy(pairs, plain)
                row["accuracy_with_tools"] = accuracy(pairs, tooled)
                row["tool_calls"] = summary.get("tools", {})
                row["failed_lines_without_tools"] = failures(plain_summary)
                row["failed_lines_with_tools"] = failures(summary)
            if not args.skip_throughput:
                row.update(throughput(work, pairs, model, batch, args.max_tokens,
                                      args.delay, args.repeats))
            report["models"][name] = row
            print(f"{name}: {json.dumps(row)}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
