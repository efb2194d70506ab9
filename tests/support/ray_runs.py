"""Runs for the Ray tests (tests/run/distributed/test_ray.py, test_ray_client.py): the
input they share, a run in this process on Ray or locally, the results read back and
compared without their timings, and the `aici-batch` command.

Nothing here imports Ray: each test module skips where it is missing."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema

from aici_cli.core.config import EngineConfig, RayOptions, RunConfig
from aici_cli.formats.schemas import load_schema
from aici_cli.run.batch import RunOutcome, run_batch

POISON_ID = "kills-its-worker"  # the one line id the workers of these tests die on
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Alice", "Bob",
         "Paris", "model", "token", "batch", "json", "value"]


def write_input(path: Path, n: int, poison_at: int | None = None,
                long_lines: bool = False) -> None:
    """`n` lines of many kinds (prompts of varied length, chat, JSON schema, regex,
    choices, seeded samples, stop strings) and two bad lines; a line with the poison id
    at `poison_at`; with `long_lines`, the plain prompts ask for 150 tokens."""
    lines: list[str] = []
    for i in range(n):
        words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(2 + i % 6))
        line: dict[str, Any] = {"id": f"p{i}", "prompt": words, "max_tokens": 6 + i * 5 % 23}
        kind = i % 8
        if kind == 1:
            line = {"id": f"p{i}", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": words}],
                    "max_tokens": 12}
        elif kind == 2:
            line["json_schema"] = {"type": "object", "properties": {"n": {"type": "integer"}},
                                   "required": ["n"]}
            line["max_tokens"] = 24
        elif kind == 3:
            line["regex"] = "[A-Z][a-z]+ [0-9]{2}"
        elif kind == 4:
            line["choices"] = ["yes", "no", "maybe"]
        elif kind == 5:
            line.update(temperature=0.9, seed=i, n=2)
        elif kind == 6:
            line["stop"] = ["o"]
        elif long_lines and kind in (0, 7):
            line["max_tokens"] = 150
        if i == poison_at:
            line["id"] = POISON_ID
        lines.append(json.dumps(line))
    lines.insert(3, '{"id": "broken", "prompt": ')
    lines.insert(9, json.dumps({"id": "bad-field", "prompt": "x", "max_tokens": -1}))
    path.write_text("".join(line + "\n" for line in lines))


def run(src: Path, out: Path, model: Path, workers: int | None = 2,
        on_result: Callable[[dict[str, Any]], None] | None = None, resume: bool = False,
        controller: Path | None = None, stats: Path | None = None) -> RunOutcome:
    """A run in this process: on Ray with `workers` (chunks of 2 lines, so that each
    worker holds several), or locally with None."""
    options = RayOptions(workers=workers, chunk_lines=2) if workers is not None else None
    config = RunConfig(input=str(src), output=str(out), model=str(model), device="cpu",
                       dtype="float32", engine=EngineConfig(batch_size=4), quiet=True,
                       resume=resume, ray=options,
                       controller=str(controller) if controller is not None else None,
                       stats_out=str(stats) if stats is not None else None)
    return run_batch(config, on_result=on_result)


def results_in(path: Path) -> dict[int, dict[str, Any]]:
    """The results by index, each whole and valid; fails on a line written twice."""
    validator = jsonschema.Draft202012Validator(load_schema("result-line"))
    data = path.read_text(encoding="utf-8")
    assert data.endswith("\n")
    out: dict[int, dict[str, Any]] = {}
    for line in data.splitlines():
        result = json.loads(line)
        validator.validate(result)
        assert result["index"] not in out, f"two results for line {result['index']}"
        out[result["index"]] = result
    return out


def without_stats(results: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Everything but the timings (and the worker) of each result and of its samples, and
    `made_with.batch_variant`: how a result was computed (a worker's compile mode), never
    what was asked, as resume treats it."""
    def strip(result: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in result.items() if k != "stats"}
        if isinstance(out.get("made_with"), dict):
            out["made_with"] = {k: v for k, v in out["made_with"].items()
                                if k != "batch_variant"}
        if "choices" in out:
            out["choices"] = [strip(sample) for sample in out["choices"]]
        return out

    return {i: strip(r) for i, r in results.items()}


def token_counts(results: dict[int, dict[str, Any]]) -> dict[int, tuple[int, int]]:
    return {i: (r["stats"]["prompt_tokens"], r["stats"]["output_tokens"])
            for i, r in results.items()}


def aici_batch() -> list[str]:
    exe = Path(sys.executable).with_name("aici-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "aici_cli"]
