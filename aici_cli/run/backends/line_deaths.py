"""What an engine process's death costs the lines it held (`supervised.SupervisedEngine`).

A death is charged to the lines that had taken a row in that life, not to those only
sent to it (read ahead, waiting): a row's line is what a native crash or the OOM killer
could have come from. A line's first death sends it back with the others; at its second
it runs alone (nothing else in flight in that life), so that a third death is its own:
then it ends as an `engine_crash` error result and the others go on.

Torch-free.
"""

from __future__ import annotations

from typing import Any

from aici_cli.core.job import BadLine, Job, error_result

ALONE_AFTER = 2  # deaths a line was in flight at before it runs alone
LINE_DEATHS = 3  # the last of them (alone): the line is an `engine_crash`
LISTED = 10  # line numbers a warning lists before it says how many more


class LineDeaths:
    """The deaths each line in flight has seen, by line number."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def strike(self, job: Job) -> int:
        """One more death for `job`; how many it has seen."""
        n = self.counts[job.index] = self.counts.get(job.index, 0) + 1
        if n >= LINE_DEATHS:
            del self.counts[job.index]
        return n

    def forget(self, index: int) -> None:
        """Line `index` has its result."""
        self.counts.pop(index, None)


def crash_result(job: Job, how: str, deaths: int) -> dict[str, Any]:
    """The result of a line that killed the engine alone: `how` names the signal."""
    return error_result(BadLine(
        job.index, job.id, "engine_crash",
        f"line {job.index}: the engine process died ({how}) {deaths} times while running "
        "it, the last time with no other line: the line itself crashes the engine (a "
        "native fault, out of memory); the other lines ran on"))


def death_note(how: str, info: dict[str, Any], again: list[int], crashed: list[int]) -> str:
    """The warning for one death: the signal, the mode the engine ran in, the lines that
    run again and those that end as `engine_crash`."""
    meta = info.get("meta", {})
    mode = (f"model {meta.get('model', '?')}, dtype {meta.get('dtype', '?')}, quantize "
            f"{meta.get('quantize', '?')}, compile {info.get('compile', '?')}")
    said = f"aici-batch: warning: the engine process died ({how}) running {mode}; "
    if again:
        said += f"{_lines(again)} in flight run again in a new one"
    elif not crashed:
        said += "no line was in flight"
    if crashed:
        said += ("; " if again else "") + (
            f"{_lines(crashed)} killed it again, alone: {'its' if len(crashed) == 1 else 'their'}"
            " result is an engine_crash error, and the other lines go on")
    return said


def _lines(indexes: list[int]) -> str:
    shown = ", ".join(str(i) for i in indexes[:LISTED])
    more = f" and {len(indexes) - LISTED} more" if len(indexes) > LISTED else ""
    return f"{'line' if len(indexes) == 1 else 'lines'} {shown}{more}"
