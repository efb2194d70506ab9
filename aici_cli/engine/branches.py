"""The sequences of a line whose controller may fork: its branches, what they share, and
how their results become the line's.

A `fork(n)` turns a generation into n branches: the generation goes on as branch 0, and
n - 1 new generations (`Generation.branch`) wait for rows like samples do, ahead of new
lines, their keys taken from the forking row (`rows.py`). A branch is named by its
`path`, its index at each fork on its way (`(1, 0)`: branch 0 of a fork made by branch 1
of the first fork); the line's result lists them in tree order, which is the order of
the paths (`(0,) < (1, 0) < (1, 1) < (2,)`), sample by sample.

A line runs at most `max_branches` sequences in all (its `n` samples included); a fork
past that ends the line with `bad_action`. Once a line has forked, a fault in any of its
sequences ends the line: its result is that error, and its other sequences are dropped
(`Scheduler.drop_failed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aici_cli.control.line_scope import LineScope
from aici_cli.vocabulary.line_stats import StepTimes, shared_pass_times, summed_stats


@dataclass
class LineBranches:
    """One line's sequences: counts for the cap, the results so far, what they share."""

    scope: LineScope
    n: int  # the line's samples
    sequences: int = 0  # sequences the line runs in all: its samples and forks' new branches
    live: int = 0  # of which not finished yet
    forked: bool = False
    failed: bool = False  # a sequence faulted after a fork: the line's result is out
    results: dict[tuple[int, tuple[int, ...]], dict[str, Any]] = field(default_factory=dict)
    # Every pass any sequence of the line took part in, once (see SampleGroup.passes).
    passes: dict[int, StepTimes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sequences = self.live = self.n

    def would_exceed(self, n: int, cap: int) -> str | None:
        """Why a fork into `n` branches is refused, or None."""
        after = self.sequences + n - 1
        if after <= cap:
            return None
        return (f"fork({n}) would make {after} branches for the line, more than "
                f"--max-branches {cap} (the line's samples and every fork's branches count)")

    def forked_into(self, n: int) -> None:
        self.forked = True
        self.sequences += n - 1
        self.live += n - 1

    def finished(self, sample: int, path: tuple[int, ...], result: dict[str, Any]) -> None:
        self.results[(sample, path)] = result
        self.live -= 1

    def result(self, failed: tuple[int, tuple[int, ...]] | None = None) -> dict[str, Any]:
        """The line's result: every finished sequence in tree order, or with `failed`
        the error of that sequence (the sequences it stopped are left out)."""
        ordered = sorted(self.results.items())
        first = ordered[0][1]
        line = {k: v for k, v in first.items() if k not in ("steps", "outputs", "logs")}
        if self.n > 1:
            line["n"] = self.n
        line["branches"] = len(ordered)
        line["choices"] = [
            {"index": i, **({"sample": sample} if self.n > 1 else {}), "branch": list(path),
             **{k: v for k, v in r.items() if k not in ("id", "index")}}
            for i, ((sample, path), r) in enumerate(ordered)
        ]
        line["stats"] = summed_stats([r for _, r in ordered])
        line["stats"].update(shared_pass_times(self.passes.values()))  # a shared pass once
        if self.scope.outputs:
            line["outputs"] = dict(self.scope.outputs)
        error_of = failed if failed is not None else next(
            (key for key, r in ordered if r["finish_reason"] == "error"), None)
        if error_of is not None:
            error = self.results[error_of]["error"]
            message = error["message"]
            sample, path = error_of
            prefix = f"line {first['index']}: "
            where = ("sample " + str(sample) + ", " if self.n > 1 else "") + branch_name(path)
            if message.startswith(prefix):
                message = message[len(prefix):]
            stopped = " (the line's other branches were stopped)" if failed is not None else ""
            line["finish_reason"] = "error"
            line["error"] = {"type": error["type"],
                             "message": f"{prefix}{where}: {message}{stopped}"}
        return line


def branch_name(path: tuple[int, ...]) -> str:
    """"branch 1.0" for path (1, 0); "the sequence" before any fork."""
    return "branch " + ".".join(map(str, path)) if path else "the sequence"
