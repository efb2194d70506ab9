"""`aici-batch run` end to end on the tiny model, through Click's runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner, Result

from aici_cli.cli.main import main
from aici_cli.formats.jobs import load_schema

GOOD = [
    {"id": "a", "prompt": "Once upon a time", "max_tokens": 6},
    {"id": "b", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4},
    {"id": "c", "prompt": "Pick", "choices": ["yes", "no"]},
    {"id": "d", "prompt": "Person:", "json_schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
     "max_tokens": 20},
]


def jsonl(rows: list[Any]) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def invoke(args: list[str], stdin: str | None = None) -> Result:
    return CliRunner().invoke(main, args, input=stdin)


def results_of(text: str) -> list[dict[str, Any]]:
    validator = jsonschema.Draft202012Validator(load_schema("result-line"))
    out = [json.loads(line) for line in text.splitlines() if line.strip()]
    for r in out:
        validator.validate(r)
    return out


@pytest.fixture()
def model_args(tiny_model_dir: Path) -> list[str]:
    return ["--model", str(tiny_model_dir), "--dtype", "float32", "--device", "cpu"]


def test_good_lines_exit_zero_and_validate(model_args: list[str], tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    res = invoke(["run", "-", *model_args, "--stats-out", str(stats), "-q"], jsonl(GOOD))
    assert res.exit_code == 0, res.output
    results = results_of(res.stdout)
    assert sorted(r["id"] for r in results) == ["a", "b", "c", "d"]
    by_id = {r["id"]: r for r in results}
    assert by_id["c"]["text"] in ("yes", "no")
    assert "valid" in by_id["d"] and "json" in by_id["d"]
    summary = json.loads(stats.read_text())
    jsonschema.validate(summary, load_schema("stats"))
    assert summary["lines"] == 4 and summary["errors"] == 0
    assert summary["output_tokens"] == sum(r["stats"]["output_tokens"] for r in results)
    # Two distinct grammars were compiled: the choices and the JSON schema.
    assert summary["grammar_compile_ms"]["grammars"] == 2


def test_bad_lines_get_error_results_and_exit_one(model_args: list[str]) -> None:
    lines = [
        GOOD[0],
        "{not json",
        {"id": "typo", "promt": "x"},
        {"id": "type", "prompt": "x", "max_tokens": "ten"},
        {"id": "empty", "prompt": ""},
        {"id": "schema", "prompt": "x", "json_schema": {"type": "nonsense"}},
        GOOD[2],
    ]
    res = invoke(["run", "-", *model_args, "-q"], jsonl(lines))
    assert res.exit_code == 1
    results = {r["index"]: r for r in results_of(res.stdout)}
    assert sorted(results) == list(range(1, 8))
    assert results[1]["finish_reason"] != "error" and results[7]["finish_reason"] != "error"
    expected = {2: "invalid_json", 3: "invalid_line", 4: "invalid_line", 5: "empty_prompt",
                6: "invalid_schema"}
    for index, etype in expected.items():
        assert results[index]["finish_reason"] == "error"
        assert results[index]["error"]["type"] == etype
        assert results[index]["error"]["message"].startswith(f"line {index}:")
    assert "promt" in results[3]["error"]["message"]


def test_output_file_and_cli_constraint(model_args: list[str], tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(jsonl([{"prompt": "A"}, {"prompt": "B", "choices": ["x", "y"]}]))
    res = invoke(["run", str(prompts), "-o", str(out), *model_args, "--choices", "up,down",
                  "-q"])
    assert res.exit_code == 0, res.output
    assert res.stdout == ""
    results = {r["index"]: r for r in results_of(out.read_text())}
    assert results[1]["text"] in ("up", "down")  # the CLI default
    assert results[2]["text"] in ("x", "y")  # the line's own constraint wins
    assert results[1]["id"] == "1"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "missing.jsonl"], "missing.jsonl"),
        (["run", "-", "--model", "/no/such/model"], "/no/such/model"),
        (["run", "-", "--regex", "a", "--choices", "a,b"], "at most one"),
        (["run", "-", "--json-schema", "/no/schema.json"], "/no/schema.json"),
    ],
)
def test_usage_errors_exit_two_with_one_line(args: list[str], needle: str) -> None:
    res = invoke(args, "")
    assert res.exit_code == 2
    message = res.stderr.strip()
    assert needle in message
    assert len(message.splitlines()) == 1
    assert "Traceback" not in res.output


def aici_batch() -> list[str]:
    exe = Path(sys.executable).with_name("aici-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "aici_cli"]


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--json-schema", "{schema}"],
         "--json-schema {schema} is not a valid JSON Schema: at 'type': 'objekt' is not valid "
         "under any of the given schemas"),
        (["--regex", "a("],
         "--regex is not a valid regular expression: missing ), unterminated subpattern at "
         "position 1"),
        (["--regex", "(?=a)b"], "--regex: regex not supported: "),
        (["--stop", "end", "--stop", ""], "--stop #2 must not be empty"),
        (["--min-tokens", "300"], "--min-tokens must be at most --max-tokens (256), got 300"),
        (["--temperature", "50"], "--temperature must be <= 10, got 50.0"),
        (["--seed", str(2**64)], "--seed must be <= 9223372036854775807"),
    ],
)
def test_a_bad_run_level_default_exits_two_before_the_model_loads(
    option: list[str], message: str, tmp_path: Path
) -> None:
    schema = tmp_path / "bad.schema.json"
    schema.write_text('{"type": "objekt"}')
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(jsonl([{"prompt": "a"}, {"prompt": "b"}]))
    args = [a.format(schema=schema) for a in option]
    # A model that does not exist: the option must be refused before the model is looked for.
    done = subprocess.run([*aici_batch(), "run", str(src), "-o", str(out), "--model",
                           str(tmp_path / "no-model"), *args], capture_output=True, text=True,
                          timeout=120)

    assert done.returncode == 2
    assert done.stderr.startswith("Error: " + message.format(schema=schema))
    assert len(done.stderr.strip().splitlines()) == 1
    assert not out.exists()  # nothing was written, not even an empty output


def test_an_unsupported_cli_schema_is_refused_unless_relaxed(model_args: list[str],
                                                            tmp_path: Path) -> None:
    schema = tmp_path / "lookahead.schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?=x)a"}}, "required": ["a"]}))
    refused = invoke(["run", "-", *model_args, "--json-schema", str(schema)], jsonl(GOOD[:1]))
    assert refused.exit_code == 2
    assert "JSON schema not supported" in refused.stderr
    assert "--schema-fallback relax" in refused.stderr

    relaxed = invoke(["run", "-", *model_args, "-q", "--json-schema", str(schema),
                      "--schema-fallback", "relax", "--max-tokens", "4"],
                     jsonl([{"prompt": "a"}]))
    assert relaxed.exit_code in (0, 1), relaxed.output
    [result] = results_of(relaxed.stdout)
    assert result["relaxed"]  # ran, with the closest schema the engine enforces


def test_a_lines_own_bad_constraint_stays_that_lines_error(model_args: list[str]) -> None:
    lines = [{"prompt": "a", "regex": "a("}, {"prompt": "b", "json_schema": {"type": "x"}},
             {"prompt": "c"}]
    res = invoke(["run", "-", *model_args, "-q", "--regex", "[ab]"], jsonl(lines))
    assert res.exit_code == 1
    results = {r["index"]: r for r in results_of(res.stdout)}
    assert results[1]["error"]["type"] == "invalid_regex"
    assert results[2]["error"]["type"] == "invalid_schema"
    assert results[3]["finish_reason"] != "error" and set(results[3]["text"]) <= {"a", "b"}


def test_summary_table_goes_to_stderr_only(model_args: list[str]) -> None:
    res = invoke(["run", "-", *model_args], jsonl(GOOD[:1]))
    assert res.exit_code == 0
    assert "tokens/s" in res.stderr
    assert len(results_of(res.stdout)) == 1
    quiet = invoke(["run", "-", *model_args, "--quiet"], jsonl(GOOD[:1]))
    assert quiet.stderr == ""


def test_report_summarizes_a_finished_run(model_args: list[str], tmp_path: Path) -> None:
    out, stats = tmp_path / "r.jsonl", tmp_path / "s.json"
    res = invoke(["run", "-", *model_args, "-o", str(out), "--stats-out", str(stats), "-q"],
                 jsonl([*GOOD, {"prompt": ""}]))
    assert res.exit_code == 1
    rep = invoke(["report", str(out), "--stats", str(stats), "--json"])
    assert rep.exit_code == 0, rep.output
    summary = json.loads(rep.stdout)
    run_summary = json.loads(stats.read_text())
    assert summary["lines"] == 5 and summary["errors"] == 1
    assert summary["output_tokens"] == run_summary["output_tokens"]
    assert summary["tokens_per_s"] == run_summary["tokens_per_s"]
    table = invoke(["report", str(out)])
    assert table.exit_code == 0 and "row passes per output token" in table.stdout
    missing = invoke(["report", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and "nope.jsonl" in missing.stderr


@pytest.mark.subprocess
def test_report_counts_compliance_over_all_schema_lines_and_over_those_that_ran(
    model_args: list[str], tmp_path: Path
) -> None:
    boolean = {"type": "boolean"}
    lookahead = {"type": "string", "pattern": "(?=x)a"}  # no grammar engine takes it
    lines = [{"prompt": "a", "json_schema": boolean, "max_tokens": 8},
             {"prompt": "b", "json_schema": boolean, "max_tokens": 8},
             {"prompt": "c", "json_schema": lookahead},  # unsupported_schema when compiled
             {"prompt": "d", "json_schema": {"type": "nonsense"}},  # invalid_schema when read
             {"prompt": "e", "max_tokens": 2}]  # no schema
    src, out, stats = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "s.json"
    src.write_text(jsonl(lines))
    done = subprocess.run([*aici_batch(), "run", str(src), "-o", str(out), *model_args,
                           "--stats-out", str(stats)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    results = {r["index"]: r for r in results_of(out.read_text())}
    assert [results[i].get("valid") for i in range(1, 6)] == [True, True, False, False, None]
    assert results[3]["error"]["type"] == "unsupported_schema"
    assert results[4]["error"]["type"] == "invalid_schema"
    assert "of all schema lines" in done.stderr and "2/4 (50.0%)" in done.stderr
    assert "of those that ran" in done.stderr and "2/2 (100.0%)" in done.stderr
    assert json.loads(stats.read_text())["schema_errors"] == 2

    rep = subprocess.run([*aici_batch(), "report", str(out), "--json"], capture_output=True,
                         text=True, timeout=120)
    summary = json.loads(rep.stdout)
    assert (summary["schema_lines"], summary["valid"], summary["schema_errors"]) == (2, 2, 2)
    assert summary["compliance"] == 0.5  # JSONSchemaBench's: over every schema line
    assert summary["compliance_ran"] == 1.0
    table = subprocess.run([*aici_batch(), "report", str(out)], capture_output=True, text=True,
                           timeout=120).stdout
    assert "2/4 (50.0%)" in table and "2/2 (100.0%)" in table


def test_n_samples_per_line_and_from_the_cli(model_args: list[str], tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    rows = [{"id": "one", "prompt": "Hello", "max_tokens": 6},
            {"id": "three", "prompt": "Give JSON", "n": 3, "json_schema": schema,
             "max_tokens": 30, "temperature": 1.0},
            {"id": "bad", "prompt": "x", "n": 0}]
    stats = tmp_path / "stats.json"
    res = invoke(["run", "-", *model_args, "--n", "2", "--temperature", "0.7",
                  "--stats-out", str(stats), "-q"], jsonl(rows))
    assert res.exit_code == 1, res.output
    by_id = {r["id"]: r for r in results_of(res.stdout)}  # validates against the schema
    assert [c["index"] for c in by_id["one"]["choices"]] == [0, 1]  # --n 2 as the default
    three = by_id["three"]
    assert three["n"] == 3 and len(three["choices"]) == 3
    for c in three["choices"]:
        assert c["valid"] is True and "a" in c["json"]
    assert three["stats"]["output_tokens"] == sum(
        c["stats"]["output_tokens"] for c in three["choices"])
    assert by_id["bad"]["error"]["type"] == "invalid_line"
    summary = json.loads(stats.read_text())
    assert summary["schema_lines"] == 3 and summary["valid"] == 3


def test_options_come_from_aici_batch_environment_variables(model_args: list[str]) -> None:
    rows = [{"id": "a", "prompt": "Hello"}]
    res = CliRunner().invoke(main, ["run", "-", *model_args, "-q"], input=jsonl(rows),
                             env={"AICI_BATCH_MAX_TOKENS": "3", "AICI_BATCH_N": "2"})
    assert res.exit_code == 0, res.output
    [r] = results_of(res.stdout)
    assert len(r["choices"]) == 2
    assert all(c["stats"]["output_tokens"] <= 3 for c in r["choices"])
    # The command line wins over the environment.
    res = CliRunner().invoke(main, ["run", "-", *model_args, "-q", "--max-tokens", "1"],
                             input=jsonl(rows), env={"AICI_BATCH_MAX_TOKENS": "3"})
    assert results_of(res.stdout)[0]["stats"]["output_tokens"] == 1


@pytest.mark.parametrize("command", sorted(main.commands))
def test_every_command_has_help_with_an_example(command: str) -> None:
    res = invoke([command, "--help"])
    assert res.exit_code == 0
    assert "Example" in res.output
    assert len(res.output.split("\n\n")[1].strip()) > 20  # a description, not just usage


@pytest.mark.subprocess
def test_shell_completion(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "aici-batch"
    env = {**os.environ, "_AICI_BATCH_COMPLETE": "bash_source"}
    script = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    assert "_aici_batch_completion" in script.stdout
    env = {**os.environ, "_AICI_BATCH_COMPLETE": "bash_complete",
           "COMP_WORDS": "aici-batch run --batch-s", "COMP_CWORD": "2"}
    words = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    assert "--batch-size" in words.stdout


# The commands that never run a model must not pay for torch, transformers, llguidance or
# wasmtime (seconds of imports): `--help`, `wit`, `report` and shell completion.
HEAVY = ("torch", "transformers", "llguidance", "wasmtime")
LIGHT_COMMANDS = [["--help"], ["run", "--help"], ["wit"], ["report", "--help"]]


def heavy_modules_after(code: str) -> list[str]:
    probe = (f"import sys\n{code}\n"
             f"print([m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    return json.loads(done.stderr.strip().splitlines()[-1].replace("'", '"'))


@pytest.mark.subprocess
def test_importing_the_cli_does_not_import_torch() -> None:
    assert heavy_modules_after("import aici_cli.cli.main") == []


@pytest.mark.subprocess
@pytest.mark.parametrize("args", LIGHT_COMMANDS, ids=" ".join)
def test_light_commands_do_not_import_torch(args: list[str]) -> None:
    code = ("from aici_cli.cli.main import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit:\n    pass")
    assert heavy_modules_after(code) == []


@pytest.mark.subprocess
@pytest.mark.parametrize("args", [["models"], ["models", "--prune", "--dry-run"]], ids=" ".join)
def test_models_does_not_import_torch(args: list[str], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`models` reads transformers' version (the conversion cache's key), not torch."""
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    code = ("from aici_cli.cli.main import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit:\n    pass")
    assert "torch" not in heavy_modules_after(code)


@pytest.mark.subprocess
def test_a_local_run_does_not_import_ray(model_args: list[str], tmp_path: Path) -> None:
    """Ray is optional: a run without --ray never imports it."""
    src = tmp_path / "in.jsonl"
    src.write_text(jsonl(GOOD[:1]))
    code = ("import sys\nfrom aici_cli.cli.main import main\n"
            f"try:\n    main(['run', {str(src)!r}, *{model_args!r}, '-q'])\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print('ray' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.stderr.strip().splitlines()[-1] == "False", done.stderr


@pytest.mark.subprocess
def test_ray_without_ray_installed_is_a_one_line_usage_error(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(jsonl(GOOD[:1]))
    code = ("import sys\nsys.modules['ray'] = None  # as if not installed\n"
            "from aici_cli.cli.main import main\n"
            f"main(['run', {str(src)!r}, '--ray', 'auto', '--workers', '2'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("Error: --ray needs Ray, which is not installed: "
                                   "pip install 'aici-batch[ray]'")


def test_workers_need_ray(tmp_path: Path) -> None:
    res = invoke(["run", "-", "--workers", "2"], jsonl(GOOD[:1]))
    assert res.exit_code == 2
    assert "--workers needs --ray" in res.output


def test_score_alone_ranks_the_choices_each_line_brings() -> None:
    # `--score` without `--choices` is a run of lines that carry their own choices (the
    # eval example): not a bad option. With a constraint that is not choices, it is.
    from aici_cli.core.config import JobDefaults
    from aici_cli.core.constraint import Constraint
    from aici_cli.formats.jobs.defaults import defaults_problem

    assert defaults_problem(JobDefaults(score=True), strict_json=True) is None
    assert defaults_problem(
        JobDefaults(score=True, constraint=Constraint("choice", ["a", "b"])), True) is None
    problem = defaults_problem(
        JobDefaults(score=True, constraint=Constraint("regex", "a+")), True)
    assert problem is not None and "choices" in problem
