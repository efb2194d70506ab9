"""Runs with real MCP servers over stdio (tests/support/mcp_servers.py, written with the
`mcp` package) and the tiny model: calls run inside the run, their transcripts and trace
spans; servers that crash, hang, answer 10 MB or garbage cost only their lines; servers
that cannot serve stop the run before the model loads; streamable HTTP; a recording
replayed bit for bit; a run killed with `kill -9` and resumed calls no tool of a finished
line; a slow tool holds no row. And docs/tools.md's example on the default model."""

from __future__ import annotations

import json
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner
from mcp_servers import command
from paths import ROOT

from aici_cli.cli.main import main
from aici_cli.core.config import ToolServer
from aici_cli.formats.schemas import load_schema
from aici_cli.run import batch
from aici_cli.run.tools.restarts import RestartPolicy
from aici_cli.run.tools.servers import ToolServers

pytestmark = pytest.mark.subprocess

RESULT_SCHEMA = load_schema("result-line")
STATS_SCHEMA = load_schema("stats")
TABLE = {"zorblax": "42", "quibble": "17"}
# Arguments the tiny random model finishes in a few tokens: enums.
ADD = {"type": "object", "properties": {"a": {"enum": [2, 3]}, "b": {"enum": [2, 3]}},
       "required": ["a", "b"]}
LOOKUP = {"type": "object", "properties": {"key": {"enum": list(TABLE)}}, "required": ["key"]}
PROBE = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}


def _server(name: str, kind: str, *args: str) -> str:
    return f"{name}={command(kind, *args)}"


def _line(i: int, tool: str, parameters: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"id": f"l{i}", "messages": [{"role": "user", "content": f"Question {i}?"}],
            "tools": [{"type": "function", "function": {"name": tool,
                                                        "parameters": parameters}}],
            "tool_choice": "required", "max_tokens": 60, **extra}


def _run(model: Path, tmp: Path, lines: list[dict[str, Any]], *extra: str,
         out_name: str = "out.jsonl") -> tuple[int, dict[str, dict[str, Any]], dict[str, Any]]:
    src, out, stats = tmp / "in.jsonl", tmp / out_name, tmp / "stats.json"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(model),
                                    "--dtype", "float32", "--stats-out", str(stats), "-q",
                                    *extra])
    assert res.exit_code in (0, 1), res.output
    results = [json.loads(x) for x in out.read_text().splitlines()]
    for result in results:
        jsonschema.validate(result, RESULT_SCHEMA)
    summary = json.loads(stats.read_text())
    jsonschema.validate(summary, STATS_SCHEMA)
    return res.exit_code, {r["id"]: r for r in results}, summary


def _tool_messages(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in result.get("transcript", []) if m["role"] == "tool"]


def test_served_tools_run_inside_the_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    lines = [_line(1, "add", ADD), _line(2, "lookup", LOOKUP), _line(3, "weather", PROBE),
             {"id": "l4", "prompt": "Hello", "max_tokens": 4}]
    trace = tmp_path / "trace.jsonl"
    code, by_id, summary = _run(tiny_model_dir, tmp_path, lines, "--max-tool-rounds", "1",
                                "--mcp", _server("calc", "calc"), "--trace", str(trace))
    assert code == 0
    add, lookup = by_id["l1"], by_id["l2"]
    [call] = add["transcript"][0]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, ADD)
    [answer] = _tool_messages(add)
    assert answer["content"] == str(float(arguments["a"] + arguments["b"]))
    assert answer["server"] == "calc" and answer["tool_call_id"] == call["id"]
    [asked] = lookup["transcript"][0]["tool_calls"]
    assert _tool_messages(lookup)[0]["content"] == TABLE[
        json.loads(asked["function"]["arguments"])["key"]]
    for line in (add, lookup):  # the next round ran, from the cached prefix
        assert line["finish_reason"] in ("stop", "length", "tool_calls")
        assert line["stats"]["cached_tokens"] > 0
    # A tool no server serves is handed back, as without --mcp; a plain line is plain.
    assert by_id["l3"]["finish_reason"] == "tool_calls" and "transcript" not in by_id["l3"]
    assert "transcript" not in by_id["l4"]
    assert summary["tools"]["calc"]["calls"] == 2 and summary["tools"]["calc"]["failed"] == 0
    # A span per call, its line, tool and server named, its time the transcript's.
    spans = {span["attributes"]["aici.line.index"]: span for span in _tool_spans(trace)}
    assert sorted(spans) == [1, 2]
    for index, line in ((1, add), (2, lookup)):
        span = spans[index]
        [answer] = _tool_messages(line)
        assert span["name"] == f"execute_tool {answer['name']}"
        assert span["attributes"]["gen_ai.tool.name"] == answer["name"]
        assert span["attributes"]["aici.tool.server"] == "calc"
        took_ms = (int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])) / 1e6
        assert took_ms == pytest.approx(answer["ms"], abs=0.01)


def _tool_spans(trace: Path) -> list[dict[str, Any]]:
    """The `execute_tool` spans of an OTLP JSON file."""
    return _spans(trace, "execute_tool ")


def _spans(trace: Path, name: str) -> list[dict[str, Any]]:
    """The spans of an OTLP JSON file whose name starts with `name`, their attributes as a
    dict."""
    spans = []
    for text in trace.read_text().splitlines():
        for resource in json.loads(text)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                spans += [s for s in scope["spans"] if s["name"].startswith(name)]
    for span in spans:
        span["attributes"] = {a["key"]: _value(a["value"]) for a in span.get("attributes", [])}
    return spans


def _value(value: dict[str, Any]) -> Any:
    """An OTLP JSON attribute's value (an int is written as a string there)."""
    [(kind, v)] = value.items()
    return int(v) if kind == "intValue" else v


def test_misbehaving_servers_cost_only_their_lines(tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
    modes = {"crash": "tool_server_crashed", "big": "tool_result_too_large",
             "garbage": "tool_bad_output"}
    servers = [arg for mode in [*modes, "ok"] for arg in (
        "--mcp", _server(mode, "bad", "--mode", mode, "--name", f"probe_{mode}"))]
    lines = [_line(i, f"probe_{mode}", PROBE) for i, mode in enumerate([*modes, "ok"])]
    lines.append(_line(9, "add", ADD))
    code, by_id, summary = _run(tiny_model_dir, tmp_path, lines, "--max-tool-rounds", "1",
                                "--mcp", _server("calc", "calc"), *servers)
    assert code == 1
    for i, (mode, etype) in enumerate(modes.items()):
        line = by_id[f"l{i}"]
        assert line["error"]["type"] == etype, (mode, line["error"])
        assert line["error"]["message"].startswith(f"line {i + 1}: ")
        assert _tool_messages(line)[-1]["error"]["type"] == etype
        assert summary["tools"][mode]["failed"] == 1
        # The call broke its server, and again when it was retried alone.
        assert summary["tools"][mode]["restarts"] == (0 if mode == "big" else 2)
    assert summary["tools"]["ok"]["restarts"] == 0
    assert by_id["l3"]["finish_reason"] != "error"
    assert _tool_messages(by_id["l3"])[0]["content"] == "fine"
    assert by_id["l9"]["finish_reason"] != "error"
    assert summary["errors"] == 3
    # A server that hangs: past the deadline, its line's error.
    hang = ["--mcp", _server("hang", "bad", "--mode", "hang", "--name", "stuck")]
    code, by_id, _ = _run(tiny_model_dir, tmp_path, [_line(1, "stuck", PROBE),
                                                      _line(2, "add", ADD)],
                          "--tool-timeout", "1.5", "--max-tool-rounds", "1", *hang,
                          "--mcp", _server("calc", "calc"))
    assert by_id["l1"]["error"]["type"] == "tool_timeout"
    assert "did not answer within 1.5 s" in by_id["l1"]["error"]["message"]
    assert by_id["l2"]["finish_reason"] != "error"


def test_a_crashed_server_is_restarted_within_its_budget() -> None:
    """A server that exits at every call: the call crashes it twice (once, then alone after
    the restart) and fails; the same call again fails unsent; with the budget spent, the
    next call finds the server down."""
    crash = _server("c", "bad", "--mode", "crash").split("=", 1)[1]
    servers = ToolServers([ToolServer("c", crash)], 20.0, 1024, RestartPolicy(2, 0.05, 0.1))
    try:
        first = servers.call(1, "probe", '{"x": true}').result(60)
        assert first.error is not None and first.error[0] == "tool_server_crashed"
        assert "and again when it was sent alone after a restart" in first.error[1]
        again = servers.call(2, "probe", '{"x": true}').result(60)
        assert again.error is not None and again.error[0] == "tool_server_crashed"
        assert "twice on this same call already" in again.error[1]
        assert servers.restarts() == {"c": 2}
        down = servers.call(3, "probe", '{"x": false}').result(60)
        assert down.error == ("tool_server_down", "server c closed its connection (it exited "
                              "or crashed), and its 2 restart(s) for this run are spent "
                              "(--tool-restarts)")
        assert servers.restarts() == {"c": 2}
    finally:
        servers.close()


@pytest.mark.parametrize(("servers", "message"), [
    ([_server("calc", "calc"), _server("dup", "dup")],
     "--mcp: servers calc and dup both serve a tool named 'add'"),
    (["gone=/nonexistent/server --stdio"], "--mcp gone: the server did not start"),
    ([f"quits={sys.executable} -c pass"], "--mcp quits: the server did not start"),
])
def test_servers_that_cannot_serve_stop_the_run_before_the_model_loads(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        servers: list[str], message: str) -> None:
    def no_load(*_: Any) -> None:
        raise AssertionError("the model loads")

    monkeypatch.setattr(batch, "_start_backend", no_load)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n')
    args = [arg for server in servers for arg in ("--mcp", server)]
    res = CliRunner().invoke(main, ["run", str(src), "--model", str(tiny_model_dir), *args])
    assert res.exit_code == 2, res.output
    [error] = [x for x in res.output.splitlines() if x.strip()]
    assert message in error


@pytest.fixture
def http_calc() -> Iterator[str]:
    """The calc server serving streamable HTTP on a free port of 127.0.0.1: its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(shlex.split(command("calc", "--port", str(port))),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(10)


def test_a_streamable_http_server(tiny_model_dir: Path, tmp_path: Path,
                                  http_calc: str) -> None:
    code, by_id, summary = _run(tiny_model_dir, tmp_path, [_line(1, "lookup", LOOKUP)],
                                "--max-tool-rounds", "1", "--mcp", f"calc={http_calc}")
    [call] = by_id["l1"]["transcript"][0]["tool_calls"]
    assert _tool_messages(by_id["l1"])[0]["content"] == TABLE[
        json.loads(call["function"]["arguments"])["key"]]
    assert summary["tools"]["calc"]["calls"] == 1


def test_a_recording_replays_bit_for_bit(tiny_model_dir: Path, tmp_path: Path) -> None:
    lines = [_line(i, "add" if i % 2 else "lookup", ADD if i % 2 else LOOKUP,
                   temperature=0.8, seed=i) for i in range(1, 7)]
    record = tmp_path / "calls.jsonl"
    calc = _server("calc", "calc")
    _, recorded, _ = _run(tiny_model_dir, tmp_path, lines, "--deterministic", "--mcp", calc,
                          "--tool-record", str(record), "--max-tool-rounds", "2")
    entries = [json.loads(x) for x in record.read_text().splitlines()]
    assert len(entries) == sum(len(_tool_messages(r)) for r in recorded.values()) > 0
    _, replayed, _ = _run(tiny_model_dir, tmp_path, lines, "--deterministic",
                          "--tool-replay", str(record), "--max-tool-rounds", "2",
                          out_name="replayed.jsonl")

    def kept(result: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in result.items() if k != "stats"}  # stats hold timings

    assert {k: kept(v) for k, v in replayed.items()} == {k: kept(v) for k, v in
                                                         recorded.items()}
    # A call the file lacks is its line's error.
    first = entries[0]
    others = [e for e in entries if (e["name"], e["arguments"]) != (first["name"],
                                                                   first["arguments"])]
    record.write_text("".join(json.dumps(e) + "\n" for e in others + [
        {**first, "arguments": '{"never": "made"}'}]))
    _, partial, _ = _run(tiny_model_dir, tmp_path, lines, "--deterministic", "--tool-replay",
                         str(record), "--max-tool-rounds", "2", out_name="partial.jsonl")
    assert partial[f"l{first['index']}"]["error"]["type"] == "tool_not_recorded"


def test_a_killed_run_resumed_calls_no_tool_of_a_finished_line(tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    """`kill -9` in the middle of a run whose calls are out, then `--resume`: the lines
    whose results were written call no tool again; the record keeps every call."""
    lines = [_line(i, "lookup", LOOKUP) for i in range(1, 13)]
    src, out, record = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "calls.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    slow = _server("calc", "calc", "--delay", "0.3")
    args = ["run", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--dtype",
            "float32", "-q", "--batch-size", "2", "--lookahead", "1", "--mcp", slow,
            "--tool-record", str(record), "--max-tool-rounds", "1"]
    run = subprocess.Popen([sys.executable, "-m", "aici_cli", *args],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() or out.read_bytes().count(b"\n") < 3:
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        run.send_signal(signal.SIGKILL)
    finally:
        run.wait(30)
    assert run.returncode == -signal.SIGKILL
    text = out.read_text()
    done = {json.loads(x)["index"] for x in text[:text.rfind("\n") + 1].splitlines()}
    assert 3 <= len(done) < len(lines)
    before = record.read_text().splitlines(keepends=True)
    whole = [json.loads(x) for x in before if x.endswith("\n")]
    assert done <= {e["index"] for e in whole}  # a written result's calls are recorded
    res = CliRunner().invoke(main, [*args, "--resume"])
    assert res.exit_code == 0, res.output
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["index"] for r in results) == list(range(1, 13))
    again = [json.loads(x) for x in record.read_text().splitlines()[len(whole):]]
    assert again and not {e["index"] for e in again} & done


def test_a_slow_tool_holds_no_row(tiny_model_dir: Path, tmp_path: Path) -> None:
    """16 lines at batch 8, each calling a tool that takes 1 s: the calls overlap and the
    rows keep decoding while they are out (bench/agent_tools.py measures the ratio). Read
    from the trace's spans, so that a busy machine's slower steps do not matter."""
    lines = [_line(i, "lookup", LOOKUP) for i in range(16)]
    trace = tmp_path / "trace.jsonl"
    code, by_id, summary = _run(tiny_model_dir, tmp_path, lines, "--batch-size", "8",
                                "--max-tool-rounds", "1", "--trace", str(trace),
                                "--mcp", _server("calc", "calc", "--delay", "1"))
    assert code == 0 and len(by_id) == 16
    assert summary["tools"]["calc"]["calls"] == 16
    assert summary["tools"]["calc"]["ms"] >= 16_000  # 16 s of calls, one after another
    calls = sorted(_interval(span) for span in _tool_spans(trace))
    out: list[tuple[float, float]] = []  # the moments some call was out, merged
    for start, end in calls:
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    assert sum(end - start for start, end in out) < 16 / 4  # 4 calls or more at a time
    # Passes ran while calls were out: the lines that came next took the rows.
    steps = [_interval(span) for span in _spans(trace, "step")]
    assert any(a <= start and end <= b for start, end in steps for a, b in out)


def _interval(span: dict[str, Any]) -> tuple[float, float]:
    return int(span["startTimeUnixNano"]) / 1e9, int(span["endTimeUnixNano"]) / 1e9


EXAMPLE = ROOT / "examples" / "tools"


@pytest.mark.real_model
def test_the_default_model_runs_tool_questions_to_their_answers(tmp_path: Path) -> None:
    """docs/tools.md's example on the default model: every line calls a tool whose
    arguments validate, gets its answer, and ends in an answer (or its calls handed back
    after the last round), its transcript in its result."""
    questions = EXAMPLE / "questions.jsonl"
    table = runpy.run_path(str(EXAMPLE / "calc_server.py"))["TABLE"]
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    server = shlex.join([sys.executable, str(EXAMPLE / "calc_server.py")])
    res = CliRunner().invoke(main, ["run", str(questions), "-o", str(out), "-q", "--stats-out",
                                    str(stats), "--max-tool-rounds", "2", "--compile", "off",
                                    "--mcp", f"calc={server}"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in questions.read_text().splitlines()]
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(results) == sorted(line["id"] for line in lines)
    calls = 0
    for line in lines:
        result = results[line["id"]]
        jsonschema.validate(result, RESULT_SCHEMA)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in line["tools"]}
        transcript = result["transcript"]
        assert transcript[0]["role"] == "assistant" and transcript[-1]["role"] == "assistant"
        answers = {m["tool_call_id"]: m for m in _tool_messages(result)}
        for message in transcript:
            for call in message.get("tool_calls") or ():
                name = call["function"]["name"]
                arguments = json.loads(call["function"]["arguments"])
                jsonschema.validate(arguments, schemas[name])  # no call fails its schema
                if message is transcript[-1]:
                    continue  # handed back after the last round
                calls += 1
                answer = answers[call["id"]]
                if name == "multiply":
                    product = arguments["a"] * arguments["b"]
                    assert float(answer["content"]) == pytest.approx(product)
                elif arguments["key"] in table:
                    assert answer["content"] == table[arguments["key"]]
                else:
                    assert answer["is_error"] and "no entry" in answer["content"]
        if result["finish_reason"] != "tool_calls":
            assert transcript[-1]["content"] == result["text"]  # the final answer
    summary = json.loads(stats.read_text())
    assert summary["tools"]["calc"]["calls"] == calls >= len(lines)
    assert summary["tools"]["calc"]["failed"] == 0


@pytest.mark.real_model
def test_a_server_that_crashes_on_one_argument_costs_only_its_lines(tmp_path: Path) -> None:
    """16 lines at batch 8 on the default model, each calling `lookup` of a server that
    exits when asked for one key (2 lines ask for it) and takes 0.5 s a call otherwise, so
    that calls are out together when it crashes: only those 2 lines fail
    (`tool_server_crashed`); the 14 others get their answers, those caught by the crash
    retried on the restarted server."""
    boom = {2, 11}
    lines = [_line(i, "lookup", {"type": "object", "properties": {
        "key": {"const": "boom"} if i in boom else {"enum": list(TABLE)}}, "required": ["key"]},
        parallel_tool_calls=False) for i in range(16)]
    src, out, stats = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "stats.json"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    server = _server("calc", "calc", "--delay", "0.5", "--crash-on", "boom")
    res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "-q", "--stats-out",
                                    str(stats), "--batch-size", "8", "--max-tool-rounds", "1",
                                    "--compile", "off", "--mcp", server])
    assert res.exit_code == 1, res.output  # line errors
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert len(results) == 16
    for i in range(16):
        result = results[f"l{i}"]
        jsonschema.validate(result, RESULT_SCHEMA)
        [answer] = _tool_messages(result)
        if i in boom:
            assert result["finish_reason"] == "error"
            assert result["error"]["type"] == "tool_server_crashed", result["error"]
            assert answer["error"]["type"] == "tool_server_crashed"
        else:
            assert result["finish_reason"] != "error", (i, result.get("error"))
            [call] = result["transcript"][0]["tool_calls"]
            assert answer["content"] == TABLE[json.loads(call["function"]["arguments"])["key"]]
    summary = json.loads(stats.read_text())
    jsonschema.validate(summary, STATS_SCHEMA)
    assert summary["errors"] == 2 and summary["error_types"] == {"tool_server_crashed": 2}
    calc = summary["tools"]["calc"]
    assert (calc["calls"], calc["failed"]) == (16, 2)
    # The first "boom" crashed the server twice (among others, then alone); the second
    # failed unsent.
    assert calc["restarts"] == 2
