"""Tool calling by constraint: `tools`, `tool_choice` and `parallel_tool_calls` in both
formats, the grammar that enforces calls, how tools reach the model (a template's own
`tools`, or a system message), and `tool_calls` in results."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from click.testing import CliRunner
from paths import DATA
from tiny_model import CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, build_tiny_model

from aici_cli.cli.main import main
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.tool_calls import (
    CLOSE,
    OPEN,
    SEPARATOR,
    ToolCall,
    call_text,
    calls_text,
    complete_calls,
    parse_calls,
)
from aici_cli.core.constraint import Constraint
from aici_cli.formats.jobs import load_schema
from aici_cli.formats.jobs.tools import tool_constraint
from aici_cli.formats.openai_batch import CHAT, COMPLETIONS
from aici_cli.models import LoadedModel, load_model, render_prompt
from aici_cli.models.tokenizer.tool_prompt import template_takes_tools

OUTPUT_SCHEMA = load_schema("openai-batch-output")
RESULT_SCHEMA = load_schema("result-line")

# Arguments the tiny random model finishes in a few tokens (enums, booleans), so that calls
# end on their own and can be checked whole.
WEATHER = {"type": "object",
           "properties": {"unit": {"enum": ["c", "f"]}, "now": {"type": "boolean"}},
           "required": ["unit", "now"]}
REFS = {"$defs": {"flag": {"type": "boolean"}}, "type": "object",
        "properties": {"on": {"$ref": "#/$defs/flag"}}, "required": ["on"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "switch", "parameters": REFS, "strict": True}},
    {"type": "function", "function": {"name": "ping", "description": None}},  # no arguments
]
PARAMETERS = {"get_weather": WEATHER, "switch": REFS, "ping": {"type": "object", "properties": {}}}
MESSAGES = [{"role": "user", "content": "Weather?"}]
# A conversation that already called a tool and got its result.
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"unit": "c", "now": true}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
NAMED = {"type": "function", "function": {"name": "switch"}}
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def _write(path: Path, rows: list[Any]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(model: Path, src: Path, out: Path, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    args = ["run", str(src), "-o", str(out), "--model", str(model), "--dtype", "float32",
            "-q", *extra]
    res = CliRunner().invoke(main, args)
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, [json.loads(x) for x in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that reads `tools`."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tools"), TOOLS_CHAT_TEMPLATE)


# ------------------------------------------------------------------ the text form

def test_calls_are_read_back_exactly_as_the_grammar_writes_them() -> None:
    one = call_text("get_weather", '{"unit": "c", "now": true}')
    assert one == ('<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", '
                   '"now": true}}\n</tool_call>')
    calls = [ToolCall("get_weather", '{"unit": "f", "now": false}'), ToolCall("ping", "{}"),
             ToolCall('say "hi"', '{"a": "}\\n</tool_call>"}')]
    assert parse_calls(calls_text(calls)) == calls
    # Text, a call cut off anywhere, or anything after the last call: not calls.
    text = calls_text(calls)
    ends = {len(calls_text(calls[:k])): calls[:k] for k in range(1, len(calls) + 1)}
    for end in range(len(text)):
        assert parse_calls(text[:end]) == ends.get(end), text[:end]
    assert parse_calls("Sunny, 20 degrees.") is None
    assert parse_calls(text + "\n") is None and parse_calls(text + " ") is None


# ------------------------------------------------------------------ the grammar

def _constraint(**fields: Any) -> Constraint:
    constraint = tool_constraint({"messages": MESSAGES, "tools": TOOLS, **fields}, 100)
    assert isinstance(constraint, Constraint)
    return constraint


def _accepts(compiler: GrammarCompiler, lm: LoadedModel, constraint: Constraint,
             text: str) -> bool:
    m = GrammarController(compiler.compile(constraint), fast_forward=False).matcher()
    tokens = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()


def test_the_grammar_allows_exactly_the_calls_the_choice_permits(lm: LoadedModel) -> None:
    compiler = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))
    weather = call_text("get_weather", '{"unit": "c", "now": true}')
    switch = call_text("switch", '{"on": false}')  # its $ref resolves in its own parameters
    ping = call_text("ping", "{}")
    two = weather + "\n" + ping
    bad = [
        call_text("get_weather", '{"unit": "k", "now": true}'),  # not in the enum
        call_text("get_weather", '{"unit": "c"}'),  # a required key missing
        call_text("get_weather", '{"unit": "c", "now": true, "x": 1}'),  # undeclared key
        call_text("get_weather", '{"unit":"c","now":true}'),  # not the compact separators
        call_text("nope", "{}"),  # not a tool
        call_text("ping", '{"a": 1}'),
        '<tool_call>\n{"name": "ping"}\n</tool_call>',
        weather + "\n",
    ]
    cases: list[tuple[dict[str, Any], list[str], list[str]]] = [
        ({"tool_choice": "required"}, [weather, switch, ping, two], ["", "Sunny.", *bad]),
        ({"tool_choice": "required", "parallel_tool_calls": False}, [weather, ping], [two]),
        ({"tool_choice": NAMED}, [switch, switch + "\n" + switch], [weather, "", "Sunny."]),
        ({"tool_choice": NAMED, "parallel_tool_calls": False}, [switch],
         [switch + "\n" + switch]),
        # auto (the default with tools): text that never holds the opening tag, or calls.
        ({}, ["", "Sunny.", "a <b>c</b> <tool_call", weather, two],
         ["<tool_call>", "Sunny <tool_call> oh", *bad]),
        ({"tool_choice": "auto", "parallel_tool_calls": False}, ["Sunny.", weather], [two]),
    ]
    for fields, allowed, refused in cases:
        constraint = _constraint(**fields)
        for text in allowed:
            assert _accepts(compiler, lm, constraint, text), (fields, text)
        for text in refused:
            assert not _accepts(compiler, lm, constraint, text), (fields, text)


def test_names_and_keys_are_fast_forwarded(lm: LoadedModel) -> None:
    compiler = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))
    named = GrammarController(compiler.compile(_constraint(tool_choice=NAMED)))
    first = named.start([])
    # (The space after the colon may come with the value's token.)
    assert lm.tokenizer.decode(list(first.ff_tokens)).startswith(
        '<tool_call>\n{"name": "switch", "arguments": {"on":')
    required = GrammarController(compiler.compile(_constraint(tool_choice="required")))
    assert lm.tokenizer.decode(list(required.start([]).ff_tokens)) == (
        '<tool_call>\n{"name": "')
    auto = GrammarController(compiler.compile(_constraint()))
    assert auto.start([]).ff_tokens == ()  # text may answer: nothing is forced


def test_tags_that_are_tokens_of_their_own_are_taken_as_those_tokens(
        tiny_model_dir: Path) -> None:
    """A vocabulary whose `<tool_call>` and `</tool_call>` are added tokens, as Qwen 2.5's
    are (not flagged special in its tokenizer.json, special to llguidance all the same):
    the model writes a tag with its one token, which the grammar takes; as text the tag
    refused it, and every line calling a tool failed with a grammar error."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens([OPEN, CLOSE], special_tokens=False)
    open_id, close_id = tokenizer.convert_tokens_to_ids([OPEN, CLOSE])
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    assert compiler.special_tags == {OPEN: open_id, CLOSE: close_id}

    def accepts(constraint: Constraint, text: str) -> bool:
        m = GrammarController(compiler.compile(constraint), fast_forward=False).matcher()
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()

    weather = call_text("get_weather", '{"unit": "c", "now": true}')
    two = weather + SEPARATOR + call_text("ping", "{}")
    assert tokenizer(weather, add_special_tokens=False)["input_ids"][0] == open_id
    for fields in ({"tool_choice": "required"}, {}):
        assert accepts(_constraint(**fields), weather) and accepts(_constraint(**fields), two)
        assert not accepts(_constraint(**fields), call_text("get_weather", '{"unit": "k"}'))
    assert accepts(_constraint(), "Sunny.")  # auto: text, which cannot hold the tag
    assert not accepts(_constraint(), "Sunny " + OPEN)
    # A named call is forced from its first token, the tag's, to its arguments; it reads
    # back from its text.
    named = GrammarController(compiler.compile(_constraint(tool_choice=NAMED)))
    forced = list(named.start([]).ff_tokens)
    assert forced[0] == open_id
    text = tokenizer.decode(forced)
    assert text.startswith(OPEN + '\n{"name": "switch", "arguments": {"on":')
    whole = call_text("switch", '{"on": true}')
    assert whole.startswith(text) and accepts(_constraint(tool_choice=NAMED), whole)
    assert parse_calls(whole) == [ToolCall("switch", '{"on": true}')]


def test_choices_that_call_nothing_make_no_constraint() -> None:
    assert tool_constraint({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"},
                           100) is None
    assert tool_constraint({"messages": MESSAGES}, 100) is None
    for choice in ("auto", "required"):  # vLLM: "required" over no tools is "none"
        assert tool_constraint({"messages": MESSAGES, "tools": [], "tool_choice": choice},
                               100) is None
    spec = _constraint(tool_choice=NAMED).value
    assert spec == {"tools": [{"name": "switch", "parameters": REFS}], "text": False,
                    "parallel": True}
    assert _constraint().value["text"] is True
    assert _constraint(tool_choice="required").value["tools"][2] == {
        "name": "ping", "parameters": {"type": "object", "properties": {}}}


# ------------------------------------------------------------------ how tools reach the model

def test_a_template_that_reads_tools_gets_them(tools_model_dir: Path) -> None:
    tok = load_model(str(tools_model_dir), device="cpu", dtype="float32").tokenizer
    assert template_takes_tools(TOOLS_CHAT_TEMPLATE) and not template_takes_tools(CHAT_TEMPLATE)
    prompt = render_prompt(tok, HISTORY, TOOLS)
    shown = [json.loads(line) for line in prompt.split("<tools>\n")[1].split("</tools>")[0]
             .splitlines()]
    # The template's own rendering, of the tools as given less their null keys.
    assert shown[0] == TOOLS[0] and shown[2] == {"type": "function",
                                                 "function": {"name": "ping"}}
    # The past call reaches the template with its arguments as an object.
    assert ('<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", '
            '"now": true}}\n</tool_call></s>\n<|tool|>\nsunny</s>\n<|assistant|>\n') in prompt
    assert "You may call" not in prompt  # no system-message rendering on top


def test_a_template_without_tools_gets_them_in_a_system_message(lm: LoadedModel) -> None:
    prompt = render_prompt(lm.tokenizer, HISTORY, TOOLS)
    tools_json = "\n".join(json.dumps(t) for t in [TOOLS[0], TOOLS[1], {
        "type": "function", "function": {"name": "ping"}}])
    assert prompt == (
        "<s><|system|>\nBe brief.\n\n"
        "You may call one or more functions to answer. The functions are given as JSON "
        f"within <tools></tools>:\n<tools>\n{tools_json}\n</tools>\n"
        "To call a function, answer with a JSON object of its name and arguments within "
        "<tool_call></tool_call> tags, one object per call:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call></s>\n'
        "<|user|>\nWeather?</s>\n"
        '<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", '
        '"now": true}}\n</tool_call></s>\n'
        "<|user|>\n<tool_response>\nsunny\n</tool_response></s>\n<|assistant|>\n")
    # Without a system message of its own the tools get one; consecutive results share
    # one user turn; lines without tools render as before.
    two = [*HISTORY[1:], {"role": "tool", "tool_call_id": "call_2", "content": "warm"}]
    prompt = render_prompt(lm.tokenizer, two, TOOLS)
    assert prompt.startswith("<s><|system|>\nYou may call one or more functions")
    assert "<|user|>\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n" \
           "</tool_response></s>" in prompt
    assert render_prompt(lm.tokenizer, MESSAGES) == "<s><|user|>\nWeather?</s>\n<|assistant|>\n"


# ------------------------------------------------------------------ through `aici-batch run`

# (id, line fields besides messages, what the output must be)
VALID: list[tuple[str, dict[str, Any], str]] = [
    ("required", {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
     "one call"),
    ("named", {"tools": TOOLS, "tool_choice": NAMED}, "switch"),
    ("parallel", {"tools": TOOLS, "tool_choice": "required", "n": 3, "temperature": 1.0,
                  "seed": 5}, "calls"),
    ("auto", {"tools": TOOLS, "n": 3, "temperature": 1.0}, "text or calls"),
    ("none", {"tools": TOOLS, "tool_choice": "none"}, "text"),
    ("empty", {"tools": [], "tool_choice": "required"}, "text"),
    ("history", {"messages": HISTORY, "tools": TOOLS, "tool_choice": "required",
                 "parallel_tool_calls": False}, "one call"),
    ("history-no-tools", {"messages": HISTORY}, "text"),
]


def _own(fields: dict[str, Any]) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 60, **fields}


def _request(cid: str, fields: dict[str, Any], url: str = CHAT) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": "any", **_own(fields)}}


def check_calls(samples: list[tuple[str, str, list[dict[str, Any]] | None]], kind: str) -> None:
    """Each sample's (finish reason, text, tool calls) obeys the tool choice `kind`; every
    call names a tool and its arguments validate against that tool's parameters."""
    for finish, text, calls in samples:
        if kind == "text" or (kind == "text or calls" and calls is None):
            assert calls is None and "<tool_call>" not in text and finish in ("stop", "length")
            continue
        if finish == "length" and calls is None:  # cut off inside a call
            assert kind in ("calls", "text or calls") and text.startswith("<tool_call>")
            continue
        # "length": the limit fell right after a call, where another could have begun.
        assert finish in ("tool_calls", "length") and calls, (finish, text)
        for call in calls:
            assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])
        names = [c["function"]["name"] for c in calls]
        if kind == "one call":
            assert len(calls) == 1
        if kind == "switch":
            assert set(names) == {"switch"}


def _samples(line: dict[str, Any]) -> list[tuple[str, str, list[dict[str, Any]] | None]]:
    if "response" in line:  # the OpenAI format
        return [(c["finish_reason"], c["message"]["content"] or "", c["message"].get(
            "tool_calls")) for c in line["response"]["body"]["choices"]]
    return [(s["finish_reason"], s["text"], s.get("tool_calls"))
            for s in line.get("choices", [line])]


@pytest.mark.heavy
@pytest.mark.parametrize("template", ["tools", "plain"])
def test_tool_choices_through_run_in_both_formats(tiny_model_dir: Path, tools_model_dir: Path,
                                                  tmp_path: Path, template: str) -> None:
    model = tools_model_dir if template == "tools" else tiny_model_dir
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # The OpenAI format.
    _write(src, [_request(cid, fields) for cid, fields, _ in VALID])
    code, lines = _run(model, src, out)
    assert code == 0 and len(lines) == len(VALID)
    by_id = {line["custom_id"]: line for line in lines}
    for line in lines:
        jsonschema.validate(line, OUTPUT_SCHEMA)
    for cid, _, kind in VALID:
        line = by_id[cid]
        assert line["error"] is None, line["error"]
        check_calls(_samples(line), kind)
        for choice in line["response"]["body"]["choices"]:
            if "tool_calls" in choice["message"]:
                assert choice["message"]["content"] is None
    assert by_id["required"]["aici"]["valid"] is True
    assert by_id["required"]["aici"]["stats"]["ff_tokens"] > 0
    # aici-batch's own format: the same calls, with the same ids (derived from the line).
    _write(src, [{"id": cid, **_own(fields)} for cid, fields, _ in VALID])
    code, own = _run(model, src, out)
    assert code == 0 and len(own) == len(VALID)
    for line in own:
        jsonschema.validate(line, RESULT_SCHEMA)
        check_calls(_samples(line), dict((c, k) for c, _, k in VALID)[line["id"]])
        openai = by_id[line["id"]]["response"]["body"]["choices"][0]
        assert line.get("tool_calls") == openai["message"].get("tool_calls")
        if "tool_calls" in line:  # the text is the calls as written
            assert parse_calls(line["text"]) == [
                ToolCall(c["function"]["name"], c["function"]["arguments"])
                for c in line["tool_calls"]]
            assert line["valid"] is True


@pytest.mark.heavy
def test_calls_finished_early_by_the_loop_guard(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's run-batch tool-calling request: a free-text argument the tiny greedy model
    repeats until its limit; `--loop-guard` closes it into a valid call."""
    src, out = DATA / "vllm_tool_calling.jsonl", tmp_path / "out.jsonl"
    [request] = [json.loads(x) for x in src.read_text().splitlines()]
    schema = request["body"]["tools"][0]["function"]["parameters"]
    code, [line] = _run(tiny_model_dir, src, out, "--max-tokens", "200", "--no-loop-guard",
                        "--no-close-at-limit")
    assert code == 0 and line["error"] is None
    [choice] = line["response"]["body"]["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    code, [line] = _run(tiny_model_dir, src, out)  # the guard is on by default
    jsonschema.validate(line, OUTPUT_SCHEMA)
    [choice] = line["response"]["body"]["choices"]
    assert choice["finish_reason"] == "tool_calls" and line["aici"]["stats"]["closed_early"]
    assert line["aici"]["stats"]["close_reason"] == "loop"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_current_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


# (id, line fields, error type, what the message says, with line field names)
BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("tools-type", {"tools": {}}, "invalid_line", "field 'tools' must be array, got {}"),
    ("tool-type", {"tools": [{"type": "fn", "function": {"name": "a"}}]}, "invalid_line",
     "field 'tools[0].type' must be \"function\", got \"fn\""),
    ("tool-name", {"tools": [{"type": "function", "function": {}}]}, "invalid_line",
     "field 'tools[0].function' is missing required field 'name'"),
    ("tool-key", {"tools": [{"type": "function", "function": {"name": "a", "args": {}}}]},
     "invalid_line", "unknown field 'args' in 'tools[0].function'"),
    ("params-type", {"tools": [{"type": "function", "function": {"name": "a",
                                                                 "parameters": 3}}]},
     "invalid_line", "field 'tools[0].function.parameters' must be object or null, got 3"),
    ("params-schema", {"tools": [{"type": "function", "function": {
        "name": "a", "parameters": {"type": "nonsense"}}}]}, "invalid_schema",
     "field 'tools[0].function.parameters' is not a valid JSON Schema"),
    ("params-ref", {"tools": [{"type": "function", "function": {
        "name": "a", "parameters": {"$ref": "#/$defs/x"}}}]}, "invalid_schema",
     "field 'tools[0].function.parameters' is not a valid JSON Schema: $ref '#/$defs/x'"),
    ("twice", {"tools": [TOOLS[2], TOOLS[0], TOOLS[2]]}, "invalid_line",
     "field 'tools[2].function.name' repeats \"ping\", the name of tools[0]"),
    ("choice-value", {"tools": TOOLS, "tool_choice": "sometimes"}, "invalid_line",
     "field 'tool_choice' must be one of \"none\", \"auto\", \"required\", got \"sometimes\""),
    ("choice-type", {"tools": TOOLS, "tool_choice": 3}, "invalid_line",
     "field 'tool_choice' must be string or object, got 3"),
    ("choice-shape", {"tools": TOOLS, "tool_choice": {"type": "function"}}, "invalid_line",
     "field 'tool_choice' is missing required field 'function'"),
    ("choice-unknown", {"tools": TOOLS, "tool_choice": {"type": "function",
                                                       "function": {"name": "nope"}}},
     "invalid_line",
     "field 'tool_choice.function.name' names \"nope\", which is not one of 'tools'"),
    ("choice-alone", {"tool_choice": "required"}, "invalid_line",
     "field 'tool_choice' needs 'tools'"),
    ("parallel-type", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "invalid_line",
     "field 'parallel_tool_calls' must be boolean, got \"yes\""),
    ("two-constraints", {"tools": TOOLS, "tool_choice": "required",
                         "json_schema": {"type": "object"}}, "invalid_line",
     "field 'tools' with 'tool_choice' \"required\" constrains the output to tool calls, "
     "which cannot be combined with 'json_schema'"),
    ("content-null", {"messages": [{"role": "user", "content": None}], "tools": TOOLS},
     "invalid_line", "field 'messages[0].content' must be string, got null"),
    ("calls-on-user", {"messages": [{"role": "user", "content": "x", "tool_calls": HISTORY[2][
        "tool_calls"]}]}, "invalid_line",
     "field 'messages[0].tool_calls' belongs to an assistant message, not to a \"user\" one"),
    ("call-arguments", {"messages": [{"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "a", "arguments": "[1]"}}]}]},
     "invalid_line",
     "field 'messages[0].tool_calls[0].function.arguments' must be the JSON text of an object"),
    ("call-shape", {"messages": [{"role": "assistant", "tool_calls": [{
        "type": "function", "function": {"name": "a", "arguments": "{}"}}]}]},
     "invalid_line", "field 'messages[0].tool_calls[0]' is missing required field 'id'"),
]

# Only in aici-batch's own format (a request has no such fields).
OWN_BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("on-prompt", {"messages": None, "prompt": "Weather?", "tools": TOOLS}, "invalid_line",
     "field 'tools' needs 'messages': tools are shown to the model through the chat "
     "template"),
    ("permissive", {"tools": TOOLS, "json_permissive": True}, "invalid_line",
     "field 'json_permissive' applies to a JSON schema ('json_schema' or --json-schema), not "
     "to 'tools'"),
]


def _request_names(message: str) -> str:
    """A line field named in a message as the request field it comes from."""
    return re.sub(r"'(tools|tool_choice|parallel_tool_calls|messages|json_schema)\b",
                  lambda m: "'body." + (m.group(1) if m.group(1) != "json_schema" else
                                         "response_format.json_schema.schema"), message)


def test_bad_tool_fields_are_their_own_lines_errors(tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": cid, **{k: v for k, v in _own(f).items() if v is not None}}
            for cid, f, _, _ in BAD + OWN_BAD]
    rows.append({"id": "fine", **_own({"tools": TOOLS, "tool_choice": NAMED,
                                        "max_tokens": 30})})
    _write(src, rows)
    code, lines = _run(tiny_model_dir, src, out)
    assert code == 1 and len(lines) == len(rows)
    by_id = {line["id"]: line for line in lines}
    for line in lines:
        jsonschema.validate(line, RESULT_SCHEMA)
    assert by_id["fine"]["finish_reason"] in ("tool_calls", "length")
    for cid, _, type_, needle in BAD + OWN_BAD:
        error = by_id[cid]["error"]
        assert error["type"] == type_ and needle in error["message"], (cid, error)

    # The same requests in the OpenAI format: the messages name the request's fields.
    requests = []
    for cid, fields, _, _ in BAD:
        body = dict(fields)
        if "json_schema" in body:  # the request's spelling of a schema constraint
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"schema": body.pop("json_schema")}}
        requests.append(_request(cid, body))
    requests.append({"custom_id": "completions", "method": "POST", "url": COMPLETIONS,
                     "body": {"model": "any", "prompt": "Weather?", "tools": TOOLS}})
    _write(src, requests)
    code, lines = _run(tiny_model_dir, src, out)
    assert code == 1 and len(lines) == len(requests)
    by_id = {line["custom_id"]: line for line in lines}
    for line in lines:
        jsonschema.validate(line, OUTPUT_SCHEMA)
        assert line["response"] is None
    for cid, _, type_, needle in BAD:
        error = by_id[cid]["error"]
        assert error["code"] == type_ and _request_names(needle) in error["message"], (
            cid, error)
    assert "body.tools belongs to /v1/chat/completions, not to /v1/completions" in by_id[
        "completions"]["error"]["message"]


@pytest.mark.real_model
def test_default_model_calls_a_required_tool(tmp_path: Path) -> None:
    """vLLM's run-batch tool-calling request on the default model (whose template has no
    tools: they reach it in a system message): a call whose arguments validate."""
    src, out = DATA / "vllm_tool_calling.jsonl", tmp_path / "out.jsonl"
    [request] = [json.loads(x) for x in src.read_text().splitlines()]
    schema = request["body"]["tools"][0]["function"]["parameters"]
    res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    [line] = [json.loads(x) for x in out.read_text().splitlines()]
    jsonschema.validate(line, OUTPUT_SCHEMA)
    [choice] = line["response"]["body"]["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert line["aici"]["valid"] is True
    for call in choice["message"]["tool_calls"]:
        assert call["function"]["name"] == "get_current_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_a_call_cut_off_keeps_the_whole_calls_before_it() -> None:
    calls = [ToolCall("get_weather", '{"unit": "f"}'), ToolCall("ping", "{}"),
             ToolCall("get_weather", '{"unit": "c", "now": true}')]
    text = calls_text(calls)
    for end in range(len(text) + 1):
        whole = [k for k in range(len(calls) + 1) if len(calls_text(calls[:k])) <= end]
        got, rest = complete_calls(text[:end])
        assert got == calls[: whole[-1]], text[:end]
        assert rest == (len(calls_text(got)) if got else 0)


def test_a_line_cut_inside_a_call_reports_the_whole_calls(lm: LoadedModel) -> None:
    """max_tokens cut the output inside its third call (closing off): the result keeps the
    two whole calls as `tool_calls`, names the dropped one, and stays `length`."""
    from aici_cli.core.job import Job
    from aici_cli.engine import Generation
    from aici_cli.engine.result_line import finished_text, generation_result

    compiler = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))
    whole = [ToolCall("get_weather", '{"unit": "c", "now": true}'),
             ToolCall("switch", '{"on": false}')]
    cut = calls_text(whole) + SEPARATOR + call_text("get_weather", '{"unit": "f"}')[:40]
    constraint = _constraint(tool_choice="required")
    controller = GrammarController(compiler.compile(constraint))
    fields = controller.report(cut)
    assert fields["calls"] == whole and fields["dropped_call"].startswith("<tool_call>")
    job = Job(index=1, id="t", prompt="", messages=MESSAGES, max_tokens=80, constraint=constraint)
    gen = Generation(job, [], controller, torch.Generator(), started=0.0)
    gen.output = lm.tokenizer(cut, add_special_tokens=False)["input_ids"]
    gen.finish_with("length")
    text = finished_text(gen, lm.tokenizer)
    result = generation_result(gen, text, controller.report(text), controller.stats(), 0.0)
    assert result["finish_reason"] == "length"
    assert [c["function"]["arguments"] for c in result["tool_calls"]] == [
        c.arguments for c in whole]
    jsonschema.validate(result, RESULT_SCHEMA)
