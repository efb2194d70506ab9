"""`if`/`then`/`else` held while decoding (conditionals.py).

On generated conditionals whose `if` tests properties against a constant or an enum
(with and without `required`) and whose branches set a `pattern`, an `enum`, a `const`,
`required` or a nested object's properties, the compiled grammar accepts exactly the
values the schema as written accepts (drawn values, written in the schema's property
order), and compiles with no relaxation. A conditional it cannot write exactly is
relaxed with a warning that names it.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aici_cli.control.grammar import GrammarCompiler
from aici_cli.control.grammar.conditionals import rewrite_conditionals
from aici_cli.core.constraint import Constraint
from aici_cli.models import LoadedModel

KINDS = ["US", "CA", "MX"]
DIGITS2 = {"type": "string", "pattern": "^[0-9]{2}$"}
LETTERS2 = {"type": "string", "pattern": "^[a-z]{2}$"}


@pytest.fixture(scope="module")
def compiler(lm: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))


@st.composite
def branch(draw: st.DrawFn) -> dict[str, Any]:
    """`then` or `else`: some of a pattern, an enum, a const, `required`, a nested
    object's property."""
    props: dict[str, Any] = {}
    if draw(st.booleans()):
        props["b"] = draw(st.sampled_from([DIGITS2, LETTERS2]))
    if draw(st.booleans()):
        props["c"] = draw(st.sampled_from([{"const": 1}, {"enum": [2, 3]}]))
    if draw(st.booleans()):
        props["d"] = {"properties": {"e": {"const": draw(st.sampled_from(["x", "y"]))}}}
    out: dict[str, Any] = {"properties": props} if props else {}
    if draw(st.booleans()):
        out["required"] = draw(st.lists(st.sampled_from("bcd"), min_size=1, unique=True))
    return out


@st.composite
def conditionals(draw: st.DrawFn) -> dict[str, Any]:
    a = ({"type": "string", "enum": KINDS} if draw(st.booleans())
         else {"type": "string", "maxLength": 3})
    test = draw(st.sampled_from([{"const": "US"}, {"enum": ["US", "MX"]}]))
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"a": a, "b": {"type": "string", "maxLength": 2},
                       "c": {"type": "integer", "minimum": 0, "maximum": 4},
                       "d": {"type": "object", "properties": {
                           "e": {"type": "string", "maxLength": 1}}}},
        "if": {"properties": {"a": test}, **({"required": ["a"]} if draw(st.booleans())
                                            else {})},
    }
    if draw(st.booleans()):
        schema["required"] = ["a"]
    for word in draw(st.sampled_from([["then"], ["else"], ["then", "else"]])):
        schema[word] = draw(branch())
    return schema


@st.composite
def values(draw: st.DrawFn) -> dict[str, Any]:
    """Objects of the keys above in the schema's order, each present or not."""
    pool = {"a": st.sampled_from([*KINDS, "", "U", "USA", "M"]),
            "b": st.sampled_from(["12", "ab", "1", "", "a1"]),
            "c": st.integers(0, 4),
            "d": st.fixed_dictionaries({}, optional={"e": st.sampled_from(["x", "y", "z"])})}
    return {k: draw(v) for k, v in pool.items() if draw(st.booleans())}


def accepts(compiler: GrammarCompiler, lm: LoadedModel, compiled: Any, text: str) -> bool:
    m = compiled.template.deep_copy()
    tokens = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    return m.validate_tokens(tokens) == len(tokens) and (
        m.consume_tokens(tokens) and m.is_accepting())


@settings(max_examples=80, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=conditionals(), drawn=st.lists(values(), min_size=8, max_size=8))
def test_the_grammar_accepts_what_the_conditional_accepts(
        lm: LoadedModel, compiler: GrammarCompiler, schema: dict[str, Any],
        drawn: list[dict[str, Any]]) -> None:
    compiled = compiler.compile(Constraint("json_schema", schema))
    assert not compiled.warnings, compiled.warnings  # held, not relaxed
    validator = jsonschema.Draft202012Validator(schema)
    for value in drawn:
        text = json.dumps(value)
        assert accepts(compiler, lm, compiled, text) == validator.is_valid(value), (
            schema, text)


def test_the_held_out_case_is_held(lm: LoadedModel, compiler: GrammarCompiler) -> None:
    """A country's postal code: five digits in the US, a Canadian code elsewhere."""
    schema = {"type": "object", "properties": {
        "country": {"type": "string"}, "postal": {"type": "string"}},
        "required": ["country", "postal"],
        "if": {"properties": {"country": {"const": "US"}}},
        "then": {"properties": {"postal": {"pattern": "^[0-9]{5}$"}}},
        "else": {"properties": {"postal": {"pattern": "^[A-Z][0-9][A-Z] [0-9][A-Z][0-9]$"}}}}
    compiled = compiler.compile(Constraint("json_schema", schema))
    assert not compiled.warnings
    for text, ok in (('{"country": "CA", "postal": "*"}', False),
                     ('{"country": "CA", "postal": "K1A 0B1"}', True),
                     ('{"country": "US", "postal": "K1A 0B1"}', False),
                     ('{"country": "US", "postal": "20500"}', True),
                     ('{"country": "USA", "postal": "20500"}', False)):
        assert accepts(compiler, lm, compiled, text) is ok, text


def test_a_conditional_it_cannot_write_exactly_is_named(lm: LoadedModel,
                                                        compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}},
              "if": {"properties": {"a": {"pattern": "^x"}}},
              "then": {"required": ["a"]}}
    assert rewrite_conditionals(schema)[0] == schema
    warnings = compiler.compile(Constraint("json_schema", schema)).warnings
    assert warnings[0] == "schema relaxed: unsupported keywords not enforced"
    assert warnings[1].startswith("if/then/else at / not enforced while decoding (its test "
                                  "of 'a'"), warnings
