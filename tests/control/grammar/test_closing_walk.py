"""The closer's completion walk finds a way to finish wherever the schema's strings want
particular characters (a `pattern`, a `format`, a `minLength`), its objects want a key
further on (`required`), or the first way it finds is one the grammar allows but the
schema does not (an exclusive `oneOf`, `minProperties`): loops inside such strings end
closed and valid, and values that do not loop are left alone.

The walk runs on the default model's tokenizer (what a run uses); no model runs.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from paths import DATA as TEST_DATA
from paths import JSONSCHEMABENCH

from aici_cli.control.grammar.closing import Closer
from aici_cli.control.grammar.compiler import CompiledGrammar, GrammarCompiler
from aici_cli.control.grammar.early_close import MARGIN, UNCLOSABLE, Closing, EarlyClose
from aici_cli.control.grammar.hints import hints_for, shortest_match
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import GrammarError

pytestmark = pytest.mark.real_model  # the default model's tokenizer

DATA = JSONSCHEMABENCH


class Walker:
    """The default model's tokenizer, a grammar compiler and a closer on it."""

    def __init__(self) -> None:
        from aici_cli.models.sources.resolve import resolve_model
        from aici_cli.models.tokenizer.fast_tokenizer import read_hub_tokenizer

        self.tok = read_hub_tokenizer(resolve_model(None))
        self.compiler = GrammarCompiler(self.tok, len(self.tok), [self.tok.eos_token_id])
        self.closer = Closer(self.tok, self.compiler.tokenizer.decode_bytes)

    def compile(self, schema: dict[str, Any]) -> CompiledGrammar:
        return self.compiler.compile(Constraint("json_schema", schema))

    def written(self, grammar: CompiledGrammar, text: str) -> tuple[Any, list[int]] | None:
        """A matcher that has consumed `text` (None where the grammar refuses it)."""
        m = grammar.template.deep_copy()
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        if m.try_consume_tokens(ids) != len(ids) or m.is_error():
            return None
        return m, ids

    def early(self, grammar: CompiledGrammar, max_tokens: int = 512) -> EarlyClose:
        from aici_cli.control.grammar.controller import _accepts

        # No loop undone first: a loop here is one the model wrote again, to be closed.
        return EarlyClose(Closing(self.closer, max_tokens, undo_loops=0), grammar.hints,
                          _accepts(grammar.validator))


@pytest.fixture(scope="module")
def walker() -> Walker:
    return Walker()


# -- shortest samples of patterns --------------------------------------------------------

_ATOMS = st.sampled_from([r"a", r"\d", r"\w", r"[a-z]", r"[0-9A-F]", r"\.", r"-", r"[^@\s]",
                          r"/", r":", r"(?:x|yz)", r"[A-Za-z0-9_-]"])
_QUANT = st.sampled_from(["", "+", "*", "?", "{2}", "{3,5}", "{1,}"])


@st.composite
def patterns(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.tuples(_ATOMS, _QUANT), min_size=1, max_size=6))
    body = "".join(a + q for a, q in parts)
    if draw(st.booleans()):
        body = f"({body})|{draw(_ATOMS)}"
    return f"^{body}$" if draw(st.booleans()) else body


@settings(max_examples=200, deadline=None)
@given(patterns())
def test_a_pattern_s_sample_matches_it(pattern: str) -> None:
    sample = shortest_match(pattern)
    assert sample is not None
    assert re.fullmatch(pattern, sample), (pattern, sample)


def test_samples_of_the_data_s_patterns_match_them() -> None:
    if not DATA.is_dir():
        pytest.skip("JSONSchemaBench data not present")
    found = 0
    for path in sorted(DATA.glob("*/*.json"))[::7]:
        for pattern in re.findall(r'"pattern": ("(?:[^"\\]|\\.)*")', path.read_text()):
            pattern = json.loads(pattern)
            sample = shortest_match(pattern)
            try:
                compiled = re.compile(pattern)
            except re.error:
                continue
            if sample is not None:
                found += 1
                assert compiled.search(sample), (path.name, pattern, sample)
    assert found >= 50


def test_hints_hold_formats_and_required_keys_in_order() -> None:
    schema = {"type": "object", "required": ["b", "a"],
              "properties": {"a": {"type": "string", "format": "date"},
                             "b": {"$ref": "#/$defs/v"}},
              "$defs": {"v": {"type": "string", "pattern": r"^v\d+\.\d+$"}}}
    hints = hints_for(schema)
    assert hints.keys == ("b", "a")
    assert set(hints.strings) == {"2000-01-01", "v0.0"}


# -- the walk on the shapes that gave no completion --------------------------------------

VERSION = {"type": "object", "required": ["name", "version", "vendor"],
           "properties": {"name": {"type": "string"},
                          "version": {"type": "string", "pattern": r"\d+\.\d+\.\d+-?.*"},
                          "vendor": {"type": "string"}}}
IGLU = {"type": "object", "required": ["schema", "data"],
        "properties": {"schema": {"type": "string", "pattern":
                                  r"^iglu:[a-zA-Z0-9-_.]+/[a-zA-Z0-9-_]+/[a-zA-Z0-9-_]+/"
                                  r"[0-9]+-[0-9]+-[0-9]+$"},
                       "data": {}}}
MANY_OPTIONAL = {"type": "object", "required": ["zz"],
                 "properties": {**{f"k{i:03d}": {"type": "string"} for i in range(150)},
                                "zz": {"type": "string"}}}


@pytest.mark.parametrize(("schema", "text"), [
    (VERSION, '{"name": "x", "version": "dark, dark, dark, dark'),
    (VERSION, '{"name": "x", "version": "'),
    (IGLU, '{"schema": "iglu:com.acme'),
    (IGLU, '{"schema": "iglu:com.acme/x/'),
    (MANY_OPTIONAL, '{"k000": "'),
])
def test_the_walk_finishes_strings_and_objects_a_token_list_cannot(
        walker: Walker, schema: dict[str, Any], text: str) -> None:
    grammar = walker.compile(schema)
    written = walker.written(grammar, text)
    assert written is not None
    done = walker.closer.completion(written[0], text, 64, grammar.hints)
    assert done is not None
    value = json.loads(text + walker.tok.decode(done))
    jsonschema.validate(value, schema)


def test_without_its_hints_the_walk_gives_up_where_it_used_to(walker: Walker) -> None:
    """The shapes above are the ones the fixed token order alone never finished."""
    grammar = walker.compile(VERSION)
    text = '{"name": "x", "version": "dark, dark'
    written = walker.written(grammar, text)
    assert written is not None
    assert walker.closer.completion(written[0], text, 256) is None
    assert walker.closer.completion(written[0], text, 256, grammar.hints) is not None


def test_a_close_the_schema_rejects_takes_another_completion(walker: Walker) -> None:
    """`{}` closes the grammar of an exclusive `oneOf` of optional-property objects, but
    is valid under every branch; `minProperties` is not in the grammar at all."""
    for schema, text in [
        ({"type": "object", "required": ["s", "o"],
          "properties": {"s": {"type": "string"},
                         "o": {"oneOf": [
                             {"type": "object", "properties": {"a": {"type": "string"}},
                              "additionalProperties": False},
                             {"type": "object", "properties": {"b": {"type": "integer"}},
                              "additionalProperties": False}]}}},
         '{"s": "' + "la " * 30),
        ({"type": "object", "required": ["s", "m"],
          "properties": {"s": {"type": "string"},
                         "m": {"type": "object", "minProperties": 1,
                               "additionalProperties": {"type": "string"}}}},
         '{"s": "' + "la " * 30),
    ]:
        grammar = walker.compile(schema)
        written = walker.written(grammar, text)
        assert written is not None
        m, ids = written
        early = walker.early(grammar)
        early.consumed(ids)
        close = early.decide(m)
        assert close is not None and close.reason == "loop"
        jsonschema.validate(json.loads(early.text()), schema)


# -- generated schemas: strings with constraints, neighbours, reached through $ref -------

STRING_RULES = [
    {"pattern": r"^[\w\/\.:-]+$"}, {"pattern": r"\d+\.\d+\.\d+-?.*"},
    {"pattern": r"^[0-9a-fA-F]{24}$"}, {"pattern": r"^([a-z])([a-z0-9-])*$"},
    {"pattern": r"^v[0-9]+(\.[0-9]+){2}$"}, {"minLength": 1}, {"minLength": 12},
    {"format": "date-time"}, {"format": "email"}, {"format": "uuid"}, {"format": "date"},
]
NEIGHBOURS = [
    {"type": "string", "enum": ["light", "dark"]}, {"type": "integer", "minimum": 1},
    {"type": "string", "format": "date"}, {"type": "string", "pattern": r"^[A-Z]{3}$"},
    {"type": "boolean"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
    {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
]
# What a small model repeats inside a string (the shapes among them).
UNITS = ["1234567890", "dark, ", "0.", "showTemplate:true,", "ab", "x-", "12345678.0.0.",
         "theme", "a1b2c3d4e5f6"]
DRAFTS = [("http://json-schema.org/draft-04/schema#", "definitions", "id"),
          ("https://json-schema.org/draft/2020-12/schema", "$defs", "$id")]


@st.composite
def looping_schemas(draw: st.DrawFn) -> tuple[dict[str, Any], str, list[str]]:
    """A schema whose `item` (through `$ref`) has a constrained string first and required
    neighbours after it; the text of an output that reached that string; the units a
    loop inside it may repeat, in the order to try them."""
    uri, defs, id_key = draw(st.sampled_from(DRAFTS))
    rule = draw(st.sampled_from(STRING_RULES))
    neighbours = draw(st.lists(st.sampled_from(range(len(NEIGHBOURS))), max_size=3,
                               unique=True))
    props: dict[str, Any] = {"target": {"type": "string", **rule}}
    for i in neighbours:
        props[f"n{i}"] = NEIGHBOURS[i]
    item = {"type": "object", "properties": props, "required": list(props)}
    schema: dict[str, Any] = {"$schema": uri, id_key: "https://example.com/s.json",
                              "type": "object", defs: {"Item": item},
                              "properties": {"item": {"$ref": f"#/{defs}/Item"}},
                              "required": ["item"]}
    if draw(st.booleans()):  # a required sibling after the object
        schema["properties"]["after"] = {"type": "string", "enum": ["a", "b"]}
        schema["required"].append("after")
    units = draw(st.permutations(UNITS))
    return schema, '{"item": {"target": "', units


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(looping_schemas(), st.integers(4, 16))
def test_loops_in_generated_schemas_end_closed_and_valid(
        walker: Walker, case: tuple[dict[str, Any], str, list[str]], repeats: int) -> None:
    schema, head, units = case
    grammar = walker.compile(schema)
    for unit in units:  # the first unit the string's grammar takes, repeated
        text = head + unit * repeats
        written = walker.written(grammar, text)
        if written is not None and len(text) - len(head) >= 40:
            break
    else:
        assume(False)
    m, ids = written
    early = walker.early(grammar)
    early.consumed(ids)
    close = early.decide(m)
    assert close is not None, text
    assert close.reason == "loop", (close.reason, text)  # never UNCLOSABLE here
    assert close.reason != UNCLOSABLE
    jsonschema.validate(json.loads(early.text()), schema)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(looping_schemas(), st.sampled_from(["a", "dark", "1.2.3", "x-y", "2024"]))
def test_values_that_do_not_loop_are_left_alone(
        walker: Walker, case: tuple[dict[str, Any], str, list[str]], value: str) -> None:
    """A short value: no close, and the at-limit plan exists from there."""
    schema, head, _ = case
    grammar = walker.compile(schema)
    written = walker.written(grammar, head + value)
    assume(written is not None)
    assert written is not None
    m, ids = written
    early = walker.early(grammar)
    early.consumed(ids)
    assert early.decide(m) is None
    assert early.tokens == ids and early.reason is None
    done = walker.closer.completion(m, head + value, 256, grammar.hints)
    assert done is not None
    jsonschema.validate(json.loads(head + value + walker.tok.decode(done)), schema)


# -- the states real models reach ---------------------------------------------------------

# Where a loop began and where the limit cut a value, in runs of the default model and of
# Gemma 3 270M with the loop guard and closing off, on the `tune` half
# (bench/real_states.py).
REAL_STATES = TEST_DATA / "real_states.jsonl"


def test_the_states_real_models_reach_close_valid(walker: Walker) -> None:
    """From each recorded state a close at the limit finds a completion, and the value it
    closes is valid: the shapes random walks never drew (a key repeated inside its own
    value, a record nesting deeper each cycle) included."""
    rows = [json.loads(x) for x in REAL_STATES.read_text().splitlines()]
    assert len({r["model"] for r in rows}) >= 2
    assert {r["kind"] for r in rows} == {"loop", "limit"}
    for row in rows:
        try:
            grammar = walker.compile(row["schema"])
        except GrammarError:  # as the run compiled it
            grammar = walker.compiler.compile(Constraint("json_schema", row["schema"]),
                                              relax=True)
        written = walker.written(grammar, row["text"])
        assert written is not None, row["id"]
        m, ids = written
        if m.is_accepting():  # a whole value already (a number the model went on with)
            value = json.loads(row["text"])
            assert grammar.validator is None or grammar.validator.is_valid(value), row["id"]
            continue
        done = walker.closer.completion(m, row["text"], 256, grammar.hints)
        assert done is not None, (row["id"], row["text"][-200:])
        # The limit right past the completion: the close happens now.
        early = walker.early(grammar, len(ids) + len(done) + MARGIN)
        early.sampled = True
        early.consumed(ids)
        close = early.decide(m)
        assert close is not None and close.reason in ("limit", "loop"), row["id"]
        value = json.loads(early.text())
        assert grammar.validator is None or grammar.validator.is_valid(value), (
            row["id"], early.text()[-300:])
