"""What a finished generation becomes: its result line, or with its siblings (`n`
samples) one line for the input line."""

from __future__ import annotations

import dataclasses
from typing import Any

from aici_cli.control.tool_calls import tool_calls_field
from aici_cli.core.job import Job
from aici_cli.core.line_stats import summed_stats
from aici_cli.engine.clock import ms
from aici_cli.engine.generation import Finish, Generation


def finished_text(gen: Generation, tokenizer: Any) -> str:
    """The text of a finished generation's output (cut where a stop string was found)."""
    text = tokenizer.decode(gen.output, skip_special_tokens=True)
    finish = gen.finish
    if finish is not None and finish.text_end is not None:
        text = text[: finish.text_end]
    return text


def generation_result(gen: Generation, text: str, fields: dict[str, Any],
                      controller_stats: dict[str, Any], now: float) -> dict[str, Any]:
    """The result line of a finished generation whose output reads `text`, given its
    controller's result `fields` (`Controller.report`) and `controller_stats`. Pure: the
    generation is not changed."""
    finish = gen.finish or Finish("error", ("internal_error", "sequence ended unfinished"))
    result: dict[str, Any] = {
        "id": gen.job.id,
        "index": gen.job.index,
        "text": text,
        "finish_reason": finish.reason,
    }
    result.update(fields)
    calls = result.pop("calls", None)
    if calls is not None and finish.reason in ("stop", "length"):
        result["tool_calls"] = tool_calls_field(calls, gen.job.index, gen.job.id, gen.sample)
        if finish.reason == "stop":
            result["finish_reason"] = "tool_calls"
    if finish.error is not None:
        etype, message = finish.error
        result["error"] = {"type": etype, "message": f"line {gen.job.index}: {message}"}
    stats = dataclasses.replace(gen.stats, output_tokens=len(gen.output),
                                total_ms=ms(gen.started, now))
    result["stats"] = stats.as_dict()
    for name, value in controller_stats.items():
        result["stats"][name] = round(value, 3) if isinstance(value, float) else value
    if gen.logprobs is not None:
        result["logprobs"] = gen.logprobs + [None] * (len(gen.output) - len(gen.logprobs))
    if gen.steps is not None:
        result["steps"] = gen.steps
    return result


def combine_samples(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result line for a line's n samples, in sample order.

    The top level mirrors sample 0 (text, finish_reason, json, ...), so a reader that takes
    one answer per line still works; `choices` holds every sample with its own text,
    finish reason and stats; the top-level `stats` add up the samples' work. If a sample
    failed, the line's finish_reason is "error" with that sample's error.
    """
    line = {k: v for k, v in results[0].items() if k != "steps"}
    line["n"] = len(results)
    line["choices"] = [
        {"index": i, **{k: v for k, v in r.items() if k not in ("id", "index")}}
        for i, r in enumerate(results)
    ]
    line["stats"] = summed_stats(results)
    failed = next((r for r in results if r["finish_reason"] == "error"), None)
    if failed is not None:
        line["finish_reason"] = "error"
        line["error"] = failed["error"]
    return line


def with_answer(job: Job, result: dict[str, Any]) -> dict[str, Any]:
    """The line's expected answer, when it has one, and whether `text` is it."""
    if job.answer is not None:
        result["answer"] = job.answer
        result["correct"] = result["finish_reason"] != "error" and result["text"] == job.answer
    return result
