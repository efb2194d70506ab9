"""One result line as the CI outputs of `aici-batch report` see it: who it is (id, input
digest), what it answered, what was expected, and whether it passed.

A line passes unless it is an error, an invalid JSON output (any of its samples) or a
wrong answer, checked in that order: a line that failed never had an answer to be wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["ok", "wrong", "invalid", "error"]


@dataclass(frozen=True)
class LineOutcome:
    id: str
    index: int
    digest: str | None  # `input_sha256`: the input line it answers (None: not recorded)
    text: str
    answer: str | None  # the expected answer, when the line had one
    correct: bool | None  # None: no expected answer
    valid: bool | None  # None: no JSON schema
    error: tuple[str, str] | None  # (type, message)
    seconds: float

    @property
    def status(self) -> Status:
        if self.error is not None:
            return "error"
        if self.valid is False:
            return "invalid"
        if self.correct is False:
            return "wrong"
        return "ok"

    @property
    def name(self) -> str:
        """How reports name the line: its id, or its line number without one."""
        return self.id or f"line {self.index}"


def line_outcome(result: dict[str, Any]) -> LineOutcome:
    """The outcome of a result line (already checked against the result-line schema)."""
    samples = result.get("choices", [result])
    valids = [s["valid"] for s in samples if isinstance(s, dict) and "valid" in s]
    if "valid" in result:
        valids.append(result["valid"])
    error = result.get("error")
    return LineOutcome(
        id=str(result.get("id") or ""), index=int(result.get("index", 0)),
        digest=result.get("input_sha256"), text=str(result.get("text", "")),
        answer=result.get("answer"), correct=result.get("correct"),
        valid=all(valids) if valids else None,
        error=(error.get("type", "error"), error.get("message", "")) if error else None,
        seconds=float(result.get("stats", {}).get("total_ms", 0.0)) / 1000.0)
