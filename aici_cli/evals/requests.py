"""lm-evaluation-harness requests as engine lines, torch-free.

A loglikelihood request is a (context tokens, continuation tokens) pair. Requests with the
same context become one scored line whose choices are their continuations: the engine
runs one row per choice, and the context's keys come from the prefix cache, so a shared
few-shot prefix is prefilled once per row it lands in rather than once per request.
Lines are ordered by their context tokens so that contexts sharing a prefix are admitted
next to each other.

A generate_until request's `gen_kwargs` become the line's fields (`until` -> `stop`,
`max_gen_toks` -> `max_tokens`, ...), constraints included: `json_schema`, `regex`,
`choice` (or `choices`) and `grammar` go through the same checks as an input line's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aici_cli.core.sampling import RUN_OPTIONS

#: Where a line's given token ids travel in `Job.extra` (read by `token_intake`).
PROMPT_IDS = "eval_prompt_ids"
SEQUENCES = "eval_sequences"

#: gen_kwargs read as the line field of the same meaning: every sampling option a run sets
#: (core/sampling.py) but temperature, which `do_sample` governs.
_SAME_FIELDS = tuple(option.name for option in RUN_OPTIONS if option.name != "temperature")
#: gen_kwargs that carry a constraint, and the input line field each becomes.
CONSTRAINT_FIELDS = {"json_schema": "json_schema", "regex": "regex", "choice": "choices",
                     "choices": "choices", "grammar": "grammar"}
#: gen_kwargs that lm-eval or its tasks set and that change nothing here: greedy decoding
#: is already what `do_sample: false` asks for; `max_length` is the model's.
_NO_EFFECT = ("do_sample", "max_length")


class EvalRequestError(ValueError):
    """A request the engine cannot run as asked (its task's configuration is at fault)."""


@dataclass
class ScoreGroup:
    """The loglikelihood requests that share one context: one scored line.

    `sequences[i]` is the whole token sequence of request `members[i]` (context, then
    continuation, left-truncated to the model's length as lm-eval's `hf` backend does)
    and where its continuation starts."""

    context: tuple[int, ...]
    members: list[int] = field(default_factory=list)
    sequences: list[tuple[list[int], int]] = field(default_factory=list)


def truncated(context: Sequence[int], continuation: Sequence[int],
              max_length: int) -> tuple[list[int], int]:
    """The sequence a request scores and where its continuation starts: the last
    `max_length + 1` tokens of context + continuation (the model reads all but the last,
    lm-eval's `hf` truncation), the continuation being scored whole."""
    whole = [*context, *continuation][-(max_length + 1):]
    start = len(whole) - len(continuation)
    if start < 1:
        raise EvalRequestError(f"a continuation of {len(continuation)} tokens does not fit the "
                           f"model's {max_length} positions after at least one context token")
    return whole, start


def group_by_context(pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                     max_length: int) -> list[ScoreGroup]:
    """Requests (context, continuation) grouped by context, the groups ordered by their
    context tokens (shared prefixes next to each other), members in request order."""
    groups: dict[tuple[int, ...], ScoreGroup] = {}
    for i, (context, continuation) in enumerate(pairs):
        key = tuple(context)
        group = groups.setdefault(key, ScoreGroup(key))
        group.members.append(i)
        group.sequences.append(truncated(context, continuation, max_length))
    return [groups[key] for key in sorted(groups)]


def score_line(group: ScoreGroup, index: int) -> dict[str, Any]:
    """The input line of a scored group; its choices are labels (the member's position)
    since the continuations' own text may repeat or be empty."""
    return {"id": f"ll{index}", "prompt": "(given as token ids)", "score": True,
            "choices": [str(k) for k in range(len(group.members))], "max_tokens": 1}


def generation_line(index: int, gen_kwargs: dict[str, Any], default_max_tokens: int,
                    eos_text: str | None) -> dict[str, Any]:
    """The input line of a generate_until request (its prompt is given as token ids).

    `until` (a string or a list) becomes the stop strings, plus the end-of-text token's
    text as lm-eval's `hf` backend adds it; greedy unless `do_sample` is true (then at
    `temperature`, default 1.0) and `temperature` > 0. Raises EvalRequestError for a key this
    engine has no meaning for (beam search, say), naming it."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop("until", None)
    stop = [until] if isinstance(until, str) else list(until or [])
    if eos_text and eos_text not in stop:
        stop.append(eos_text)
    line: dict[str, Any] = {"id": f"gen{index}", "prompt": "(given as token ids)",
                            "stop": [s for s in stop if s],
                            "max_tokens": int(kwargs.pop("max_gen_toks", default_max_tokens))}
    sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0))
    line["temperature"] = temperature if sample else 0.0
    for key in _SAME_FIELDS:
        if key in kwargs:
            line[key] = kwargs.pop(key)
    line.setdefault("seed", index)
    constraints = [k for k in CONSTRAINT_FIELDS if k in kwargs]
    if len(constraints) > 1:
        raise EvalRequestError(f"gen_kwargs give {' and '.join(constraints)}: at most one "
                           "constraint per request")
    for key in constraints:
        line[CONSTRAINT_FIELDS[key]] = _constraint_value(key, kwargs.pop(key))
    for key in _NO_EFFECT:
        kwargs.pop(key, None)
    if kwargs:
        raise EvalRequestError(f"gen_kwargs {sorted(kwargs)} have no meaning for the aici-batch "
                           "backend (it reads until, max_gen_toks, do_sample, temperature, "
                           f"{', '.join(_SAME_FIELDS)} and a constraint: "
                           f"{', '.join(CONSTRAINT_FIELDS)})")
    return line


def _constraint_value(key: str, value: Any) -> Any:
    """A constraint as the input line holds it. A task's YAML may write a JSON schema as
    a mapping or as JSON text, and choices as a list or as one comma-separated string."""
    if key == "json_schema" and isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise EvalRequestError(
                f"gen_kwargs json_schema is a string but not JSON: {e}") from None
    if key in ("choice", "choices") and isinstance(value, str):
        return [c for c in value.split(",") if c]
    return value


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` before the first occurrence of each stop string in turn (lm-eval's `hf`
    post-processing, so both backends answer with the same text)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text
