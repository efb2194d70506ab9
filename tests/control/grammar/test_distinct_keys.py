"""No key twice in one object (distinct_keys.py).

Properties, on generated schemas whose objects hold undeclared keys (`additionalProperties`,
`patternProperties`, with `minProperties`/`maxProperties`, at the root or nested): a "model"
that wants to write the same key again and again (one character a token) gets an output
with no key twice in any object, whether it stops or is closed at the limit; a stopped
or closed output validates. The bar bars exactly the tokens that finish a repeated key.
And the default model, asked for six members of an object of nulls, writes six keys.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aici_cli.cli.main import main
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.grammar.closing import Closer
from aici_cli.control.grammar.distinct_keys import DistinctKeys, TokenIndex, may_repeat_keys
from aici_cli.control.grammar.early_close import Closing
from aici_cli.core.constraint import Constraint
from aici_cli.models import LoadedModel

# Characters a value here is written with, each one token of the test tokenizer.
ALPHABET = '{}[]",: abcde0123456789'
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.fixture(scope="module")
def compiler(lm: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))


@pytest.fixture(scope="module")
def token_of(lm: LoadedModel) -> dict[str, int]:
    ids = {}
    for ch in ALPHABET:
        [token] = lm.tokenizer(ch, add_special_tokens=False)["input_ids"]
        ids[ch] = token
    return ids


def no_key_twice(text: str) -> Any:
    """`text` parsed; fails on any object with a key twice."""

    def distinct(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        assert len(set(keys)) == len(keys), f"a key twice in {text!r}"
        return dict(pairs)

    return json.loads(text, object_pairs_hook=distinct)


@st.composite
def open_objects(draw: st.DrawFn) -> dict[str, Any]:
    """An object of undeclared keys (under `additionalProperties` or a key pattern) with a
    least and a most count of members; at the root, or as a required property."""
    least = draw(st.integers(1, 4))
    obj: dict[str, Any] = {"type": "object", "minProperties": least}
    if draw(st.booleans()):
        obj["maxProperties"] = draw(st.integers(least, 5))
    if draw(st.booleans()):
        obj["additionalProperties"] = draw(st.sampled_from([DIGIT, {"type": "null"}]))
    else:
        obj["patternProperties"] = {"^[a-e]{1,3}$": DIGIT}
        obj["additionalProperties"] = False
    if draw(st.booleans()):
        return obj
    return {"type": "object", "properties": {"x": obj}, "required": ["x"],
            "additionalProperties": False}


def wanted_text(keys: list[str], digits: list[int], nested: bool) -> str:
    """An object written with `keys` in order (repeats and all), a digit each."""
    body = "{" + ", ".join(f'"{k}": {d}' for k, d in zip(keys, digits)) + "}"
    return '{"x": ' + body + "}" if nested else body


class Wants:
    """Writes `target` while the output follows it, else the first character of
    `ranking` the mask allows; one character a token."""

    def __init__(self, token_of: dict[str, int], target: str, ranking: str) -> None:
        self.token_of, self.target, self.ranking = token_of, target, ranking

    def pick(self, controller: GrammarController, vocab: int, text: str) -> int | None:
        m = controller.matcher()
        if m is not None:
            raw = m.compute_bitmask()
        else:  # a token is barred here: the row's own mask
            out = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
            assert controller.fill_mask(out) is True
            raw = out.numpy().tobytes()
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
        wanted = ([self.target[len(text)]]
                  if self.target.startswith(text) and len(text) < len(self.target) else [])
        for ch in [*wanted, *self.ranking]:
            if bits[self.token_of[ch]]:
                return self.token_of[ch]
        allowed = np.flatnonzero(bits[:vocab])
        return int(allowed[0]) if allowed.size else None


def run(controller: GrammarController, wants: Wants, decode: Any, vocab: int,
        max_tokens: int) -> str | None:
    """The output's text, or None where the engine would cut it at `max_tokens`."""
    output: list[int] = []
    directive = controller.start([])
    output += directive.ff_tokens
    while not directive.stop:
        if len(output) >= max_tokens:
            return None
        token = wants.pick(controller, vocab, decode(output).decode())
        assert token is not None
        output.append(token)
        directive = controller.advance([token])
        if directive.backtrack:
            del output[len(output) - directive.backtrack :]
        output += directive.ff_tokens
    return str(decode(output).decode())


def test_an_object_with_undeclared_keys_gets_the_bar(compiler: GrammarCompiler) -> None:
    assert may_repeat_keys({"type": "object", "additionalProperties": {"type": "null"}})
    assert may_repeat_keys({"type": "object", "properties": {"a": {}},
                            "additionalProperties": False})  # `a` may be any object
    assert may_repeat_keys({"patternProperties": {"^a": {}}, "additionalProperties": False})
    closed = {"type": "object", "properties": {"a": {"type": "string"}},
              "additionalProperties": False}
    assert not may_repeat_keys(closed)
    assert compiler.compile(Constraint("json_schema", closed)).key_index is None


def test_the_bar_is_exactly_the_tokens_that_finish_a_repeated_key(
        lm: LoadedModel, compiler: GrammarCompiler) -> None:
    decode = compiler.tokenizer.decode_bytes
    index = TokenIndex(decode, lm.vocab_size)
    keys = DistinctKeys(index, decode)
    written = '{"ab": 1, "b": 2, "a'
    keys.consumed(lm.tokenizer(written, add_special_tokens=False)["input_ids"])
    barred = keys.barred()
    # In the key `"a…`: a token that closes it as `a` may follow (`a` is new), one that
    # writes `b"` (ending it `ab`) may not.
    for t in range(lm.vocab_size):
        data = decode([t])
        assert (t in barred) == data.startswith(b'b"'), data
    keys.consumed(lm.tokenizer('b2": 3, ', add_special_tokens=False)["input_ids"])
    assert {decode([t]) for t in keys.barred()} <= {
        b'"' + k + b'"' + rest for k in (b"ab", b"b", b"ab2") for rest in (b"", b":", b": ")}


def test_without_the_bar_the_key_is_written_again(lm: LoadedModel,
                                                  compiler: GrammarCompiler,
                                                  token_of: dict[str, int]) -> None:
    """The held-out case in small: `minProperties` over `additionalProperties`, a model
    that wants one key again and again. llguidance alone lets it; the bar does not."""
    schema = {"type": "object", "additionalProperties": DIGIT, "minProperties": 3}
    compiled = compiler.compile(Constraint("json_schema", schema))
    target = '{"a": 1, "a": 2, "a": 3, "a": 4}'
    decode = compiler.tokenizer.decode_bytes
    bare = dataclasses.replace(compiled, key_index=None,
                               hints=dataclasses.replace(compiled.hints, distinct_keys=None))
    # llguidance counts members (without the keyword guard, which would ask for more).
    text = run(GrammarController(bare, keywords=False), Wants(token_of, target, "a" + ALPHABET),
               decode, lm.vocab_size, 400)
    assert text == target
    # Barred its quote, this model writes `a` again and again: the loop guard ends that.
    closing = Closing(Closer(lm.tokenizer, decode), 60)
    text = run(GrammarController(compiled, closing=closing),
               Wants(token_of, target, "a" + ALPHABET), decode, lm.vocab_size, 60)
    assert text is not None and len(no_key_twice(text)) >= 3
    jsonschema.validate(json.loads(text), schema)


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(schema=open_objects(), keys=st.lists(st.sampled_from(["a", "ab", "b"]), min_size=2,
                                            max_size=6),
       digits=st.lists(st.integers(0, 9), min_size=6, max_size=6),
       ranking=st.permutations(ALPHABET).map("".join), max_tokens=st.integers(24, 90))
def test_no_key_is_written_twice(lm: LoadedModel, compiler: GrammarCompiler,
                                 token_of: dict[str, int], schema: dict[str, Any],
                                 keys: list[str], digits: list[int], ranking: str,
                                 max_tokens: int) -> None:
    nested = "x" in schema.get("properties", {})
    compiled = compiler.compile(Constraint("json_schema", schema))
    assert compiled.key_index is not None
    closer = Closer(lm.tokenizer, compiler.tokenizer.decode_bytes)
    controller = GrammarController(compiled, closing=Closing(closer, max_tokens))
    wants = Wants(token_of, wanted_text(keys, digits, nested), ranking)
    text = run(controller, wants, compiler.tokenizer.decode_bytes, lm.vocab_size,
               max_tokens)
    if text is None:  # the value's first completion does not fit: no close can help
        assert max_tokens < 40
        return
    value = no_key_twice(text)
    if controller.stats().get("close_reason") != "loop_unclosable":
        jsonschema.validate(value, schema)
        assert controller.report(text)["valid"] is True


@pytest.mark.real_model
def test_the_default_model_writes_distinct_keys(tmp_path: Path) -> None:
    """The held-out case: an object of nulls with `minProperties: 6`, once written as
    one key six times."""
    schema = {"type": "object", "properties": {"data": {
        "type": "object", "additionalProperties": {"type": "null"}, "minProperties": 6}},
        "required": ["data"]}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = ["Give the ids as JSON.", "Write id: null six times as JSON.",
               "A map of user ids to nothing, in JSON."]
    src.write_text("".join(json.dumps({"id": str(i), "prompt": p, "json_schema": schema,
                                       "max_tokens": 200}) + "\n"
                           for i, p in enumerate(prompts)))
    res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    for result in (json.loads(x) for x in out.read_text().splitlines()):
        value = no_key_twice(result["text"])
        assert len(value["data"]) >= 6, result["text"]
        assert result["valid"] is True, result
