"""Big results files for the report benches: the example eval run, repeated.

`examples/eval/eval.jsonl` run with `--score --step-stats` on the default model gives one
result line per question, shaped like `EXAMPLE` (a line of such a run, kept verbatim).
`write_run(n)` writes `n` such lines: the eval's questions over and over, each line's
index, input digest, id, scores and verdict its own, its answer drawn (seeded) with the
accuracy the default model gets, ~73%; `write_inputs(n)` writes the input file those
results answer, line for line, so `--input` pairs them as it pairs a real run's.

Shared by bench/report_speed.py and bench/report_html.py.
"""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EVAL = REPO / "examples" / "eval" / "eval.jsonl"
ACCURACY = 0.73

# One line of `aici-batch run examples/eval/eval.jsonl --score --step-stats` (SmolLM2).
EXAMPLE: dict[str, Any] = {
    "id": "q02", "index": 2, "input_sha256": "62e89b7d041268e0",
    "made_with": {"model": "smollm2-135m-instruct", "quantize": "int4", "score": True},
    "finish_reason": "stop",
    "stats": {"prompt_tokens": 344, "cached_tokens": 338, "output_tokens": 0,
              "forward_passes": 1, "ff_tokens": 0, "draft_tokens": 0, "ttft_ms": 0.0,
              "total_ms": 14518.632, "started_ms": 0.0, "forward_ms": 346.307,
              "mask_ms": 0.276, "controller_ms": 0.0, "sample_ms": 0.024},
    "text": " Rome",
    "scores": [
        {"choice": " Rome", "logprob": -0.282023, "tokens": 1, "logprob_per_token": -0.282023,
         "greedy": True},
        {"choice": " Paris", "logprob": -7.782022, "tokens": 1,
         "logprob_per_token": -7.782022, "greedy": False},
        {"choice": " Vienna", "logprob": -10.438272, "tokens": 1,
         "logprob_per_token": -10.438272, "greedy": False},
        {"choice": " Madrid", "logprob": -11.219522, "tokens": 1,
         "logprob_per_token": -11.219522, "greedy": False},
    ],
    "answer": " Rome", "correct": True,
    "steps": [{"step": 0, "kind": "prefill", "sampled": 0, "forced": 0, "forward_ms": 346.307,
               "mask_ms": 0.276, "controller_ms": 0.0, "sample_ms": 0.024}],
}


def _questions() -> list[tuple[bytes, dict[str, Any]]]:
    raw = [line for line in EVAL.read_bytes().splitlines(keepends=True) if line.strip()]
    return [(line, json.loads(line)) for line in raw]


def _result(n: int, raw: bytes, question: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    from aici_cli.run.resume import line_digest

    line = copy.deepcopy(EXAMPLE)
    choices = list(question["choices"])
    right = rng.random() < ACCURACY
    text = question["answer"] if right else rng.choice(
        [c for c in choices if c != question["answer"]] or choices)
    others = [c for c in choices if c != text]
    logprobs = sorted((round(-rng.uniform(0.01, 12.0), 6) for _ in choices), reverse=True)
    line.update(id=question["id"], index=n, input_sha256=line_digest(raw), text=text,
                answer=question["answer"], correct=text == question["answer"])
    line["scores"] = [{"choice": c, "logprob": lp, "tokens": 1, "logprob_per_token": lp,
                       "greedy": i == 0} for i, (c, lp) in enumerate(zip([text, *others],
                                                                         logprobs))]
    forward = round(rng.uniform(300.0, 900.0), 3)
    line["stats"].update(started_ms=round(n * 12.5, 3), total_ms=round(forward * 1.02, 3),
                         forward_ms=forward, mask_ms=round(rng.uniform(0.2, 0.4), 3))
    line["steps"][0].update(forward_ms=forward, mask_ms=line["stats"]["mask_ms"])
    return line


def write_run(path: Path, lines: int, seed: int = 0) -> Path:
    """`lines` result lines of the example run, repeated (seeded: the same file each time)."""
    rng = random.Random(seed)
    questions = _questions()
    with path.open("w", encoding="utf-8") as fh:
        for n in range(1, lines + 1):
            raw, question = questions[(n - 1) % len(questions)]
            fh.write(json.dumps(_result(n, raw, question, rng), separators=(",", ":")) + "\n")
    return path


def write_inputs(path: Path, lines: int) -> Path:
    """The input file of `write_run(path, lines)`: the eval's lines, repeated."""
    questions = _questions()
    with path.open("wb") as fh:
        for n in range(lines):
            fh.write(questions[n % len(questions)][0].rstrip(b"\n") + b"\n")
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/report_run.jsonl")
    write_run(out, int(sys.argv[2]) if len(sys.argv) > 2 else 10_000)
    print(out)
