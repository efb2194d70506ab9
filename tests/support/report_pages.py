"""For tests/report's page tests: a small run with one line of each kind the page shows,
written as a run writes it: its input file, its results (checked against the
result-line schema) and the results of the run before it (the baseline).

    q1        right now, wrong in the baseline (wrong -> right)
    q2        wrong now, right in the baseline (right -> wrong)
    person    JSON over its schema's maxLength and maximum: invalid, two errors
    city      valid JSON closed early at the token limit
    weather   a tool call whose arguments miss the required `city`: invalid
    broken    an empty prompt: an error line that never ran
    slow      a schema line that timed out: an error, and a schema error
    pair      n = 2, both samples invalid: two invalid outputs on one line
    q3        right in both runs
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from aici_cli.formats.schemas import load_schema
from aici_cli.run.resume import line_digest

RESULT = Draft202012Validator(load_schema("result-line"))
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "maximum": 120}},
          "required": ["name", "age"]}
CALL = {"id": "call_" + "a" * 24, "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Bergen\"}"}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

INPUTS: list[dict[str, Any]] = [
    {"id": "q1", "prompt": "2 + 2 =", "choices": [" 4", " 5"], "answer": " 4", "score": True},
    {"id": "q2", "prompt": "The capital of Italy is", "choices": [" Rome", " Milan"],
     "answer": " Rome", "score": True},
    {"id": "person", "messages": [{"role": "user", "content": "A person as JSON."}],
     "json_schema": PERSON},
    {"id": "city", "messages": [{"role": "user", "content": "A person from Oslo."}],
     "json_schema": PERSON, "max_tokens": 12},
    {"id": "weather", "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_" + "a" * 24, "content": "{\"temp_c\": 7}"},
        {"role": "user", "content": "And in Oslo?"}], "tools": [WEATHER]},
    {"id": "broken", "prompt": ""},
    {"id": "slow", "prompt": "Tell me a long story as JSON.", "json_schema": PERSON},
    {"id": "pair", "prompt": "Two people as JSON.", "json_schema": PERSON, "n": 2},
    {"id": "q3", "prompt": "3 + 4 =", "choices": [" 7", " 8"], "answer": " 7", "score": True},
]
MADE_WITH = {"model": "tiny-llama", "quantize": "int4"}


def stats(out: int = 3, start: float = 0.0, total: float = 40.0, **extra: Any) -> dict[str, Any]:
    return {"prompt_tokens": 6, "output_tokens": out, "forward_passes": max(out, 1),
            "ff_tokens": 0, "ttft_ms": 5.0, "total_ms": total, "started_ms": start,
            "forward_ms": 20.0, "mask_ms": 2.0, "controller_ms": 1.0, "sample_ms": 0.5,
            **extra}


def steps(n: int) -> list[dict[str, Any]]:
    return [{"step": i, "kind": "prefill" if i == 0 else "decode", "sampled": 1, "forced": 0,
             "forward_ms": 5.0 + i, "mask_ms": 0.5, "controller_ms": 0.25, "sample_ms": 0.1}
            for i in range(n)]


def _answers(before: bool) -> dict[str, dict[str, Any]]:
    """The fields of each line's result that are not its identity, now or before."""
    person = {"name": "Alexander the Great", "age": 150}
    pair = [{"name": "Ann", "age": 130}, {"name": "Bartholomew J.", "age": 30}]
    call = {"id": "call_" + "b" * 24, "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"town\": \"Oslo\"}"}}
    return {
        "q1": {"text": " 5" if before else " 4", "finish_reason": "stop", "stats": stats(1),
               "answer": " 4", "correct": not before},
        "q2": {"text": " Rome" if before else " Milan", "finish_reason": "stop",
               "stats": stats(1), "answer": " Rome", "correct": before},
        "person": {"text": json.dumps(person), "finish_reason": "stop", "json": person,
                   "valid": False, "stats": stats(12, 1.0), "steps": steps(12)},
        "city": {"text": "{\"name\": \"Ola\", \"age\": 40}", "finish_reason": "stop",
                 "json": {"name": "Ola", "age": 40}, "valid": True,
                 "stats": stats(12, 2.0, closed_early=True, close_reason="limit")},
        "weather": {"text": "<tool_call>...", "finish_reason": "tool_calls",
                    "tool_calls": [call], "valid": False, "stats": stats(9, 3.0)},
        "broken": {"text": "", "finish_reason": "error", "stats": stats(0, total=0.0),
                   "error": {"type": "empty_prompt",
                             "message": "line 6: field 'prompt' must not be empty"}},
        "slow": {"text": "", "finish_reason": "error", "valid": False, "stats": stats(30, 4.0),
                 "error": {"type": "timeout", "message": "line 7: timed out after 30 s"}},
        "pair": {"text": json.dumps(pair[0]), "finish_reason": "stop", "json": pair[0],
                 "valid": False, "n": 2, "stats": stats(20, 5.0),
                 "choices": [{"index": i, "text": json.dumps(p), "finish_reason": "stop",
                              "json": p, "valid": False, "stats": stats(10, 5.0)}
                             for i, p in enumerate(pair)]},
        "q3": {"text": " 7", "finish_reason": "stop", "stats": stats(1, 6.0), "answer": " 7",
               "correct": True},
    }


def input_bytes() -> list[bytes]:
    return [json.dumps(line).encode() for line in INPUTS]


def results(before: bool = False) -> list[dict[str, Any]]:
    answers = _answers(before)
    out = []
    for index, (line, raw) in enumerate(zip(INPUTS, input_bytes()), start=1):
        result = {"id": line["id"], "index": index, "input_sha256": line_digest(raw),
                  "made_with": MADE_WITH, **answers[line["id"]]}
        RESULT.validate(result)
        out.append(result)
    return out


@dataclass(frozen=True)
class PageRun:
    results: Path
    inputs: Path
    baseline: Path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def page_run_in(tmp_path: Path) -> PageRun:
    """The run's three files, written under `tmp_path`."""
    inputs = tmp_path / "eval.jsonl"
    inputs.write_bytes(b"".join(raw + b"\n" for raw in input_bytes()))
    return PageRun(write_jsonl(tmp_path / "results.jsonl", results()), inputs,
                   write_jsonl(tmp_path / "prev.jsonl", results(before=True)))


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
