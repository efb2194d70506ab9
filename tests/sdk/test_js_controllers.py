"""The JavaScript examples, built with componentize-js, run through `aici-batch run`.

Each one runs on the same lines as its Python twin (controllers/examples) and must write
the same results: text, outputs, finish reasons, token counts. Building takes about 15 s
per example and wasmtime's first compile of each about 30 s more, so the components are
built once per session (`built_js` and `built`, in conftest.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import wasmtime
from controller_runs import run_controller
from mcp_servers import command
from wasmtime import component as wc

CONTRACT = "aici:controller/controller@0.2.0"

LINES: dict[str, tuple[list[dict[str, Any]], tuple[str, ...]]] = {
    "yes_no": (
        [{"prompt": "Is the sky blue?", "controller_arg": {"question": "sky"}},
         {"prompt": "Is water dry?"},
         {"prompt": "Sampled?", "temperature": 0.9, "seed": 7}],
        (),
    ),
    "no_lowercase": (
        [{"prompt": "Shout something", "controller_arg": {"max_tokens": 12}},
         {"prompt": "Another one", "controller_arg": '{"max_tokens": 5}'},
         {"prompt": "Sampled", "temperature": 1.0, "seed": 3}],
        ("--max-tokens", "40"),
    ),
    "profile": (
        [{"prompt": "Make up a person."},
         {"prompt": "Another person", "controller_arg": {"max_bio_tokens": 5}}],
        ("--max-tokens", "200"),
    ),
    "rewrite": ([{"prompt": f"Pick a name {i}"} for i in range(6)], ()),
    # fork, storage and line outputs: each branch samples its own answer, and the branch
    # that finds every answer in storage sets the line's "answer" and "votes".
    "vote": (
        [{"prompt": "Vote on a name.", "temperature": 0.9, "seed": 11},
         {"prompt": "Three voters", "temperature": 0.9, "seed": 5,
          "controller_arg": {"branches": 3, "pattern": "[a-c]", "max_tokens": 2}}],
        (),
    ),
    # aici:tools: a call to a real MCP server (a process), one refused, one handled.
    "calculator": (
        [{"prompt": "What is 17 times 23?"},
         {"prompt": "Add", "controller_arg": {"tool": "add", "arguments": {"a": 2, "b": 3}}},
         {"prompt": "Look", "controller_arg": {"tool": "lookup",
                                               "arguments": {"key": "zorblax"}}}],
        ("--mcp", f"calc={command('calc')}", "--allow-tool", "multiply", "--allow-tool",
         "lookup", "--max-tokens", "32"),
    ),
}

SAME_STATS = ("output_tokens", "ff_tokens", "forward_passes", "prompt_tokens")


def comparable(result: dict[str, Any]) -> dict[str, Any]:
    """What a controller decides: everything but timings and its own error wording."""
    return {
        "text": result["text"],
        "finish_reason": result["finish_reason"],
        "outputs": result.get("outputs"),
        "error_type": result.get("error", {}).get("type"),
        **{k: result["stats"][k] for k in SAME_STATS},
    }


def test_the_component_imports_only_the_contract(built_js: dict[str, Path]) -> None:
    wasm_engine = wasmtime.Engine()
    component = wc.Component.from_file(wasm_engine, str(built_js["rewrite"]))
    assert set(component.type.imports(wasm_engine)) == {
        "aici:controller/types@0.2.0",
        "aici:controller/tokenizer@0.2.0",
        "aici:controller/host@0.2.0",
        "aici:storage/storage@0.1.0",
        "aici:tools/tools@0.1.0",
    }  # no WASI: every componentize-js feature is disabled
    exports = component.type.exports(wasm_engine)
    assert set(exports) == {CONTRACT}
    assert {"[constructor]runner", "[method]runner.mid-process"} <= set(
        exports[CONTRACT].ty.exports(wasm_engine)
    )


@pytest.mark.parametrize("name", list(LINES))
def test_each_example_writes_what_its_python_twin_writes(
    tiny_model_dir: Path, built: dict[str, Path], built_js: dict[str, Path], name: str
) -> None:
    lines, extra = LINES[name]
    py_code, py = run_controller(tiny_model_dir, built[name], lines, *extra)
    js_code, js = run_controller(tiny_model_dir, built_js[name], lines, *extra)
    assert js_code == py_code == 0, js
    assert sorted(js) == sorted(py) == list(range(1, len(lines) + 1))
    for i, r in js.items():
        assert comparable(r) == comparable(py[i]), (i, r, py[i])
        assert r.get("logs") == py[i].get("logs")
        assert r["finish_reason"] == "stop" and r["stats"]["guest_ms"] > 0
    if name == "yes_no":
        assert js[1]["logs"] == "question: sky"
        assert all(r["outputs"]["answer"] in ("yes", "no") for r in js.values())
    if name == "no_lowercase":
        assert not any(re.search(r"[a-z]", r["text"]) for r in js.values())
    if name == "rewrite":
        for r in js.values():
            assert r["text"] == f"Name: {r['outputs']['final']}.\n"
    if name == "calculator":
        assert [r["text"] for r in js.values()] == [
            " Answer: 391.0\n", " Answer: unknown (tool_not_allowed)\n", " Answer: 42\n"]
        assert js[1]["outputs"]["tools"] == ["lookup", "multiply"]
    if name == "vote":
        for i, r in js.items():
            assert r["branches"] == len(r["choices"]) == (5, 3)[i - 1]
            assert [comparable(c) for c in r["choices"]] == [
                comparable(c) for c in py[i]["choices"]]
            answers = [c["outputs"]["answer"] for c in r["choices"]]
            assert r["outputs"]["votes"] == {a: answers.count(a) for a in answers}
            assert r["outputs"]["votes"][r["outputs"]["answer"]] == max(
                r["outputs"]["votes"].values())


def test_a_javascript_exception_ends_only_its_line(
    tiny_model_dir: Path, built_js: dict[str, Path]
) -> None:
    code, results = run_controller(tiny_model_dir, built_js["no_lowercase"], [
        {"prompt": "A"},
        {"prompt": "B", "controller_arg": {"max_tokens": 0}},
        {"prompt": "C", "controller_arg": "{not json"},
        {"prompt": "D"},
    ], "--controller-arg", '{"max_tokens": 3}')
    assert code == 1
    assert [results[i]["finish_reason"] for i in (1, 4)] == ["stop", "stop"]
    assert results[1]["stats"]["output_tokens"] <= 3 and results[4]["outputs"]["tokens"] <= 3
    bad = results[2]
    assert bad["finish_reason"] == "error" and bad["error"]["type"] == "controller_error"
    assert bad["error"]["message"].endswith(": Error: max_tokens must be at least 1, got 0")
    assert re.fullmatch(
        r"controller error: Error: max_tokens must be at least 1, got 0 "
        r"\(at no_lowercase\.js:\d+ in start\)",
        bad["logs"],
    ), bad["logs"]
    not_json = results[3]
    assert not_json["error"]["type"] == "controller_error"
    assert re.search(r": SyntaxError: the controller arg is not JSON \(.+\): \"\{not json\"$",
                     not_json["error"]["message"]), not_json["error"]["message"]


@pytest.mark.real_model
def test_a_javascript_controller_on_the_default_model(
    built: dict[str, Path], built_js: dict[str, Path]
) -> None:
    """yes_no.js through `aici-batch run` on the default model (SmolLM2, bf16): the same
    results as yes_no.py."""
    lines = [
        {"messages": [{"role": "user", "content": "Is the sky blue? Answer, then say why."}],
         "controller_arg": {"question": "sky"}},
        {"messages": [{"role": "user", "content": "Is fire cold? Answer, then say why."}]},
    ]
    js_code, js = run_controller(None, built_js["yes_no"], lines)
    py_code, py = run_controller(None, built["yes_no"], lines)
    assert js_code == py_code == 0, js
    for i, r in js.items():
        assert r["finish_reason"] == "stop"
        assert r["outputs"]["answer"] in ("yes", "no")
        assert r["text"].startswith(f" Answer: {r['outputs']['answer']}\nReason: ")
        assert comparable(r) == comparable(py[i])
    assert js[1]["logs"] == "question: sky"
