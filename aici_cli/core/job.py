"""What reading an input line yields: a `Job` to run, or a `BadLine` to report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aici_cli.core.constraint import Constraint
from aici_cli.core.line_stats import ZERO_STATS
from aici_cli.core.sampling import Sampling


@dataclass(frozen=True)
class Job:
    """One validated input line, ready for the engine."""

    index: int  # 1-based input line number
    id: str | int  # the line's own (kept as given), else its line number as a string
    prompt: str | None
    messages: list[dict[str, Any]] | None
    max_tokens: int
    # How each token is chosen: temperature, filters, seed, penalties (core/sampling.py).
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    n: int = 1  # samples of this prompt; they share its prefill
    score: bool = False  # rank the choice constraint's options instead of generating
    answer: str | None = None  # the expected text (an evaluation's gold answer)
    logprobs: int | None = None  # None: no logprobs; k: each token's and its top k
    tools: list[dict[str, Any]] | None = None  # shown to the model with `messages`
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False  # end-of-sequence does not end an unconstrained line
    # "relax": a JSON schema the grammar engine refuses is relaxed until it compiles
    # (control/grammar/relax.py); "off": it is the line's error.
    schema_fallback: str = "off"
    attempt: int = 0  # 0, or which retry of a relaxed line this is (engine/retry.py)


@dataclass(frozen=True)
class BadLine:
    """An input line that cannot run; it becomes a result with finish_reason "error"."""

    index: int
    id: str | int
    type: str
    message: str
    # The line asked for JSON under a schema (its own or --json-schema): its error counts
    # against compliance over every schema line (see `tally.RunTally`).
    json_schema: bool = False


class TranslateError(ValueError):
    """A line of another format that cannot be mapped onto this one; `type` is the error
    type of its result."""

    def __init__(self, message: str, type_: str = "invalid_request") -> None:
        super().__init__(message)
        self.type = type_


def error_result(err: BadLine) -> dict[str, Any]:
    """The result line for an input line that could not run, so output stays 1:1 with
    input and consumers can join on `index` without special cases."""
    return {
        "id": err.id,
        "index": err.index,
        "text": "",
        "finish_reason": "error",
        "error": {"type": err.type, "message": err.message},
        "stats": dict(ZERO_STATS),
    }
