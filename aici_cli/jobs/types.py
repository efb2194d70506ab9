"""What reading an input line yields: a `Job` to run, or a `LineError` to report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aici_cli.control.constraint import Constraint


@dataclass(frozen=True)
class Job:
    """One validated input line, ready for the engine."""

    index: int  # 1-based input line number
    id: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    n: int = 1  # samples of this prompt; they share its prefill
    score: bool = False  # rank the choice constraint's options instead of generating
    answer: str | None = None  # the expected text (an evaluation's gold answer)
    logprobs: int | None = None  # None: no logprobs; k: each token's and its top k
    # "relax": a JSON schema the grammar engine refuses is relaxed until it compiles
    # (control/grammar/relax.py); "off": it is the line's error.
    schema_fallback: str = "off"
    attempt: int = 0  # 0, or which retry of a relaxed line this is (engine/retry.py)


@dataclass(frozen=True)
class LineError:
    """An input line that cannot run; it becomes a result with finish_reason "error"."""

    index: int
    id: str
    type: str
    message: str
