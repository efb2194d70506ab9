"""A controller's tool calls relayed from the engine's process to the run's (fast, without
a process: both sides of `tool_relay.py` over a function that stands for the socket).
`tests/run/tools/test_controller_tools.py` runs the relay between real processes."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from aici_cli.control import guest_tools
from aici_cli.control.guest_tools import ToolAnswer
from aici_cli.run.backends.child_messages import ToolAnswered, ToolCall
from aici_cli.run.backends.tool_relay import RelayedTools, serve_call
from aici_cli.run.tools.calls import CallOutcome, ServedTool
from aici_cli.run.tools.guest import GuestToolHost


class AddHost:
    """A `ToolHost` serving `add` from a thread of its own."""

    tools = {"add": ServedTool("calc", "add", "Add two numbers.", {"type": "object"})}

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, str]] = []

    def call(self, index: int, name: str, arguments: str) -> Future[CallOutcome]:
        self.sent.append((index, name, arguments))
        future: Future[CallOutcome] = Future()
        threading.Timer(0.01, lambda: future.set_result(CallOutcome("calc", "3"))).start()
        return future

    def close(self) -> None:
        pass


def test_a_relayed_call_is_answered_by_the_runs_tools() -> None:
    host = AddHost()
    run = GuestToolHost(host, ["add"], timeout_s=30.0)
    messages: list[object] = []

    def to_run(message: object) -> None:  # the engine's process sends; the run serves it
        messages.append(message)
        assert isinstance(message, ToolCall)
        serve_call(run, message, lambda answer: (messages.append(answer),
                                                 relay.answered(answer)))  # type: ignore[arg-type]

    relay = RelayedTools(run.infos, to_run, timeout_s=30.0)
    line = relay.for_line(4)
    assert line.list_tools() == run.infos
    assert line.call_tool("add", '{"a": 1, "b": 2}') == ToolAnswer(True, "3")
    assert line.call_tool("mul", "{}") == ToolAnswer(
        False, "tool_not_allowed: tool 'mul' is not on --allow-tool")
    assert host.sent == [(4, "add", '{"a": 1, "b": 2}')]
    assert messages[:2] == [ToolCall(1, 4, "add", '{"a": 1, "b": 2}'),
                            ToolAnswered(1, ToolAnswer(True, "3"))]


def test_a_run_without_tools_refuses_at_once() -> None:
    answers: list[object] = []
    serve_call(None, ToolCall(1, 0, "add", "{}"), answers.append)
    assert answers == [ToolAnswered(1, ToolAnswer(
        False, "tool_not_allowed: tool 'add' is not on --allow-tool (the run allows its "
               "controllers no tool)"))]


def test_an_answer_that_never_comes_ends_the_call_and_a_late_one_is_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest_tools, "ANSWER_GRACE_S", 0.05)
    sent: list[ToolCall] = []
    relay = RelayedTools([], sent.append, timeout_s=0.05)  # type: ignore[arg-type]
    assert relay.for_line(2).call_tool("add", "{}") == ToolAnswer(
        False, "tool_timeout: tool add did not answer within 0.05 s (--tool-timeout)")
    relay.answered(ToolAnswered(sent[0].id, ToolAnswer(True, "late")))  # nobody waits: dropped
    assert relay._waiting == {}
