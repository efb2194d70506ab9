"""Run options and input shapes as newcomers write them: `--choices` with spaces or as a
JSON array, `--grammar FILE`, INPUT left out with a pipe, integer ids, a JSON schema in
OpenAI's envelope (or one that constrains nothing), OpenAI requests as the SDK writes them."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from paths import ROOT

from aici_cli.cli.main import main
from aici_cli.cli.option_values import choices_option
from aici_cli.control.schema_envelope import inert_problem, unwrap
from aici_cli.core.errors import UsageError


def jsonl(rows: list[Any]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def invoke(args: list[str], stdin: str | None = None) -> Result:
    return CliRunner().invoke(main, args, input=stdin)


def aici_batch() -> list[str]:
    exe = Path(sys.executable).with_name("aici-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "aici_cli"]


def results(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize(("text", "choices"), [
    ("positive, negative", ["positive", "negative"]),
    (" yes ,no,, maybe ", ["yes", "no", "maybe"]),
    ('["yes, sir", " no"]', ["yes, sir", " no"]),
])
def test_choices_are_trimmed_or_taken_from_a_json_array(text: str, choices: list[str]) -> None:
    assert choices_option(text) == choices


@pytest.mark.parametrize(("text", "message"), [
    ("yes,no,yes", "--choices gives 'yes' twice: each choice must differ"),
    (" , ", "--choices needs at least one non-empty choice"),
    ('["a", 1]', "--choices as a JSON array must hold strings only"),
    ('["a",', "--choices looks like a JSON array but is not JSON"),
])
def test_bad_choices_are_refused(text: str, message: str) -> None:
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(")):
        choices_option(text)


def test_choices_with_spaces_constrain_the_output(tiny_model_dir: Path) -> None:
    res = invoke(["run", "-", "--model", str(tiny_model_dir), "-q", "--choices",
                  "positive, negative"], jsonl([{"prompt": "Is it good?"}] * 2))
    assert res.exit_code == 0, res.output
    assert {r["text"] for r in results(res.stdout)} <= {"positive", "negative"}
    dup = invoke(["run", "-", "--model", str(tiny_model_dir), "--choices", "a,b,a"], "")
    assert dup.exit_code == 2 and "twice" in dup.stderr


def test_a_grammar_file_constrains_every_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    lark = tmp_path / "yn.lark"
    lark.write_text('start: "yes" | "no"\n')
    gbnf = tmp_path / "digits.gbnf"
    gbnf.write_text('root ::= [0-9] [0-9]\n')
    for grammar, ok in ((lark, {"yes", "no"}), (gbnf, None)):
        res = invoke(["run", "-", "--model", str(tiny_model_dir), "-q", "--grammar",
                      str(grammar)], jsonl([{"prompt": "Answer:"}, {"prompt": "Again:"}]))
        assert res.exit_code == 0, res.output
        for r in results(res.stdout):
            assert r["text"] in ok if ok else (len(r["text"]) == 2 and r["text"].isdigit())
            assert r["made_with"]["grammar"].startswith("sha256:")
    bad = tmp_path / "bad.lark"
    bad.write_text("start: (\n")
    res = invoke(["run", "-", "--model", "/no/model", "--grammar", str(bad)], "")
    assert res.exit_code == 2
    assert res.stderr.startswith(f"Error: --grammar {bad} is not a usable grammar: ")
    both = invoke(["run", "-", "--grammar", str(lark), "--regex", "a"], "")
    assert both.exit_code == 2 and "at most one of" in both.stderr


@pytest.mark.subprocess
def test_input_left_out_reads_a_pipe_and_a_terminal_is_told_what_to_do(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    piped = subprocess.run([*aici_batch(), "run", "--model", str(tiny_model_dir), "-q"],
                           input=jsonl([{"prompt": "a", "max_tokens": 2}]), capture_output=True,
                           text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert len(results(piped.stdout)) == 1
    # A terminal on stdin: a usage error at once (nothing would come until the user types).
    leader, follower = pty.openpty()
    try:
        tty = subprocess.run([*aici_batch(), "run", "--model", str(tiny_model_dir)],
                             stdin=follower, capture_output=True, text=True, timeout=120)
    finally:
        os.close(leader)
        os.close(follower)
    assert tty.returncode == 2
    assert "missing INPUT: give a JSONL file, or pipe the lines in" in tty.stderr


def test_integer_ids_come_back_as_integers(tiny_model_dir: Path) -> None:
    res = invoke(["run", "-", "--model", str(tiny_model_dir), "-q"],
                 jsonl([{"id": 7, "prompt": "a", "max_tokens": 2}, {"id": 8, "promt": "b"},
                        {"id": "9", "prompt": "c", "max_tokens": 2}]))
    assert res.exit_code == 1
    assert {r["index"]: r["id"] for r in results(res.stdout)} == {1: 7, 2: 8, 3: "9"}


# --- JSON schemas in OpenAI's envelope ----------------------------------------------------

PERSON = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}


def test_unwrap_takes_the_schema_out_of_either_envelope() -> None:
    envelope = {"name": "person", "strict": True, "schema": PERSON}
    assert unwrap(envelope) == (PERSON, "is an OpenAI json_schema envelope 'person': using "
                                        "the JSON Schema under its 'schema' key")
    assert unwrap({"type": "json_schema", "json_schema": envelope})[0] == PERSON
    assert unwrap(PERSON) == (PERSON, None)
    # A schema that happens to have a property called schema is no envelope.
    own = {"type": "object", "properties": {"schema": {"type": "string"}}}
    assert unwrap(own) == (own, None)


@pytest.mark.parametrize(("schema", "hint"), [
    ({"typ": "object"}, "did you mean 'type' for 'typ'?"),
    ({"name": {"type": "string"}, "age": {"type": "integer"}}, "these look like properties"),
    ({"name": "p", "schema": {}, "extra": 1}, "an OpenAI envelope?"),
    ({"title": "Person", "description": "a person"}, 'e.g. {"type": "object"'),
])
def test_a_schema_that_constrains_nothing_is_refused_with_a_hint(schema: dict[str, Any],
                                                                 hint: str) -> None:
    problem = inert_problem(schema)
    assert problem is not None and problem.startswith("has no keyword that constrains a value")
    assert hint in problem


@pytest.mark.parametrize("schema", [{}, True, PERSON, {"$ref": "#/$defs/a", "$defs": {}},
                                    {"allOf": []}])
def test_schemas_that_constrain_or_mean_any_value_pass(schema: Any) -> None:
    assert inert_problem(schema) is None


def test_an_envelope_given_to_json_schema_is_unwrapped_and_constrains(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "person.json"
    path.write_text(json.dumps({"name": "n", "strict": True,
                                "schema": {"type": "integer", "minimum": 0}}))
    res = invoke(["run", "-", "--model", str(tiny_model_dir), "--json-schema", str(path),
                  "--max-tokens", "6", "--progress-interval", "0"],
                 jsonl([{"prompt": "A number:"}]))
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines()[0] == (
        f"aici-batch: --json-schema {path} is an OpenAI json_schema envelope 'n': using the "
        "JSON Schema under its 'schema' key")
    [result] = results(res.stdout)
    if result["finish_reason"] == "stop":
        assert isinstance(result["json"], int) and result["valid"] is True
    assert result["text"].isdigit()  # constrained: digits only, never unconstrained text
    inert = tmp_path / "inert.json"
    inert.write_text('{"typ": "object"}')
    refused = invoke(["run", "-", "--model", "/no/model", "--json-schema", str(inert)], "")
    assert refused.exit_code == 2
    assert refused.stderr.strip() == (
        f"Error: --json-schema {inert} has no keyword that constrains a value at its top "
        "level (it has 'typ'), so it allows any JSON: did you mean 'type' for 'typ'?")


def test_the_openai_example_file_runs_as_the_sdk_writes_it(tiny_model_dir: Path) -> None:
    """examples/openai_batch.jsonl: content parts, null and ignored fields, a json_schema
    response_format, a completion: every request answered, none refused."""
    res = invoke(["run", str(ROOT / "examples" / "openai_batch.jsonl"), "--model",
                  str(tiny_model_dir), "-q", "--max-tokens", "12"])
    assert res.exit_code == 0, res.output
    lines = {r["custom_id"]: r for r in results(res.stdout)}
    assert set(lines) == {"person-1", "capital-1", "haiku-1", "story-1"}
    assert all(line["error"] is None for line in lines.values())
    choice = lines["capital-1"]["response"]["body"]["choices"][0]["message"]["content"]
    assert choice in ("Paris", "London", "Berlin", "Madrid")


def test_a_non_text_content_part_is_that_lines_error(tiny_model_dir: Path) -> None:
    image = {"custom_id": "img", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": [
                 {"type": "text", "text": "What is this?"},
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]}}
    typo = {"custom_id": "typo", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "temprature": 1}}
    res = invoke(["run", "-", "--model", str(tiny_model_dir), "-q"], jsonl([image, typo]))
    assert res.exit_code == 1
    errors = {r["custom_id"]: r["error"]["message"] for r in results(res.stdout)}
    assert errors["img"] == ("line 1: field 'body.messages[0].content[1]' is a part of type "
                             "'image_url': only text parts can run here (the model reads text)")
    assert errors["typo"] == ("line 2: unsupported body field(s): temprature (did you mean "
                              "'temperature' for 'temprature'?)")
