"""What a controller's `aici:tools` imports are served from (wit/deps/tools/tools.wit): the
tools a guest may call (`ToolInfo`), what one call gives back (`ToolAnswer`), and
`GuestTools`, the protocol the run implements for the guests of one line
(aici_cli/run/tools/guest.py, and its relay from the engine's own process).

A guest of a run that allows no tool gets `NO_TOOLS`: an empty list, and an `err` for
every call. Plain data and a protocol, no wasmtime and no torch: the run's process (which
imports neither when the engine runs in a process of its own) and the engine's both
speak it, and the engine's process gets `ToolInfo`s and `ToolAnswer`s pickled.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

# How long past `--tool-timeout` a guest waits for the host's own answer to a call (which
# the servers bound by `--tool-timeout` already) before it is answered `tool_timeout`: a
# backstop for a host that is slow to answer (a relay between processes, a busy thread).
ANSWER_GRACE_S = 5.0


@dataclass(frozen=True)
class ToolInfo:
    """WIT `tool-info`: a tool a guest may call, as its server listed it."""

    name: str
    description: str
    input_schema: str  # JSON text


@dataclass(frozen=True)
class ToolAnswer:
    """WIT `call-tool`'s `result<string, string>`: the tool's answer when `ok`, else why
    there is none as `TYPE: message` (the types of tools.wit)."""

    ok: bool
    text: str

    @classmethod
    def error(cls, type_: str, message: str) -> ToolAnswer:
        return cls(False, f"{type_}: {message}")


class GuestTools(Protocol):
    """The tools of one line's guests. Called on the thread that calls the guest, while it
    waits: `call_tool` blocks until the answer is in or the call's deadline passed, and
    never raises (a failure is its `err` answer)."""

    def list_tools(self) -> list[ToolInfo]: ...

    def call_tool(self, name: str, arguments: str) -> ToolAnswer: ...


# What the engine is given: the tools of the line with this input index.
LineTools = Callable[[int], GuestTools]


class RunTools(Protocol):
    """The run's tools as its controllers may call them (`run/tools/guest.py`), as the
    backends reach them: `for_line` in the engine's own process, `submit` for a call
    relayed from an engine's process of its own, `infos` to tell that process the list."""

    infos: list[ToolInfo]  # what list-tools answers
    # A span per call where the run is traced: (line index, tool name, `CallOutcome`).
    trace: Callable[[int, str, Any], None] | None

    def submit(self, index: int, name: str, arguments: str) -> Future[ToolAnswer]:
        """The answer to a call of line `index`, as a future that never fails."""
        ...

    def for_line(self, index: int) -> GuestTools: ...


def not_allowed(name: str, why: str = "") -> ToolAnswer:
    """The answer to a call of a tool the run does not allow its controllers."""
    because = f" ({why})" if why else ""
    return ToolAnswer.error("tool_not_allowed", f"tool {name!r} is not on --allow-tool{because}")


class _NoTools:
    """The tools of a run that allows its controllers none."""

    def list_tools(self) -> list[ToolInfo]:
        return []

    def call_tool(self, name: str, arguments: str) -> ToolAnswer:
        return not_allowed(name, "the run allows its controllers no tool")


NO_TOOLS: GuestTools = _NoTools()


def wait_answer(answer: Future[ToolAnswer], name: str, timeout_s: float) -> ToolAnswer:
    """`answer` once it is in; `tool_timeout` past the call's deadline (`timeout_s`,
    `--tool-timeout`) and `ANSWER_GRACE_S`."""
    try:
        return answer.result(timeout_s + ANSWER_GRACE_S)
    except FutureTimeout:
        return ToolAnswer.error("tool_timeout", f"tool {name} did not answer within "
                                f"{timeout_s:g} s (--tool-timeout)")
