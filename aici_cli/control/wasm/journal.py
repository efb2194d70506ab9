"""What a guest asks of its line and of the run, and the journal that lets a fork's new
branch be brought to the forking guest's state (`instance.GuestInstance.replica`).

`LineCalls` serves the imports that reach past the guest's own sequence: the line's
storage and outputs (`aici:storage`, `host.set-line-output`, contract 0.2.0; the line's
`LineScope`) and the run's tools (`aici:tools`, a `GuestTools`). A guest that may fork
journals every such call with its answer (`Journal.calls`); while a replica replays the
forking guest's inputs, the same calls are answered from that journal instead: a read
gets what it got then, a write is dropped (it was made once already), and a tool is not
called again (a call costs time and may act outside the run). A replay that makes
another call than the journal holds ends the line with `controller_nondeterministic`.

A tool call blocks the guest until its answer is in (`GuestTools.call_tool` bounds the
wait by `--tool-timeout`); a sequence may make `GuestLimits.max_tool_calls`, after which
its calls are answered `tool_quota` without reaching a tool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from aici_cli.control.actions import Action, StepInput
from aici_cli.control.guest_tools import GuestTools, ToolAnswer, ToolInfo
from aici_cli.control.wasm.faults import Fault, clip
from aici_cli.core.errors import ControllerError

if TYPE_CHECKING:
    from aici_cli.control.line_scope import LineScope
    from aici_cli.control.wasm.limits import GuestLimits

T = TypeVar("T")

DETERMINISM = (
    "a controller that forks must answer alike given the same inputs (the sandbox gives it "
    "no clock or randomness)"
)


@dataclass
class Journal:
    """What a guest was given, in order, so that a new instance can be brought to its
    state (`GuestInstance.replica`)."""

    inputs: list[StepInput] = field(default_factory=list)  # every mid-process input
    actions: list[Action] = field(default_factory=list)  # what each call answered
    calls: list[tuple[str, str, Any]] = field(default_factory=list)  # (op, key, answer)

    def copy(self) -> Journal:
        return Journal(list(self.inputs), list(self.actions), list(self.calls))


class LineCalls:
    """The storage, line-output and tool calls of `GuestInstance` (which sets these
    attributes), journaled as the module docstring says."""

    scope: LineScope  # storage and outputs shared with the line's other sequences
    tools: GuestTools  # the run's tools, as this line's guests may call them
    tool_calls: int  # call-tool calls this sequence made (those before a fork included)
    journal: Journal | None  # kept only where a guest can fork (contract 0.2.0)
    _limits: GuestLimits
    _replay: Iterator[tuple[str, str, Any]] | None  # while a replica replays

    # -- storage and the line's outputs (contract 0.2.0), shared by the line's guests --

    def storage_get(self, key: str) -> bytes | None:
        if self._replay is not None:
            return self._replayed("storage get", key)  # type: ignore[no-any-return]
        value = self.scope.get(key)
        self._record("storage get", key, value)
        return value

    def storage_set(self, key: str, value: bytes) -> None:
        if self._replay is not None:
            self._replayed("storage set", key)  # applied when the forking guest made it
            return
        limits = self._limits
        _as_fault(lambda: self.scope.set(key, value, limits.storage_keys, limits.storage_bytes))
        self._record("storage set", key, None)

    def storage_append(self, key: str, value: bytes) -> int:
        if self._replay is not None:
            return int(self._replayed("storage append", key))
        limits = self._limits
        length = _as_fault(
            lambda: self.scope.append(key, value, limits.storage_keys, limits.storage_bytes)
        )
        self._record("storage append", key, length)
        return length

    def set_line_output(self, key: str, value: str) -> None:
        if self._replay is not None:
            return  # made once already, by the forking guest
        limits = self._limits
        _as_fault(lambda: self.scope.set_output(key, value, limits.max_outputs,
                                               limits.output_bytes))

    # -- the run's tools (aici:tools) --

    def list_tools(self) -> list[ToolInfo]:
        """The same for every call of a run: nothing to journal."""
        return self.tools.list_tools()

    def call_tool(self, name: str, arguments: str) -> ToolAnswer:
        self.tool_calls += 1
        key = f"{name} {arguments}"
        if self._replay is not None:
            answer: ToolAnswer = self._replayed("call-tool", key)
            return answer
        cap = self._limits.max_tool_calls
        if self.tool_calls > cap:
            answer = ToolAnswer.error("tool_quota", f"more than {cap} tool calls per sequence")
        else:
            answer = self.tools.call_tool(name, arguments)
        self._record("call-tool", key, answer)
        return answer

    # -- the journal --

    def _record(self, op: str, key: str, answer: Any) -> None:
        if self.journal is not None:
            self.journal.calls.append((op, key, answer))

    def _replayed(self, op: str, key: str) -> Any:
        """The journaled answer of the call a replay makes now."""
        assert self._replay is not None
        entry = next(self._replay, None)
        if entry is None or entry[:2] != (op, key):
            was = "no such call" if entry is None else f"{entry[0]} {entry[1]!r}"
            raise Fault(ControllerError(
                "controller_nondeterministic",
                f"a new branch's guest, replaying the calls before the fork, made {op} "
                f"{clip(repr(key), 100)} where the forking guest made {clip(was, 120)}: "
                f"{DETERMINISM}",
            ))
        return entry[2]


def _as_fault(write: Callable[[], T]) -> T:
    """A write to the line's scope; its quota error ends the call (and the line)."""
    try:
        return write()
    except ControllerError as e:
        raise Fault(e) from None
