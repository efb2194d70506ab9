"""Built-in grammars: schema rewrites, compile cache, errors, and outputs that validate."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from paths import JSONSCHEMABENCH

from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.grammar.schema_rewrite import close_objects, exclusive_one_of
from aici_cli.core.config import EngineConfig
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import GrammarError
from aici_cli.core.job import Job
from aici_cli.engine import Engine
from aici_cli.models import LoadedModel

BENCH = JSONSCHEMABENCH


@pytest.fixture(scope="module")
def compiler(lm: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))


def accepts(compiler: GrammarCompiler, lm: LoadedModel, schema: Any, text: str) -> bool:
    """Whether the compiled grammar lets `text` through to an accepting state."""
    controller = GrammarController(compiler.compile(Constraint("json_schema", schema)),
                                   fast_forward=False)
    tokens = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    m = controller.matcher()
    return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()


def test_close_objects_closes_plain_objects_only() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}},
        "allOf": [{"properties": {"c": {"type": "integer"}}}],
        "definitions": {"d": {"properties": {"x": {"const": {"properties": {}}}}}},
    }
    closed = close_objects(schema)
    assert "additionalProperties" not in closed  # combined with allOf: stays open
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]
    assert closed["definitions"]["d"]["additionalProperties"] is False
    assert closed["definitions"]["d"]["properties"]["x"]["const"] == {"properties": {}}
    explicit = {"type": "object", "properties": {"a": {}}, "additionalProperties": True}
    assert close_objects(explicit) == explicit


def test_close_objects_keeps_required_keys_it_does_not_declare(lm: LoadedModel) -> None:
    # Real schemas require keys they never declare; closing must not make them impossible.
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name", "id"]}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"] == {"name": {"type": "string"}, "id": {}}
    for value in ({"name": "x", "id": 3}, {"name": "x", "id": [1]}):  # any value, as before
        assert jsonschema.Draft202012Validator(closed).is_valid(value)
    assert not jsonschema.Draft202012Validator(closed).is_valid({"name": "x", "id": 1, "z": 0})
    compiler = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))
    compiler.compile(Constraint("json_schema", schema))  # was: unsatisfiable


def test_close_objects_keeps_definitions_that_allof_merges_open(lm: LoadedModel) -> None:
    # Definitions written before the `allOf` that merges them, one reached through another
    # `$ref`, and one that stays closed because nothing merges it.
    schema = {
        "definitions": {
            "Named": {"type": "object", "properties": {"name": {"type": "string"}},
                      "required": ["name"]},
            "Aged": {"$ref": "#/definitions/Age"},
            "Age": {"type": "object", "properties": {"age": {"type": "integer"}},
                    "required": ["age"]},
            "Alone": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
        "type": "object",
        "properties": {"person": {"allOf": [{"$ref": "#/definitions/Named"},
                                            {"$ref": "#/definitions/Aged"}]},
                       "other": {"$ref": "#/definitions/Alone"}},
    }
    closed = close_objects(schema)
    defs = closed["definitions"]
    assert "additionalProperties" not in defs["Named"]
    assert "additionalProperties" not in defs["Age"]
    assert defs["Alone"]["additionalProperties"] is False
    person = {"person": {"name": "Ann", "age": 3}, "other": {"x": 1}}
    assert jsonschema.Draft7Validator(closed).is_valid(person)  # was: no value could pass
    assert not jsonschema.Draft7Validator(closed).is_valid({"other": {"x": 1, "y": 2}})
    compiler = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))
    compiler.compile(Constraint("json_schema", schema))


def test_close_objects_never_widens_one_of_or_not() -> None:
    # Closing oneOf branches would let {"dog": "x"} through as matching one closed branch,
    # while under the original schema it matches both open branches and fails oneOf.
    schema = {"type": "object", "oneOf": [{"properties": {"dog": {"type": "string"}}},
                                          {"properties": {"cat": {"type": "string"}}}]}
    assert close_objects(schema) == schema
    negated = {"not": {"type": "object", "properties": {"a": {"type": "string"}}}}
    assert close_objects(negated) == negated
    anyof = {"anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                       {"type": "string"}]}
    assert close_objects(anyof)["anyOf"][0]["additionalProperties"] is False


def test_exclusive_one_of_makes_required_branches_exact() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
        "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
    }
    narrowed = exclusive_one_of(schema)
    for instance in ({"a": "x"}, {"b": "y"}, {"a": "x", "b": "y"}, {}):
        if jsonschema.Draft7Validator(narrowed).is_valid(instance):
            # Narrowing never lets through what the original rejects.
            assert jsonschema.Draft7Validator(schema).is_valid(instance), instance
    assert jsonschema.Draft7Validator(narrowed).is_valid({"a": "x"})


def test_exclusive_one_of_compiles_exactly_without_relaxing(compiler: GrammarCompiler,
                                                    lm: LoadedModel) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
        "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
    }
    # llguidance accepts `oneOf` whose branches it can prove disjoint; the rewrite makes
    # them so, and no relaxation is needed.
    compiled = compiler.compile(Constraint("json_schema", schema))
    assert compiled.warnings == []
    assert accepts(compiler, lm, schema, '{"a": "x"}')
    assert not accepts(compiler, lm, schema, '{"a": "x", "b": "y"}')


def test_strict_json_disallows_undeclared_keys(lm: LoadedModel) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    strict = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))
    loose = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids),
                            strict_json=False)
    text = '{"a": 1, "zzz": 2}'
    assert not accepts(strict, lm, schema, text)
    assert accepts(loose, lm, schema, text)
    assert accepts(strict, lm, schema, '{"a": 1}')


def test_compile_is_cached_per_distinct_constraint(compiler: GrammarCompiler) -> None:
    c1 = Constraint("regex", "[0-9]+")
    assert compiler.compile(c1) is compiler.compile(Constraint("regex", "[0-9]+"))
    with pytest.raises(GrammarError) as first:
        compiler.compile(Constraint("regex", "(["))
    with pytest.raises(GrammarError) as again:
        compiler.compile(Constraint("regex", "(["))
    assert first.value is again.value  # failures are cached too
    assert first.value.type == "invalid_regex"


def test_unsupported_schema_is_a_clear_error(compiler: GrammarCompiler) -> None:
    # Unsatisfiable: a string that is also an integer.
    with pytest.raises(GrammarError) as e:
        compiler.compile(Constraint("json_schema", {"allOf": [{"type": "string"},
                                                              {"type": "integer"}]}))
    assert e.value.type == "unsupported_schema"
    assert e.value.message.startswith("JSON schema not supported:")


def bench_schemas(subset: str, n: int) -> list[tuple[str, dict[str, Any]]]:
    files = sorted((BENCH / subset).glob("*.json"))[:n]
    return [(f.stem, json.loads(f.read_text())) for f in files]


@pytest.mark.heavy
@pytest.mark.skipif(not BENCH.is_dir(), reason="JSONSchemaBench data not present")
def test_finished_outputs_validate_on_jsonschemabench(lm: LoadedModel) -> None:
    """Random weights, real schemas: whatever finishes must validate against its schema."""
    schemas = bench_schemas("Github_trivial", 12) + bench_schemas("Glaiveai2K", 12)
    jobs = [
        Job(index=i + 1, id=name, prompt="JSON:", messages=None, max_tokens=96,
            constraint=Constraint("json_schema", s))
        for i, (name, s) in enumerate(schemas)
    ]
    results: list[dict[str, Any]] = []
    Engine(lm, EngineConfig(batch_size=8)).run(jobs, results.append)
    assert len(results) == len(jobs)
    finished = [r for r in results if r["finish_reason"] == "stop"]
    assert len(finished) >= len(jobs) // 3
    for r in finished:
        if not r.get("warnings"):
            assert r["valid"] is True, (r["id"], r["text"])
        schema = dict(schemas)[r["id"]]
        assert r["valid"] == jsonschema.validators.validator_for(schema)(schema).is_valid(
            r["json"]
        )


def test_choices_match_exactly_one_choice(compiler: GrammarCompiler, lm: LoadedModel) -> None:
    # One terminal for all choices (linear to compile): quotes, escapes, non-ASCII, an
    # empty choice and choices that are prefixes of others must all still work.
    choices = ['say "hi"\\n', "é ü 日本", "", "yes", "yesss"]
    compiled = compiler.compile(Constraint("choice", choices))

    def accepted(text: str) -> bool:
        m = GrammarController(compiled, fast_forward=False).matcher()
        tokens = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()

    assert all(accepted(c) for c in choices)
    assert not any(accepted(t) for t in ("ye", "yess", "no", 'say "hi"'))


def test_report_never_raises_on_odd_output_or_schema(compiler: GrammarCompiler) -> None:
    deep = GrammarController(compiler.compile(Constraint("json_schema", {})), True)
    assert deep.report("[" * 5000 + "]" * 5000)["valid"] is False
    dangling = {"if": {"type": "null"}, "then": {"$ref": "#/nope"}}
    report = GrammarController(compiler.compile(Constraint("json_schema", dangling)),
                               True).report("null")
    assert report["valid"] is False
    assert any("could not be validated" in w for w in report["warnings"])
