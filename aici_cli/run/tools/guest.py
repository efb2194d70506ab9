"""`GuestToolHost`: the run's tools as its controllers may call them (`aici:tools`,
wit/deps/tools/tools.wit), behind the same `ToolHost` as the model's calls: the servers,
a replay, a recording. So a guest's call is checked, bounded (`--tool-timeout`,
`--tool-result-bytes`), made untrusted text, traced and recorded as the model's are.

What it adds for guests: `--allow-tool` (a tool not on it is refused with
`tool_not_allowed`, and `list-tools` shows only those on it), arguments that must be
the JSON text of an object (`tool_bad_arguments`), and each outcome as the guest's
`result<string, string>`: the answer's text, or `TYPE: message` (the tool's own error is
`tool_error`, the host's errors keep their type). Nothing a server does reaches the run:
every failure is the calling guest's `err`.

A guest's call blocks its engine step (the guest waits in a host function); the wait is
bounded by the host's deadline plus a grace (`guest_tools.wait_answer`). Torch-free and
mcp-free.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

from aici_cli.control.guest_tools import (
    GuestTools,
    ToolAnswer,
    ToolInfo,
    not_allowed,
    wait_answer,
)
from aici_cli.core.errors import UsageError
from aici_cli.run.tools.calls import CallOutcome, ServedTool, ToolHost


def allowed_tools(tools: Mapping[str, ServedTool], allowed: Iterable[str],
                  replay: bool = False) -> list[ServedTool]:
    """The served tools `--allow-tool` names, by name; a name no server serves is a
    `UsageError` (a typo would otherwise only show as guests' refused calls)."""
    listed = []
    for name in sorted(set(allowed)):
        tool = tools.get(name)
        if tool is None:
            where = ("the --tool-replay file holds no call or listing of a tool"
                     if replay else "no --mcp server serves a tool")
            served = ", ".join(sorted(tools)) or "none"
            raise UsageError(f"--allow-tool {name}: {where} of that name (served: {served})")
        listed.append(tool)
    return listed


def outcome_answer(outcome: CallOutcome) -> ToolAnswer:
    """A call's outcome as a guest gets it (see the module docstring)."""
    if outcome.error is not None:
        return ToolAnswer.error(*outcome.error)
    if outcome.is_error:
        return ToolAnswer.error("tool_error", outcome.content or "")
    return ToolAnswer(True, outcome.content or "")


class GuestToolHost:
    """The tools of `host` that `allowed` names, for the run's controllers (implements
    `aici_cli.control.guest_tools.RunTools`)."""

    def __init__(self, host: ToolHost, allowed: Iterable[str], timeout_s: float) -> None:
        self.host = host
        self.timeout_s = timeout_s  # --tool-timeout: the servers' deadline for a call
        self.trace: Callable[[int, str, Any], None] | None = None  # a traced run's spans
        self.allowed = frozenset(allowed)
        self.infos = [ToolInfo(tool.name, tool.description or "",
                               json.dumps(tool.input_schema, ensure_ascii=False))
                      for name, tool in sorted(host.tools.items()) if name in self.allowed]

    def submit(self, index: int, name: str, arguments: str) -> Future[ToolAnswer]:
        """The answer to line `index`'s call, as a future that never fails: a refused
        call's at once, a served one's when its host answers (on the host's thread)."""
        answered: Future[ToolAnswer] = Future()
        refused = self._refusal(name, arguments)
        if refused is not None:
            answered.set_result(refused)
            return answered

        def done(call: Future[CallOutcome]) -> None:
            if call.cancelled() or call.exception() is not None:  # the run is closing
                answered.set_result(ToolAnswer.error("tool_failed", "the run is closing"))
                return
            outcome = call.result()
            if self.trace is not None:
                self.trace(index, name, outcome)
            answered.set_result(outcome_answer(outcome))

        self.host.call(index, name, arguments).add_done_callback(done)
        return answered

    def _refusal(self, name: str, arguments: str) -> ToolAnswer | None:
        if name not in self.allowed or name not in self.host.tools:
            return not_allowed(name)
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError) as e:
            return ToolAnswer.error("tool_bad_arguments",
                                    f"the arguments of {name} are not JSON ({e})")
        if not isinstance(value, dict):
            return ToolAnswer.error("tool_bad_arguments", f"the arguments of {name} are "
                                    f"JSON {type(value).__name__}, not an object")
        return None

    def for_line(self, index: int) -> GuestTools:
        """The tools of line `index`'s guests, whose calls wait for their answers."""
        return _LineTools(self, index)


class _LineTools:
    """One line's `GuestTools` in the engine's own process."""

    def __init__(self, run: GuestToolHost, index: int) -> None:
        self.run = run
        self.index = index

    def list_tools(self) -> list[ToolInfo]:
        return list(self.run.infos)

    def call_tool(self, name: str, arguments: str) -> ToolAnswer:
        return wait_answer(self.run.submit(self.index, name, arguments), name,
                           self.run.timeout_s)

