"""`--schema-fallback relax`: the relax rules, validation against the original schema, and
retries with another seed, through the compiler, the engine and the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner
from factories import job_factory

from aici_cli.cli.main import main
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.grammar.relax import Checks, Relaxation, relax_step
from aici_cli.core.config import EngineConfig
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import GrammarError
from aici_cli.core.job import Job
from aici_cli.engine import Engine
from aici_cli.engine.retry import RETRY_TEMPERATURE, next_attempt
from aici_cli.formats.jobs import load_schema
from aici_cli.models import LoadedModel

# Refused by llguidance as written: the lookaround. Relaxed, any short string goes; the
# original matches none ("y" cannot also start with "x"), so no output may be valid.
NEVER_VALID = {"type": "string", "maxLength": 4, "pattern": "^(?=x)y"}
# Relaxed: either option; the original takes only "ab".
ONLY_AB = {"enum": ["ab", "cd"], "pattern": "^(?=a)"}


@pytest.fixture(scope="module")
def compiler(lm: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))


def relaxed(compiler: GrammarCompiler, schema: Any) -> list[str]:
    """The steps relax takes; the schema must not compile without it."""
    with pytest.raises(GrammarError) as off:
        compiler.compile(Constraint("json_schema", schema))
    assert off.value.type == "unsupported_schema"
    return compiler.compile(Constraint("json_schema", schema), relax=True).relaxed


def no_checks() -> Checks:
    return Checks(regex_problem=lambda _: None, probe=lambda: "unchanged", strict_json=True)


# ------------------------------------------------------------------------ the rules


def test_drops_the_keywords_llguidance_names_and_leaves_the_original_alone() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}},
                                               "not": {"type": "integer"}},
              "dependencies": {"a": ["b"]}}
    original = json.loads(json.dumps(schema))
    state = Relaxation.of(schema)
    assert relax_step(state, ['Unimplemented keys: ["not", "dependencies"]'], no_checks())
    assert state.steps == ["dropped not at /properties/a; dropped dependencies at /"]
    assert state.schema == {"type": "object", "properties": {"a": {"type": "string"},
                                                             "not": {"type": "integer"}}}
    assert schema == original  # a property named "not" is not the keyword, and no aliasing


def test_drops_only_the_unknown_format_named() -> None:
    state = Relaxation.of({"type": "object", "properties": {
        "a": {"type": "string", "format": "hostname-ish"},
        "b": {"type": "string", "format": "date"}}})
    assert relax_step(state, ["Unknown format: hostname-ish"], no_checks())
    assert state.steps == ["dropped format 'hostname-ish' at /properties/a"]
    assert state.schema["properties"]["b"] == {"type": "string", "format": "date"}


def test_drops_the_patterns_the_regex_engine_refuses(compiler: GrammarCompiler,
                                                     lm: LoadedModel) -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^(?=x)y"},
        "b": {"type": "string", "pattern": "(a)\\1"},
        "c": {"type": "string", "pattern": "^[0-9]+$"},
        "d": {"type": "integer", "not": {"const": 1}}},
        "required": ["c"], "dependencies": {"a": ["b"]}}
    assert relaxed(compiler, schema) == [
        "dropped dependencies at /",
        "dropped not at /properties/d",
        "dropped pattern at /properties/a (lookaround); "
        "dropped pattern at /properties/b (backreference)",
    ]
    # The pattern the engine takes is still enforced.
    grammar = compiler.compile(Constraint("json_schema", schema), relax=True)

    def accepts(text: str) -> bool:
        m = GrammarController(grammar, fast_forward=False).matcher()
        tokens = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()

    assert accepts('{"c": "12"}')
    assert not accepts('{"c": "1x"}')


def test_circular_ref_with_sibling_keys(compiler: GrammarCompiler) -> None:
    # draft-07 ignores keys beside $ref: dropping them changes nothing.
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"n": {
        "type": "object",
        "properties": {"c": {"$ref": "#/definitions/n", "type": "object", "required": ["x"]}}}},
        "$ref": "#/definitions/n"}
    assert relaxed(compiler, draft7) == [
        "dropped keys beside $ref '#/definitions/n' at /definitions/n/properties/c "
        "(ignored by the draft)"]
    # A `type` beside anyOf that every branch declares is merged for nothing.
    anyof = {"$defs": {
        "n": {"type": "object", "properties": {"c": {
            "type": "object", "anyOf": [{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/m"}]}}},
        "m": {"type": "object", "properties": {"z": {"type": "integer"}}}},
        "$ref": "#/$defs/n"}
    assert relaxed(compiler, anyof) == [
        "dropped type beside anyOf/oneOf at /$defs/n/properties/c (every branch declares it)"]
    # allOf with a reference to itself: inlined once (exact), then the reference that
    # still loops is dropped.
    looped = {"$defs": {"n": {"type": "object", "properties": {"c": {
        "allOf": [{"$ref": "#/$defs/n"}, {"type": "object"}]}}}}, "$ref": "#/$defs/n"}
    assert relaxed(compiler, looped) == [
        "inlined $ref '#/$defs/n' at /$defs/n/properties/c/allOf/0",
        "dropped circular $ref '#/$defs/n' at /$defs/n/properties/c/allOf/0/properties/c/allOf/0",
    ]


def test_unsatisfiable_required_opens_objects_first(compiler: GrammarCompiler) -> None:
    # Closed by strict JSON, A and B each forbid the other's key: their allOf cannot hold.
    # (Strict JSON leaves definitions that a local `#/...` reference merges open; these
    # references name the document by its `$id`, which it does not follow.)
    root = "http://example.com/root.json"
    schema = {"$id": root, "type": "object", "required": ["v"],
              "properties": {"v": {"allOf": [{"$ref": f"{root}#/definitions/A"},
                                             {"$ref": f"{root}#/definitions/B"}]}},
              "definitions": {
                  "A": {"type": "object", "properties": {"a": {"type": "string"}},
                        "required": ["a"]},
                  "B": {"type": "object", "properties": {"b": {"type": "string"}},
                        "required": ["b"]}}}
    assert relaxed(compiler, schema) == ["objects left open to keys they do not declare"]
    state = Relaxation.of({"type": "object", "properties": {"p": {"type": "integer"}},
                           "required": ["p", "q"]}, )
    state.close = state.exclusive = False
    assert relax_step(state, ["Unsatisfiable schema: required property 'p' is unsatisfiable"],
                      no_checks())
    assert state.steps == ["dropped required 'p' at /"]
    assert state.schema["required"] == ["q"]


def test_last_resort_replaces_the_smallest_subschema(compiler: GrammarCompiler) -> None:
    # No rule reads "incompatible types": the deepest subschema whose replacement alone
    # lets the schema compile is found by compiling.
    schema = {"type": "array", "minItems": 1,
              "items": {"allOf": [{"type": "string"}, {"type": "integer"}]}}
    assert relaxed(compiler, schema) == [
        "replaced schema at /items/allOf/0 with {} "
        "(Unsatisfiable schema: required item is unsatisfiable)"]


def test_a_schema_that_compiles_is_not_relaxed(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(Constraint("json_schema", {"type": "integer"}), relax=True)
    assert grammar.relaxed == []
    assert "relaxed" not in GrammarController(grammar).report("3")


def test_valid_is_against_the_original_schema(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(Constraint("json_schema", ONLY_AB), relax=True)
    assert grammar.relaxed == ["dropped pattern at / (lookaround)"]
    report = GrammarController(grammar).report('"cd"')  # the relaxed schema takes it
    assert report == {"relaxed": ["dropped pattern at / (lookaround)"], "json": "cd",
                      "valid": False}
    assert GrammarController(grammar).report('"ab"')["valid"] is True


# ----------------------------------------------------------------------- retries


# job(index, schema): a line constrained by `schema`, relaxed where llguidance refuses it.
job = job_factory(lambda index, schema: dict(
    prompt=f"Answer number {index}:", constraint=Constraint("json_schema", schema)),
    schema_fallback="relax")


def test_next_attempt_samples_with_the_next_seed() -> None:
    failed = {"relaxed": ["x"], "valid": False, "finish_reason": "stop"}
    retry = next_attempt(job(1, {}, seed=7), failed, retries=2)
    assert retry is not None
    assert (retry.attempt, retry.sampling.seed, retry.sampling.temperature) == (
        1, 8, RETRY_TEMPERATURE)
    hot = next_attempt(job(1, {}, seed=7, temperature=1.3, attempt=1), failed, retries=2)
    assert hot is not None
    assert (hot.attempt, hot.sampling.seed, hot.sampling.temperature) == (2, 8, 1.3)
    assert next_attempt(job(1, {}, attempt=2), failed, retries=2) is None  # spent
    assert next_attempt(job(1, {}), {**failed, "valid": True}, retries=2) is None
    assert next_attempt(job(1, {}), {"valid": False, "finish_reason": "stop"}, 2) is None
    assert next_attempt(job(1, {}), {**failed, "finish_reason": "error"}, 2) is None


def run(lm: LoadedModel, jobs: list[Job], **config: Any) -> dict[int, dict[str, Any]]:
    results: list[dict[str, Any]] = []
    Engine(lm, EngineConfig(**config)).run(jobs, results.append)
    assert sorted(r["index"] for r in results) == [j.index for j in jobs]
    validator = jsonschema.Draft202012Validator(load_schema("result-line"))
    for r in results:
        validator.validate(r)
    return {r["index"]: r for r in results}


def test_a_relaxed_line_that_never_validates_is_retried_and_says_so(lm: LoadedModel) -> None:
    results = run(lm, [job(1, NEVER_VALID), job(2, NEVER_VALID, schema_fallback="off")],
                  batch_size=2)
    r = results[1]
    assert r["finish_reason"] == "stop"
    assert r["relaxed"] == ["dropped pattern at / (lookaround)"]
    assert isinstance(r["json"], str) and len(r["json"]) <= 4  # the relaxed schema held
    assert r["valid"] is False  # against the relaxed schema it would be True
    assert r["attempts"] == 3  # 1 + the default 2 retries
    assert r["stats"]["forward_passes"] >= 3
    off = results[2]
    assert off["finish_reason"] == "error"
    assert off["error"]["type"] == "unsupported_schema"
    assert "relaxed" not in off and "attempts" not in off

    once = run(lm, [job(1, NEVER_VALID)], schema_retries=0)[1]
    assert once["attempts"] == 1 and once["valid"] is False
    assert once["stats"]["forward_passes"] < r["stats"]["forward_passes"]


def test_valid_follows_the_original_schema_through_retries(lm: LoadedModel) -> None:
    jobs = [job(i, ONLY_AB) for i in range(1, 13)]
    results = run(lm, jobs, batch_size=4, schema_retries=3)
    original = jsonschema.Draft202012Validator(ONLY_AB)
    for r in results.values():
        assert r["finish_reason"] == "stop"
        assert r["json"] in ("ab", "cd")  # the relaxed schema held
        assert r["valid"] is original.is_valid(r["json"]) is (r["json"] == "ab")
        # A line stops at its first valid output, or runs out of retries.
        assert r["valid"] or r["attempts"] == 4
    attempts = [r["attempts"] for r in results.values()]
    assert any(a > 1 for a in attempts), attempts  # some first outputs were "cd"
    assert any(r["valid"] for r in results.values() if r["attempts"] > 1)  # retries help


def test_through_the_cli(tiny_model_dir: Path) -> None:
    lines = [{"id": "relaxed", "prompt": "Word:", "json_schema": NEVER_VALID},
             {"id": "own", "prompt": "Word:", "json_schema": NEVER_VALID,
              "schema_fallback": "off"},
             {"id": "plain", "prompt": "Number:", "json_schema": {"type": "integer"},
              "max_tokens": 4}]
    args = ["run", "-", "--model", str(tiny_model_dir), "--dtype", "float32", "--device",
            "cpu", "-q", "--max-tokens", "12"]
    stdin = "".join(json.dumps(line) + "\n" for line in lines)
    res = CliRunner().invoke(main, [*args, "--schema-fallback", "relax",
                                    "--schema-retries", "1"], input=stdin)
    assert res.exit_code == 1, res.output  # the "off" line is an error
    out = {r["id"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert out["relaxed"]["valid"] is False and out["relaxed"]["attempts"] == 2
    assert out["relaxed"]["relaxed"] == ["dropped pattern at / (lookaround)"]
    assert out["own"]["error"]["type"] == "unsupported_schema"
    assert "relaxed" not in out["plain"] and "attempts" not in out["plain"]

    default = CliRunner().invoke(main, args, input=stdin)
    out = {r["id"]: r for r in map(json.loads, default.stdout.splitlines())}
    assert out["relaxed"]["error"]["type"] == "unsupported_schema"  # off by default

    bad = CliRunner().invoke(main, args, input=json.dumps(
        {"prompt": "x", "json_schema": {}, "schema_fallback": "maybe"}) + "\n")
    line = json.loads(bad.stdout)
    assert line["error"]["type"] == "invalid_line"
    assert "schema_fallback" in line["error"]["message"]
