"""The sequences of a line whose controller may fork: its branches, what they share, and
how their results become the line's.

A `fork(n)` turns a generation into n branches: the generation goes on as branch 0, and
n - 1 new generations (`Generation.split`) wait for rows like samples do, ahead of new
lines, their keys taken from the forking row (`rows.py`). Each sequence holds its
`Branch`: its line, its path, and a fork it asked for during a step (made between steps,
decisions.py). A branch is named by its
`path`, its index at each fork on its way (`(1, 0)`: branch 0 of a fork made by branch 1
of the first fork); the line's result lists them in tree order, which is the order of
the paths (`(0,) < (1, 0) < (1, 1) < (2,)`), sample by sample.

A line runs at most `max_branches` sequences in all (its `n` samples included); a fork
past that ends the line with `bad_action`. Once a line has forked, a fault in any of its
sequences ends the line: its result is that error, and its other sequences are dropped
(by the scheduler, between steps).

When a sequence ends, `LineBranches.ended` decides at once what becomes of it (an
`Ending`); its result is made after the step (finishing.py), in the order the sequences
ended, so the line's result is the one it would be had it been made at that moment (the
line's outputs are taken then).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from aici_cli.control.line_scope import LineScope
from aici_cli.core.line_stats import StepTimes, shared_pass_times, summed_stats

Key = tuple[int, tuple[int, ...]]  # a sequence of a line: (sample, path)


class Ending(Enum):
    """What becomes of a sequence's result, decided when it ends."""

    DROPPED = "dropped"  # the line's result is out already (a fault stopped the line)
    ALONE = "alone"  # the line never forked: the result goes the samples' way
    WAITS = "waits"  # kept for the line's result, which waits for its other sequences
    FAILS = "fails"  # a fault after a fork: its error is the line's result
    LAST = "last"  # the line's last sequence: the line's result is due


@dataclass
class LineBranches:
    """One line's sequences: counts for the cap, the results so far, what they share."""

    scope: LineScope
    n: int  # the line's samples
    sequences: int = 0  # sequences the line runs in all: its samples and forks' new branches
    live: int = 0  # of which not finished yet
    forked: bool = False
    failed: bool = False  # a sequence faulted after a fork: the line ends, with that error
    results: dict[Key, dict[str, Any]] = field(default_factory=dict)
    # The line's outputs when its result became due (`ended`): later writes by sequences
    # about to be dropped do not count.
    outputs: dict[str, Any] = field(default_factory=dict)
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

    def ended(self, error: bool) -> Ending:
        """A sequence of the line ended (with an error, or not): what becomes of it."""
        if self.failed:
            return Ending.DROPPED
        self.live -= 1
        if not self.forked:
            return Ending.ALONE
        if error:  # a fault ends a forked line
            self.failed = True
        elif self.live:
            return Ending.WAITS
        self.outputs = dict(self.scope.outputs)
        return Ending.FAILS if error else Ending.LAST

    def record(self, key: Key, result: dict[str, Any]) -> None:
        """The result of a sequence that ended (not DROPPED)."""
        self.results[key] = result

    def result(self, failed: Key | None = None) -> dict[str, Any]:
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
        if self.outputs:
            line["outputs"] = dict(self.outputs)
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


@dataclass
class Branch:
    """One sequence of a line whose controller may fork: its line, its path (its index at
    each fork on its way), and the fork it asked for during a step, made before the next
    plan (no more tokens are taken until then)."""

    line: LineBranches
    path: tuple[int, ...] = ()
    from_fork: bool = False  # made by a fork: the cache may hold its output's keys too
    wanted: int = 0  # branches asked for (0: none)
    ending: Ending | None = None  # set when the sequence ends

    def want(self, n: int) -> None:
        self.wanted = n

    def take_wanted(self) -> int:
        """The fork asked for, now being made (0: none)."""
        n, self.wanted = self.wanted, 0
        return n

    def go_on(self) -> tuple[int, ...]:
        """This sequence forks and goes on as its branch 0; returns the path the fork's
        branches extend (branch k's path is it + (k,))."""
        base = self.path
        self.path = base + (0,)
        return base

    def end(self, error: bool) -> Ending:
        """The sequence ended (with an error, or not): its line decides what becomes of
        it, now."""
        self.ending = self.line.ended(error)
        return self.ending

    def child(self, path: tuple[int, ...]) -> Branch:
        """The state of a new branch of this sequence's fork."""
        return Branch(self.line, path, from_fork=True)


def branch_name(path: tuple[int, ...]) -> str:
    """"branch 1.0" for path (1, 0); "the sequence" before any fork."""
    return "branch " + ".".join(map(str, path)) if path else "the sequence"
