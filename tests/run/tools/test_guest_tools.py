"""The controllers' tool calls (`GuestToolHost`, `aici:tools`) without a model or a server
(fast): `--allow-tool` checked against the served tools, refusals, each outcome as the
guest's `result<string, string>`, the wait bounded, a span per call, the record's listing
replayed; and the options that cannot go together."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from aici_cli.cli.main import main
from aici_cli.control import guest_tools
from aici_cli.control.guest_tools import ToolAnswer, ToolInfo
from aici_cli.core.config import ToolOptions
from aici_cli.core.errors import UsageError
from aici_cli.run.tools.calls import CallOutcome, ServedTool
from aici_cli.run.tools.guest import GuestToolHost, allowed_tools
from aici_cli.run.tools.host import guest_tool_host, open_tool_host
from aici_cli.run.tools.record import Recorder

SCHEMA = {"type": "object", "properties": {"a": {"type": "number"}}}


class Host:
    """A `ToolHost` answering on a thread of its own, as `answers[name](arguments)`; a name
    missing from `answers` is never answered (a server that hangs)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.tools = {name: ServedTool("calc", name, f"{name} it", SCHEMA)
                      for name in [*answers, "hangs"]}
        self.sent: list[tuple[int, str, str]] = []

    def call(self, index: int, name: str, arguments: str) -> Future[CallOutcome]:
        self.sent.append((index, name, arguments))
        future: Future[CallOutcome] = Future()
        if name in self.answers:
            threading.Timer(0.01, lambda: future.set_result(
                self.answers[name](json.loads(arguments)))).start()
        return future

    def close(self) -> None:
        pass


HOST_ANSWERS = {
    "add": lambda a: CallOutcome("calc", str(a["a"] + a["b"]), ms=2.0, t0=1.0, t1=1.002),
    "divide": lambda a: CallOutcome("calc", "division by zero", is_error=True),
    "crashes": lambda a: CallOutcome("calc", error=("tool_server_crashed",
                                                    "server calc closed its connection")),
}


def test_allow_tool_names_served_tools() -> None:
    tools = Host(HOST_ANSWERS).tools
    assert [t.name for t in allowed_tools(tools, ["divide", "add", "add"])] == ["add", "divide"]
    with pytest.raises(UsageError, match=r"--allow-tool mul: no --mcp server serves a tool "
                                         r"of that name \(served: add, crashes, divide, hangs\)"):
        allowed_tools(tools, ["add", "mul"])
    with pytest.raises(UsageError, match="the --tool-replay file holds no call or listing"):
        allowed_tools(tools, ["mul"], replay=True)


def test_guests_list_and_call_allowed_tools_only() -> None:
    host = Host(HOST_ANSWERS)
    run = GuestToolHost(host, ["add", "divide", "crashes", "hangs"], timeout_s=30.0)
    spans: list[tuple[int, str, CallOutcome]] = []
    run.trace = lambda index, name, outcome: spans.append((index, name, outcome))
    assert [info.name for info in run.infos] == ["add", "crashes", "divide", "hangs"]
    assert run.infos[0] == ToolInfo("add", "add it", json.dumps(SCHEMA))
    line = run.for_line(7)
    assert line.list_tools() == run.infos
    assert line.call_tool("add", '{"a": 1, "b": 2}') == ToolAnswer(True, "3")
    assert line.call_tool("divide", '{"a": 1, "b": 0}') == ToolAnswer(
        False, "tool_error: division by zero")
    assert line.call_tool("crashes", "{}") == ToolAnswer(
        False, "tool_server_crashed: server calc closed its connection")
    # Refused before reaching the host: not allowed, not JSON, not an object.
    assert GuestToolHost(host, ["add"], 30.0).for_line(7).call_tool("divide", "{}") == \
        ToolAnswer(False, "tool_not_allowed: tool 'divide' is not on --allow-tool")
    assert line.call_tool("add", "{oops").text.startswith(
        "tool_bad_arguments: the arguments of add are not JSON")
    assert line.call_tool("add", "[1]") == ToolAnswer(
        False, "tool_bad_arguments: the arguments of add are JSON list, not an object")
    assert [s[:2] for s in host.sent] == [(7, "add"), (7, "divide"), (7, "crashes")]
    assert [(index, name, outcome.t0) for index, name, outcome in spans] == [
        (7, "add", 1.0), (7, "divide", 0.0), (7, "crashes", 0.0)]


def test_a_call_the_host_never_answers_ends_at_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest_tools, "ANSWER_GRACE_S", 0.05)
    line = GuestToolHost(Host(HOST_ANSWERS), ["hangs"], timeout_s=0.05).for_line(1)
    assert line.call_tool("hangs", "{}") == ToolAnswer(
        False, "tool_timeout: tool hangs did not answer within 0.05 s (--tool-timeout)")


def test_without_allow_tool_controllers_get_no_tools() -> None:
    host = Host(HOST_ANSWERS)
    assert guest_tool_host(host, ToolOptions()) is None
    assert guest_tool_host(None, ToolOptions(allowed=("add",))) is None
    made = guest_tool_host(host, ToolOptions(allowed=("add",), call_timeout_s=3.0))
    assert made is not None and made.timeout_s == 3.0


def test_a_recording_lists_the_allowed_tools_for_a_replay(tmp_path: Path) -> None:
    record = tmp_path / "calls.jsonl"
    host = Host(HOST_ANSWERS)
    recorder = Recorder(host, str(record), listed=allowed_tools(host.tools, ["add"]))
    assert GuestToolHost(recorder, ["add"], 30.0).for_line(3).call_tool(
        "add", '{"a": 2, "b": 2}') == ToolAnswer(True, "4")
    recorder.close()
    entries = [json.loads(x) for x in record.read_text().splitlines()]
    assert entries[0] == {"tool": "add", "server": "calc", "description": "add it",
                          "input_schema": SCHEMA}
    assert (entries[1]["index"], entries[1]["content"]) == (3, "4")
    replay = open_tool_host(ToolOptions(replay=str(record), allowed=("add",)), resume=False)
    assert replay is not None
    run = GuestToolHost(replay, ["add"], 30.0)
    assert run.infos == [ToolInfo("add", "add it", json.dumps(SCHEMA))]
    assert run.for_line(3).call_tool("add", '{"b": 2, "a": 2}') == ToolAnswer(True, "4")
    assert run.for_line(4).call_tool("add", '{"a": 9, "b": 9}').text.startswith(
        "tool_not_recorded: ")
    with pytest.raises(UsageError, match="--allow-tool mul: the --tool-replay file"):
        open_tool_host(ToolOptions(replay=str(record), allowed=("mul",)), resume=False)


@pytest.mark.parametrize(("args", "message"), [
    (["--allow-tool", "add", "--controller", "c.wasm"], "--allow-tool names tools of --mcp"),
    (["--allow-tool", "add", "--mcp", "c=x"], "--allow-tool lets a --controller call tools"),
])
def test_allow_tool_options_that_cannot_go_together(tmp_path: Path, args: list[str],
                                                    message: str) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n')
    res = CliRunner().invoke(main, ["run", str(src), *args])
    assert res.exit_code == 2 and message in res.output, res.output
