"""Controllers that call tools (`aici:tools`, `--allow-tool`), built with the real toolchain
(controllers/examples/calculator.py, `built` in conftest.py) and run through `aici-batch
run` on the tiny model against real MCP servers over stdio (tests/support/mcp_servers.py):
a guest lists and calls an allowed tool and is refused one not on `--allow-tool`; its calls
are traced, recorded and replayed; the engine's own process relays them; a server that
hangs or crashes is the guest's handled `err`; and a controller built against the contract
before `aici:tools` runs unchanged with tools served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import wasmtime
from click.testing import CliRunner
from mcp_servers import command
from paths import CONTROLLERS, ROOT
from wasmtime import component as wc

from aici_cli.cli.main import main
from aici_cli.control.componentize import build_controller

pytestmark = pytest.mark.subprocess

TOOLS = "aici:tools/tools@0.1.0"
CALC = ["--mcp", f"calc={command('calc')}"]
ALLOW = ["--allow-tool", "multiply", "--allow-tool", "lookup"]
LINES = [
    {"id": "mul", "prompt": "What is 17 times 23?"},
    {"id": "add", "prompt": "And 2 + 3?", "controller_arg": {"tool": "add",
                                                          "arguments": {"a": 2, "b": 3}}},
    {"id": "look", "prompt": "Look it up.",
     "controller_arg": {"tool": "lookup", "arguments": {"key": "zorblax"}}},
]


def _run(model: Path, tmp: Path, wasm: Path, lines: list[dict[str, Any]], *extra: str
         ) -> tuple[int, dict[str, dict[str, Any]]]:
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(main, ["run", str(src), "--model", str(model), "--dtype",
                                    "float32", "--device", "cpu", "--max-tokens", "32",
                                    "--controller", str(wasm), "-q", *extra])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, {r["id"]: r for r in map(json.loads, res.stdout.splitlines())}


def _decided(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {i: (r["text"], r["finish_reason"], r.get("outputs")) for i, r in results.items()}


def test_a_controller_lists_and_calls_an_allowed_tool_and_is_refused_another(
        tiny_model_dir: Path, built: dict[str, Path], tmp_path: Path) -> None:
    trace, record = tmp_path / "trace.jsonl", tmp_path / "calls.jsonl"
    code, by_id = _run(tiny_model_dir, tmp_path, built["calculator"], LINES, *CALC, *ALLOW,
                       "--trace", str(trace), "--tool-record", str(record))
    assert code == 0
    mul, add, look = by_id["mul"], by_id["add"], by_id["look"]
    assert mul["text"] == " Answer: 391.0\n" and mul["finish_reason"] == "stop"
    assert mul["outputs"] == {"tools": ["lookup", "multiply"], "answer": "391.0"}
    assert mul["stats"]["ff_tokens"] > 0  # the answer was forced, not sampled
    assert mul["logs"] == "tool lookup: The value stored under a key in the local table.\n" \
                          "tool multiply: Multiply two numbers."
    assert look["outputs"]["answer"] == "42"
    assert add["text"] == " Answer: unknown (tool_not_allowed)\n"
    assert add["outputs"]["message"] == "tool 'add' is not on --allow-tool"
    # A span per call that reached a server, the controller its caller.
    spans = []
    for text in trace.read_text().splitlines():
        for resource in json.loads(text)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                spans += [s for s in scope["spans"] if s["name"].startswith("execute_tool ")]
    attributes = [{a["key"]: next(iter(a["value"].values())) for a in s["attributes"]}
                  for s in spans]
    assert sorted(s["name"] for s in spans) == ["execute_tool lookup", "execute_tool multiply"]
    assert {a["aici.tool.caller"] for a in attributes} == {"controller"}
    assert {a["aici.tool.server"] for a in attributes} == {"calc"}
    # The record lists the allowed tools and holds each call; a replay answers from it.
    entries = [json.loads(x) for x in record.read_text().splitlines()]
    assert [e["tool"] for e in entries if "index" not in e] == ["lookup", "multiply"]
    assert sorted((e["index"], e["name"], e["content"]) for e in entries if "index" in e) == [
        (1, "multiply", "391.0"), (3, "lookup", "42")]
    code, replayed = _run(tiny_model_dir, tmp_path, built["calculator"], LINES, *ALLOW,
                          "--tool-replay", str(record))
    assert code == 0 and _decided(replayed) == _decided(by_id)


def test_the_engine_process_relays_a_controllers_calls(
        tiny_model_dir: Path, built: dict[str, Path], tmp_path: Path) -> None:
    code, by_id = _run(tiny_model_dir, tmp_path, built["calculator"], LINES, *CALC, *ALLOW,
                       "--engine-process", "child")
    assert code == 0
    assert by_id["mul"]["outputs"]["answer"] == "391.0"
    assert by_id["look"]["outputs"]["answer"] == "42"
    assert by_id["add"]["outputs"]["error"] == "tool_not_allowed"
    # Without --allow-tool the engine's process is told of no tool: every call refused.
    code, bare = _run(tiny_model_dir, tmp_path, built["calculator"], LINES[:1], *CALC,
                      "--engine-process", "child")
    assert code == 0 and bare["mul"]["outputs"] == {
        "tools": [], "error": "tool_not_allowed",
        "message": "tool 'multiply' is not on --allow-tool (the run allows its controllers "
                   "no tool)"}


def test_a_hanging_or_crashing_server_is_the_guests_handled_error(
        tiny_model_dir: Path, built: dict[str, Path], tmp_path: Path) -> None:
    servers = ["--mcp", f"hang={command('bad', '--mode', 'hang', '--name', 'stuck')}",
               "--mcp", f"crash={command('bad', '--mode', 'crash', '--name', 'boom')}",
               "--allow-tool", "stuck", "--allow-tool", "boom"]
    lines = [{"id": name, "prompt": "Probe.",
              "controller_arg": {"tool": name, "arguments": {"x": True}}}
             for name in ("stuck", "boom")]
    # The deadline holds the crashing call's restart and lone retry (restarts.py).
    code, by_id = _run(tiny_model_dir, tmp_path, built["calculator"], lines, *servers,
                       "--tool-timeout", "6")
    assert code == 0  # the guest handled its errors: no line failed, the run went on
    stuck, boom = by_id["stuck"], by_id["boom"]
    assert stuck["text"] == " Answer: unknown (tool_timeout)\n"
    assert stuck["outputs"]["message"] == (
        "tool stuck (server hang) did not answer within 6 s (--tool-timeout)")
    assert boom["text"] == " Answer: unknown (tool_server_crashed)\n"
    assert "closed its connection" in boom["outputs"]["message"]
    assert "again when it was sent alone after a restart" in boom["outputs"]["message"]


@pytest.fixture(scope="module")
def older(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """controllers/examples/yes_no.py built against the contract as it was before
    `aici:tools`: the WIT without deps/tools and without its import."""
    tmp = tmp_path_factory.mktemp("older")
    wit = tmp / "wit"
    shutil.copytree(ROOT / "wit", wit)
    shutil.rmtree(wit / "deps" / "tools")
    text = (wit / "controller.wit").read_text(encoding="utf-8")
    (wit / "controller.wit").write_text("".join(
        line for line in text.splitlines(keepends=True)
        if "aici:tools" not in line and "deps/tools" not in line), encoding="utf-8")
    return build_controller(CONTROLLERS / "examples" / "yes_no.py", tmp / "yes_no.wasm",
                            wit).out


def test_an_older_controller_runs_unchanged_with_tools_served(
        tiny_model_dir: Path, older: Path, tmp_path: Path) -> None:
    engine = wasmtime.Engine()
    assert TOOLS not in wc.Component.from_file(engine, str(older)).type.imports(engine)
    lines = [{"id": "sky", "prompt": "Is the sky blue?", "controller_arg": {"question": "sky"}},
             {"id": "dry", "prompt": "Is water dry?"}]
    code, plain = _run(tiny_model_dir, tmp_path, older, lines)
    assert code == 0
    code, served = _run(tiny_model_dir, tmp_path, older, lines, *CALC, "--allow-tool",
                        "multiply")
    assert code == 0 and _decided(served) == _decided(plain)
    assert all(r["outputs"]["answer"] in ("yes", "no") for r in served.values())
