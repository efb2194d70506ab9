"""A controller's tool calls from an engine in a process of its own, relayed to the run's
process, where the tools live (`--mcp` servers are the run's: they start before the
engine's first life and outlive its deaths).

In the engine's process, `RelayedTools` serves a line's `aici:tools` imports: `list-tools`
from the list the run sent with `Start`, and each `call-tool` as a `ToolCall` message,
the calling guest (and with it the engine's step) waiting for its `ToolAnswered`, which
the reader thread hands over (`answered`). The wait is bounded like an in-process call's
(`guest_tools.wait_answer`); an answer that comes after it is dropped. In the run's
process, `serve_call` hands a `ToolCall` to the run's tools and sends the answer back when
it is in, from whichever thread ends the call, so the run's loop never waits on a tool.
A relayed call costs a round trip over the socket besides the call itself.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from aici_cli.control.guest_tools import (
    NO_TOOLS,
    GuestTools,
    RunTools,
    ToolAnswer,
    ToolInfo,
    wait_answer,
)
from aici_cli.run.backends.child_messages import ToolAnswered, ToolCall


class RelayedTools:
    """The engine process's side (see the module docstring). Thread-safe: the engine's
    thread calls, the reader thread answers."""

    def __init__(self, infos: Sequence[ToolInfo], send: Callable[[object], None],
                 timeout_s: float) -> None:
        self.infos = list(infos)
        self.timeout_s = timeout_s  # --tool-timeout, the run's deadline for each call
        self._send = send
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, Future[ToolAnswer]] = {}

    def call(self, index: int, name: str, arguments: str) -> ToolAnswer:
        answer: Future[ToolAnswer] = Future()
        with self._lock:
            call_id = next(self._ids)
            self._waiting[call_id] = answer
        try:
            self._send(ToolCall(call_id, index, name, arguments))
            return wait_answer(answer, name, self.timeout_s)
        finally:
            with self._lock:
                self._waiting.pop(call_id, None)

    def answered(self, message: ToolAnswered) -> None:
        """The run's answer to a call (on the reader thread); a late one is dropped."""
        with self._lock:
            answer = self._waiting.pop(message.id, None)
        if answer is not None:
            answer.set_result(message.answer)

    def for_line(self, index: int) -> GuestTools:
        return _RelayedLine(self, index)


class _RelayedLine:
    """One line's `GuestTools` in the engine's process."""

    def __init__(self, relay: RelayedTools, index: int) -> None:
        self.relay = relay
        self.index = index

    def list_tools(self) -> list[ToolInfo]:
        return list(self.relay.infos)

    def call_tool(self, name: str, arguments: str) -> ToolAnswer:
        return self.relay.call(self.index, name, arguments)


def serve_call(tools: RunTools | None, call: ToolCall,
               send: Callable[[object], None]) -> None:
    """The run's side: `call` answered by `tools` (refused where the run allows none),
    its answer sent back with `send` once it is in."""
    if tools is None:
        send(ToolAnswered(call.id, NO_TOOLS.call_tool(call.name, call.arguments)))
        return
    tools.submit(call.index, call.name, call.arguments).add_done_callback(
        lambda done: send(ToolAnswered(call.id, done.result())))
