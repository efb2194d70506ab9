"""vLLM's request extensions in OpenAI batch files (`structured_outputs`, `guided_*`), the
same constraints in aici-batch's own lines (`grammar`, `whitespace_pattern`,
`json_permissive`), how `--format auto` reads a file, and `--exit-zero-on-line-errors`."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner
from paths import DATA

from aici_cli.cli.main import main
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.grammar_check import lark_grammar, whitespace_problem
from aici_cli.core.constraint import Constraint
from aici_cli.formats.detect import detect_format
from aici_cli.formats.jobs import load_schema
from aici_cli.formats.openai_batch import CHAT, COMPLETIONS, line_format, to_line
from aici_cli.models import LoadedModel

OUTPUT_SCHEMA = load_schema("openai-batch-output")
RESULT_SCHEMA = load_schema("result-line")

# Values the tiny random model finishes in a few tokens, so outputs can be checked whole.
SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}},
          "required": ["a", "b"]}
LARK = 'start: "yes" | "no"'
GBNF = 'root ::= "maybe" | "never"'
REGEX = "(yes|no)[0-9]{2}"
CHOICES = ["red", "green"]
MESSAGES = [{"role": "user", "content": "Answer"}]


def request(body: dict[str, Any], url: str = CHAT, custom_id: str = "r1") -> dict[str, Any]:
    prompt = {"messages": MESSAGES} if url == CHAT else {"prompt": "Answer:"}
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "any", **prompt, **body}}


def _write(path: Path, rows: list[Any]) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _run(tiny_model_dir: Path, src: Path, out: Path, *extra: str,
         env: dict[str, str] | None = None) -> tuple[int, list[dict[str, Any]]]:
    args = ["run", str(src), "-o", str(out), "--model", str(tiny_model_dir),
            "--dtype", "float32", "-q", *extra]
    res = CliRunner().invoke(main, args, env=env)
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, [json.loads(x) for x in out.read_text().splitlines()]


def _text(line: dict[str, Any]) -> str:
    choice = line["response"]["body"]["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def _spacing(text: str) -> set[str]:
    """The whitespace characters of a JSON text outside its strings: what a whitespace
    pattern governs."""
    return set(re.findall(r"\s", _JSON_STRING.sub("", text)))


# ------------------------------------------------------------------ mapping

@pytest.mark.parametrize(("body", "fields", "source"), [
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA},
     "body.structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"json_schema": SCHEMA},
     "body.structured_outputs.json"),
    ({"structured_outputs": {"regex": REGEX}}, {"regex": REGEX}, "body.structured_outputs.regex"),
    ({"structured_outputs": {"choice": CHOICES}}, {"choices": CHOICES},
     "body.structured_outputs.choice"),
    ({"structured_outputs": {"grammar": GBNF}}, {"grammar": GBNF},
     "body.structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, {"json_schema": {"type": "object"}},
     "body.structured_outputs.json_object"),
    ({"structured_outputs": {"json_object": False}}, {}, None),
    # Every key of vLLM's StructuredOutputsParams written out, the unset ones as null.
    ({"structured_outputs": {"json": None, "regex": REGEX, "choice": None, "grammar": None,
                             "json_object": None, "whitespace_pattern": None,
                             "structural_tag": None, "disable_fallback": False,
                             "disable_any_whitespace": False,
                             "disable_additional_properties": False}},
     {"regex": REGEX}, "body.structured_outputs.regex"),
    ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}, "body.guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}, "body.guided_json"),
    ({"guided_regex": REGEX}, {"regex": REGEX}, "body.guided_regex"),
    ({"guided_choice": CHOICES}, {"choices": CHOICES}, "body.guided_choice"),
    ({"guided_grammar": LARK}, {"grammar": LARK}, "body.guided_grammar"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[\n]*"},
     {"json_schema": SCHEMA, "whitespace_pattern": "[\n]*"}, "body.guided_json"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}},
     {"json_schema": SCHEMA, "whitespace_pattern": " ?"}, "body.structured_outputs.json"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     {"json_schema": SCHEMA, "whitespace_pattern": ""}, "body.structured_outputs.json"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     {"json_schema": SCHEMA, "json_permissive": False}, "body.structured_outputs.json"),
    # Options that only permit what the outputs satisfy anyway, or pick vLLM's backend.
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False,
                             "disable_additional_properties": False,
                             "disable_fallback": True},
      "guided_decoding_backend": "xgrammar"}, {"json_schema": SCHEMA},
     "body.structured_outputs.json"),
    ({"structured_outputs": {"regex": REGEX, "disable_any_whitespace": True,
                             "disable_additional_properties": True}}, {"regex": REGEX},
     "body.structured_outputs.regex"),
])
def test_structured_output_fields_map_onto_the_line(body: dict[str, Any], fields: dict[str, Any],
                                                    source: str | None) -> None:
    line, req = to_line(request(body))
    assert {k: v for k, v in line.items() if k not in ("id", "messages")} == fields
    constraint = next((k for k in ("json_schema", "regex", "choices", "grammar") if k in line),
                      None)
    assert (dict(req.fields)[constraint] if constraint else None) == source


@pytest.mark.parametrize("pattern", ["", " ", "[ \t\n\r]*", "\\n?", "( |\\n)*", "[ ]{1,}",
                                     "(?:\\x20|\\u000A){0,4}", "\\t{2}"])
def test_whitespace_patterns_that_can_be_honoured(pattern: str) -> None:
    assert whitespace_problem(pattern) is None


@pytest.mark.parametrize(("pattern", "needle"), [
    ("\\s*", "only JSON whitespace"),  # \s takes in non-breaking spaces, which JSON does not
    ("[^x]*", "only JSON whitespace"),
    ("[\t-\r]*", "only JSON whitespace"),  # a range reaches \v and \f
    ("x?", "only JSON whitespace"),
    (" *+", "only JSON whitespace"),  # possessive: Python reads it, llguidance does not
    (" {,3}", "only JSON whitespace"),  # Python reads {,n}, Rust does not
    ("(", "not a valid regular expression"),
])
def test_whitespace_patterns_that_cannot(pattern: str, needle: str) -> None:
    assert needle in (whitespace_problem(pattern) or "")


def test_grammars_are_lark_or_gbnf() -> None:
    assert lark_grammar(LARK) == (LARK, None)
    converted, problem = lark_grammar(GBNF)
    assert problem is None and "start" in converted
    assert "unknown name" in (lark_grammar("start: foo")[1] or "")
    assert "not Lark, and not GBNF" in (lark_grammar('root ::= ( "a"')[1] or "")


# ------------------------------------------------------------------ compiled

def accepts(compiler: GrammarCompiler, lm: LoadedModel, constraint: Constraint,
            text: str) -> bool:
    controller = GrammarController(compiler.compile(constraint), fast_forward=False)
    tokens = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    m = controller.matcher()
    return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()


def test_whitespace_and_undeclared_keys_are_enforced_per_constraint(lm: LoadedModel) -> None:
    strict = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

    def ok(text: str, **options: Any) -> bool:
        return accepts(strict, lm, Constraint("json_schema", schema, **options), text)

    # The compact default, no whitespace at all, and a pattern: each only its own spacing.
    assert ok('{"a": 1, "b": 2}') and not ok('{"a":1,"b":2}')
    assert ok('{"a":1,"b":2}', whitespace="") and not ok('{"a": 1, "b": 2}', whitespace="")
    assert ok('{\n"a":1,\n\n"b":2}', whitespace="[\n]*")
    assert ok('{"a":1,"b":2}', whitespace="[\n]*")
    assert not ok('{"a": 1}', whitespace="[\n]*")
    # Undeclared keys: the run's default (strict here) unless the constraint says.
    assert not ok('{"a": 1, "z": 0}')
    assert ok('{"a": 1, "z": 0}', permissive=True)
    loose = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids),
                            strict_json=False)
    closed = Constraint("json_schema", schema, permissive=False)
    assert accepts(loose, lm, Constraint("json_schema", schema), '{"a": 1, "z": 0}')
    assert not accepts(loose, lm, closed, '{"a": 1, "z": 0}')
    # Distinct options are distinct grammars in the compile cache.
    assert strict.compile(Constraint("json_schema", schema)) is not strict.compile(
        Constraint("json_schema", schema, whitespace=""))


# ------------------------------------------------------------------ vLLM's run-batch inputs

@pytest.mark.heavy
def test_vllm_run_batch_inputs_run_unchanged(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Requests shaped like `vllm run-batch`'s own test inputs: chat with system prompts,
    an unknown model name, a bad URL, a `stream` field, a tool-calling request."""
    src, out = DATA / "vllm_run_batch.jsonl", tmp_path / "out.jsonl"
    code, lines = _run(tiny_model_dir, src, out)
    assert code == 1  # some lines failed: the default exit status says so
    assert len(lines) == len(src.read_text().splitlines())
    for line in lines:
        jsonschema.validate(line, OUTPUT_SCHEMA)
    by_id = {line["custom_id"]: line for line in lines}
    for answered in ("request-1", "request-2", "request-3", "request-6", "request-7"):
        assert by_id[answered]["error"] is None
        assert by_id[answered]["response"]["status_code"] == 200
    # `model` is accepted and ignored: the run's model answers, whatever the request names.
    assert by_id["request-3"]["response"]["body"]["model"] == by_id["request-1"]["response"][
        "body"]["model"]
    assert by_id["request-7"]["response"]["body"]["object"] == "text_completion"
    errors = {cid: by_id[cid]["error"]["message"] for cid in ("request-4", "request-5")}
    assert "url '/bad_url' is not supported" in errors["request-4"]
    assert 'body.stream must be false in a batch, got "True"' in errors["request-5"]
    # `tool_choice: "required"` within 12 tokens (of the tiny model's small vocabulary):
    # the call is forced to start, and cut off it is no call (content holds it as written).
    [choice] = by_id["request-6"]["response"]["body"]["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    content = choice["message"]["content"]
    assert content.startswith("<tool_call>") and (
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "'.startswith(content))
    assert by_id["request-6"]["aici"]["valid"] is False
    assert all(by_id[cid]["response"] is None for cid in errors)

    # As `vllm run-batch` does: errors are in the output file, the exit status is 0.
    code, again = _run(tiny_model_dir, src, out, "--exit-zero-on-line-errors")
    assert code == 0 and len(again) == len(lines)
    assert sorted(x["custom_id"] for x in again if x["error"]) == sorted(errors)


def test_a_request_without_custom_id_is_its_own_error(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    # Its first line lacks custom_id: the file is still read as requests.
    src, out = DATA / "vllm_missing_custom_id.jsonl", tmp_path / "out.jsonl"
    code, lines = _run(tiny_model_dir, src, out)
    assert code == 1 and len(lines) == 2
    for line in lines:
        jsonschema.validate(line, OUTPUT_SCHEMA)
    [bad] = [x for x in lines if x["error"]]
    assert bad["custom_id"] is None and bad["aici"]["index"] == 1
    assert bad["error"]["message"] == ("line 1: custom_id is required (and request field(s) "
                                       "invalid_field are not supported)")
    [good] = [x for x in lines if not x["error"]]
    assert good["custom_id"] == "request-2" and good["response"]["status_code"] == 200


# ------------------------------------------------------------------ every field, both formats

# (custom_id, body fields, what the output must be)
VALID: list[tuple[str, dict[str, Any], str]] = [
    ("so-json", {"structured_outputs": {"json": SCHEMA}}, "json"),
    ("so-json-text", {"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json"),
    ("so-regex", {"structured_outputs": {"regex": REGEX}}, "regex"),
    ("so-choice", {"structured_outputs": {"choice": CHOICES}}, "choice"),
    ("so-lark", {"structured_outputs": {"grammar": LARK}}, "lark"),
    ("so-object", {"structured_outputs": {"json_object": True}}, "object"),
    ("so-compact", {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True,
                                           "disable_additional_properties": True,
                                           "disable_fallback": True}}, "no-whitespace"),
    ("so-ws", {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "[\n]*"}},
     "newlines"),
    ("g-json", {"guided_json": SCHEMA, "guided_decoding_backend": "guidance"}, "json"),
    ("g-regex", {"guided_regex": REGEX}, "regex"),
    ("g-choice", {"guided_choice": CHOICES}, "choice"),
    ("g-gbnf", {"guided_grammar": GBNF}, "gbnf"),
    ("g-ws", {"guided_json": SCHEMA, "guided_whitespace_pattern": "[\n]*"}, "newlines"),
    ("g-ws-none", {"guided_json": SCHEMA, "guided_whitespace_pattern": ""}, "no-whitespace"),
]

# (custom_id, body fields, error code, what the message says)
BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("bad-so-regex", {"structured_outputs": {"regex": "(ab"}}, "invalid_regex",
     "field 'body.structured_outputs.regex' is not a valid regular expression"),
    ("bad-g-regex", {"guided_regex": 7}, "invalid_line", "field 'body.guided_regex' must be "
     "string"),
    ("bad-so-choice", {"structured_outputs": {"choice": [1]}}, "invalid_line",
     "field 'body.structured_outputs.choice[0]' must be string"),
    ("bad-g-choice", {"guided_choice": []}, "invalid_line",
     "field 'body.guided_choice' must not be empty"),
    ("bad-so-json", {"structured_outputs": {"json": 7}}, "invalid_line",
     "field 'body.structured_outputs.json' must be object"),
    ("bad-g-json", {"guided_json": {"type": "nonsense"}}, "invalid_schema",
     "field 'body.guided_json' is not a valid JSON Schema"),
    ("bad-g-json-text", {"guided_json": "{oops"}, "invalid_request",
     "body.guided_json is a string but not JSON text"),
    ("bad-so-grammar", {"structured_outputs": {"grammar": 'root ::= ( "a"'}}, "invalid_grammar",
     "field 'body.structured_outputs.grammar' is not a usable grammar: not Lark, and not GBNF"),
    ("bad-g-grammar", {"guided_grammar": "start: foo"}, "invalid_grammar",
     "field 'body.guided_grammar' is not a usable grammar"),
    ("bad-g-ws", {"guided_json": SCHEMA, "guided_whitespace_pattern": "\\s*"}, "invalid_regex",
     "field 'body.guided_whitespace_pattern' may match only JSON whitespace"),
    ("bad-so-ws", {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "("}},
     "invalid_regex",
     "field 'body.structured_outputs.whitespace_pattern' is not a valid regular expression"),
    ("bad-ws-on-regex", {"guided_regex": REGEX, "guided_whitespace_pattern": " "},
     "invalid_request",
     "body.guided_whitespace_pattern applies to a JSON schema, not to body.guided_regex"),
    ("bad-ws-twice", {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True},
                      "guided_whitespace_pattern": " "}, "invalid_request",
     "body.guided_whitespace_pattern and body.structured_outputs.disable_any_whitespace "
     "both set the whitespace"),
    ("bad-object", {"structured_outputs": {"json_object": "yes"}}, "invalid_request",
     "body.structured_outputs.json_object must be true or false, got string"),
    ("bad-closed", {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": 1}},
     "invalid_request", "body.structured_outputs.disable_additional_properties must be true"),
    ("bad-backend", {"guided_json": SCHEMA, "guided_decoding_backend": 5}, "invalid_request",
     "body.guided_decoding_backend must be a string"),
    ("bad-so", {"structured_outputs": ["json"]}, "invalid_request",
     "body.structured_outputs must be an object, got array"),
    ("bad-so-key", {"structured_outputs": {"structural_tag": "{}"}}, "invalid_request",
     "unsupported body.structured_outputs field(s): structural_tag"),
    ("two-guided", {"guided_json": SCHEMA, "structured_outputs": {"regex": REGEX}},
     "invalid_request",
     "a request takes one constraint, got body.guided_json and body.structured_outputs.regex"),
    ("two-formats", {"response_format": {"type": "json_object"}, "guided_choice": CHOICES},
     "invalid_request",
     "a request takes one constraint, got body.response_format and body.guided_choice"),
]


def check_output(text: str, finished: bool, kind: str) -> None:
    """`text` obeys the constraint `kind` (a cut-off output: as far as it goes)."""
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind in ("lark", "gbnf"):
        assert text in (["yes", "no"] if kind == "lark" else ["maybe", "never"])
    elif kind == "object":
        assert text.startswith("{")
        if finished:
            assert isinstance(json.loads(text), dict)
    else:
        wanted = {"json": {" "}, "no-whitespace": set(), "newlines": {"\n"}}[kind]
        assert _spacing(text) <= wanted, text
        if finished:
            jsonschema.validate(json.loads(text), SCHEMA)
            if kind == "json":
                assert ", " in text and ": " in text  # the compact default's separators


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
def test_every_field_through_run(tiny_model_dir: Path, tmp_path: Path, url: str) -> None:
    rows = [request({"max_tokens": 40, **body}, url, cid) for cid, body, _ in VALID]
    rows += [request(body, url, cid) for cid, body, _, _ in BAD]
    src, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    _write(src, rows)
    code, lines = _run(tiny_model_dir, src, out)
    assert code == 1 and len(lines) == len(rows)
    by_id = {line["custom_id"]: line for line in lines}
    for line in lines:
        jsonschema.validate(line, OUTPUT_SCHEMA)
    for cid, _, kind in VALID:
        line = by_id[cid]
        assert line["error"] is None, line["error"]
        body = line["response"]["body"]
        assert body["object"] == ("chat.completion" if url == CHAT else "text_completion")
        check_output(_text(line), body["choices"][0]["finish_reason"] == "stop", kind)
    for cid, _, code_, needle in BAD:
        error = by_id[cid]["error"]
        assert (error["code"], by_id[cid]["response"]) == (code_, None), error
        assert needle in error["message"], error["message"]


OWN_VALID: list[tuple[str, dict[str, Any], str]] = [
    ("lark", {"grammar": LARK}, "lark"),
    ("gbnf", {"grammar": GBNF}, "gbnf"),
    ("ws", {"json_schema": SCHEMA, "whitespace_pattern": "[\n]*"}, "newlines"),
    ("ws-none", {"json_schema": SCHEMA, "whitespace_pattern": "", "json_permissive": False},
     "no-whitespace"),
    ("permissive", {"json_schema": SCHEMA, "json_permissive": True}, "json"),
]

OWN_BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("bad-grammar", {"grammar": "start: foo"}, "invalid_grammar",
     "field 'grammar' is not a usable grammar: at 1(8): unknown name"),
    ("empty-grammar", {"grammar": ""}, "invalid_line", "field 'grammar' must not be empty"),
    ("two", {"grammar": LARK, "choices": CHOICES}, "invalid_line",
     "at most one of 'json_schema', 'regex', 'choices' or 'grammar' may be given, got "
     "'choices' and 'grammar'"),
    ("bad-ws", {"json_schema": SCHEMA, "whitespace_pattern": "\\s*"}, "invalid_regex",
     "field 'whitespace_pattern' may match only JSON whitespace"),
    ("ws-type", {"json_schema": SCHEMA, "whitespace_pattern": 1}, "invalid_line",
     "field 'whitespace_pattern' must be string"),
    ("ws-on-regex", {"regex": REGEX, "whitespace_pattern": " "}, "invalid_line",
     "field 'whitespace_pattern' applies to a JSON schema ('json_schema' or --json-schema), "
     "not to 'regex'"),
    ("permissive-alone", {"json_permissive": True}, "invalid_line",
     "field 'json_permissive' applies to a JSON schema ('json_schema' or --json-schema), "
     "none is given"),
    ("permissive-type", {"json_schema": SCHEMA, "json_permissive": "yes"}, "invalid_line",
     "field 'json_permissive' must be boolean"),
]


def test_own_format_fields_through_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [{"id": i, "prompt": "Answer:", "max_tokens": 40, **f} for i, f, _ in OWN_VALID]
    rows += [{"id": i, "prompt": "Answer:", **f} for i, f, _, _ in OWN_BAD]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, rows)
    # The flag can come from the environment too, like every option.
    code, lines = _run(tiny_model_dir, src, out,
                       env={"AICI_BATCH_EXIT_ZERO_ON_LINE_ERRORS": "1"})
    assert code == 0 and len(lines) == len(rows)
    by_id = {line["id"]: line for line in lines}
    for line in lines:
        jsonschema.validate(line, RESULT_SCHEMA)
    for id_, _, kind in OWN_VALID:
        line = by_id[id_]
        assert line["finish_reason"] != "error", line
        check_output(line["text"], line["finish_reason"] == "stop", kind)
    for id_, _, type_, needle in OWN_BAD:
        error = by_id[id_]["error"]
        assert error["type"] == type_ and needle in error["message"], error


# ------------------------------------------------------------------ --format auto

def test_auto_format_is_decided_by_the_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows: list[Any] = [
        "{not json",  # decides nothing: an error line in the format decided later
        {},  # neither shape
        request({"max_tokens": 3}, custom_id="first"),  # decides: OpenAI requests
        {"id": "own", "prompt": "hi"},
        "",
        {"method": "POST", "url": CHAT, "body": {"messages": MESSAGES}},
    ]
    src, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    _write(src, rows)
    code, lines = _run(tiny_model_dir, src, out)
    assert code == 1 and len(lines) == 5
    for line in lines:
        jsonschema.validate(line, OUTPUT_SCHEMA)
    by_index = {line["aici"]["index"]: line for line in lines}
    assert by_index[1]["error"]["code"] == "invalid_json"
    assert "custom_id is required" in by_index[2]["error"]["message"]
    assert by_index[3]["custom_id"] == "first" and by_index[3]["error"] is None
    assert by_index[4]["error"] == {
        "code": "format_mismatch",
        "message": "line 4: a line of aici-batch's own format (it has 'id', 'prompt') in a "
                   "file read as OpenAI batch requests (--format auto, decided by line 3)"}
    assert by_index[6]["error"]["message"] == "line 6: custom_id is required"

    # Own lines first: a request further down is that line's error, in the own format.
    _write(src, [{"id": "own", "prompt": "hi", "max_tokens": 3},
                 request({"max_tokens": 3}, custom_id="late")])
    code, lines = _run(tiny_model_dir, src, out)
    assert code == 1
    for line in lines:
        jsonschema.validate(line, RESULT_SCHEMA)
    by_id = {line["id"]: line for line in lines}
    assert by_id["own"]["finish_reason"] != "error"
    assert by_id["late"]["error"] == {
        "type": "format_mismatch",
        "message": "line 2: an OpenAI batch request (it has 'custom_id', 'method', 'url', "
                   "'body') in a file read in aici-batch's own format (--format auto, decided "
                   "by line 1)"}

    # A format given on the command line is named as the reason.
    _write(src, [request({"max_tokens": 3}), {"prompt": "hi"}])
    code, lines = _run(tiny_model_dir, src, out, "--format", "openai")
    [bad] = [x for x in lines if x["error"]]
    assert bad["error"]["message"].endswith("read as OpenAI batch requests (--format openai)")


def test_detection_reads_no_further_than_the_deciding_line() -> None:
    lines = [b"\n", b"{oops\n", b'{"x": 1}\n', b'{"custom_id": "a"}\n', b'{"prompt": "p"}\n']
    source = iter(lines)
    peeked, fmt, why = detect_format(source, "auto")  # type: ignore[arg-type]
    assert (fmt, why) == ("openai", "--format auto, decided by line 4")
    assert peeked == lines[:4] and list(source) == lines[4:]  # the rest is still unread
    bom = io.BytesIO(b'\xef\xbb\xbf{"custom_id": "a"}\n')  # as editors on Windows write
    assert detect_format(bom, "auto")[1] == "openai"
    assert detect_format(io.BytesIO(b"{}\n[]\n"), "auto")[1:] == (
        "aici", "--format auto: no line in the first 2 decided")
    assert detect_format(io.BytesIO(b"{}\n"), "openai") == ([], "openai", "--format openai")
    assert line_format({"body": {}}) == "openai" and line_format({"n": 2}) == "aici"
    assert line_format({"x": 1}) is None and line_format([1]) is None
