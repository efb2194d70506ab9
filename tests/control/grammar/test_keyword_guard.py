"""The keyword guard: outputs held to the schema keywords the grammar cannot express
(`uniqueItems`, `minProperties`, `maxProperties`, `dependentRequired`, `not`, ...) by
barring the choice that broke one, a bounded number of times per line.

A scripted "model" writes one character a token: at each step the first character of its
ranking that the controller's mask allows (read from `matcher()`, or from `fill_mask`
where a token is barred), so what it wants to write (repeat an item, close an object at
once) is fixed, and only the guard can change it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from aici_cli.cli.main import main
from aici_cli.control import tool_calls
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.grammar.closing import Closer
from aici_cli.control.grammar.early_close import Closing
from aici_cli.control.grammar.keyword_guard import MAX_RETRIES
from aici_cli.core.constraint import Constraint
from aici_cli.formats.jobs import load_schema
from aici_cli.models import LoadedModel

LETTERS = "abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def compiler(lm: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))


class Script:
    """A model that writes, one character a token, the first character of `ranking` that
    the mask allows."""

    def __init__(self, lm: LoadedModel, compiler: GrammarCompiler, ranking: str) -> None:
        self.lm, self.compiler = lm, compiler
        self.ids = []
        for ch in ranking:
            [token] = lm.tokenizer(ch, add_special_tokens=False)["input_ids"]
            self.ids.append(token)
        self.used_fill_mask = 0

    def allowed(self, controller: GrammarController) -> np.ndarray:
        m = controller.matcher()
        if m is not None:
            raw = m.compute_bitmask()
        else:  # a token is barred here: the row's own mask
            self.used_fill_mask += 1
            out = torch.zeros((self.lm.vocab_size + 31) // 32, dtype=torch.int32)
            assert controller.fill_mask(out) is True
            raw = out.numpy().tobytes()
        return np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")

    def run(self, controller: GrammarController, steps: int = 400,
            until_barred: bool = False) -> str:
        """The output, once the controller stops (or, `until_barred`, once it bars)."""
        output: list[int] = []
        directive = controller.start([])
        output += directive.ff_tokens
        while not directive.stop and steps:
            if until_barred and controller.matcher() is None:
                return self.text(output)
            steps -= 1
            bits = self.allowed(controller)
            token = next((t for t in self.ids if bits[t]), None)
            assert token is not None, self.text(output)
            output.append(token)
            directive = controller.advance([token])
            if directive.backtrack:
                del output[len(output) - directive.backtrack :]
            output += directive.ff_tokens
        assert directive.stop, self.text(output)
        return self.text(output)

    def text(self, output: list[int]) -> str:
        return self.compiler.tokenizer.decode_bytes(output).decode()


def write(lm: LoadedModel, compiler: GrammarCompiler, schema: dict[str, Any],
          ranking: str, **kw: Any) -> tuple[GrammarController, Any, Script]:
    controller = GrammarController(compiler.compile(Constraint("json_schema", schema)), **kw)
    script = Script(lm, compiler, ranking)
    text = script.run(controller)
    return controller, json.loads(text), script


def valid(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


TAGS = {"type": "object", "properties": {"tags": {
    "type": "array", "items": {"type": "string", "pattern": "^[a-z]$"},
    "minItems": 3, "maxItems": 3, "uniqueItems": True}}, "required": ["tags"]}
# Repeats an item while it can (`a` first), adds items while it can (`,` before `]`).
REPEATS = '{", [' + LETTERS + ':]}'


def test_a_repeated_item_is_written_again_until_unique(lm: LoadedModel,
                                                      compiler: GrammarCompiler) -> None:
    unguarded, value, _ = write(lm, compiler, TAGS, REPEATS, keywords=False)
    assert value == {"tags": ["a", "a", "a"]} and not valid(TAGS, value)
    assert "keyword_retries" not in unguarded.stats()
    controller, value, script = write(lm, compiler, TAGS, REPEATS)
    # The second item: `a` barred once; the third: `a`, then `b` barred.
    assert value == {"tags": ["a", "b", "c"]} and valid(TAGS, value)
    assert controller.stats()["keyword_retries"] == 3
    assert controller.report(json.dumps(value))["valid"] is True
    assert script.used_fill_mask == 3  # one masked step per bar, the matcher otherwise


def test_retries_are_bounded_and_the_output_stays_honest(lm: LoadedModel,
                                                        compiler: GrammarCompiler) -> None:
    # Five items: the fourth takes three bars (a, b, c), the fifth runs out of them.
    schema = json.loads(json.dumps(TAGS))
    schema["properties"]["tags"].update(minItems=5, maxItems=5)
    controller, value, _ = write(lm, compiler, schema, REPEATS)
    assert controller.stats()["keyword_retries"] == MAX_RETRIES == 8
    assert value["tags"][:4] == ["a", "b", "c", "d"] and not valid(schema, value)
    assert controller.report(json.dumps(value, separators=(", ", ": ")))["valid"] is False


PROPS = {k: {"type": "integer"} for k in "abc"}
# minProperties under a conditional the grammar cannot hold: its `if` tests a bound, which
# conditionals.py cannot negate exactly, so the compile drops it and only the guard holds it.
AT_LEAST_TWO = {"type": "object", "properties": PROPS,
                "if": {"required": ["a"], "properties": {"a": {"minimum": 0}}},
                "then": {"minProperties": 2}}
# Writes `a`, then closes the object as soon as it may (`}` before `,` and digits).
CLOSES = '{"a}bc,1: '


def test_min_properties_makes_the_model_write_more_members(lm: LoadedModel,
                                                          compiler: GrammarCompiler) -> None:
    _, value, _ = write(lm, compiler, AT_LEAST_TWO, CLOSES, keywords=False)
    assert value == {"a": 1} and not valid(AT_LEAST_TWO, value)
    controller, value, _ = write(lm, compiler, AT_LEAST_TWO, CLOSES)
    assert value == {"a": 1, "b": 1} and valid(AT_LEAST_TWO, value)
    assert controller.stats()["keyword_retries"] == 1  # the `}` after `{"a": 1`


def test_max_properties_and_dependent_required(lm: LoadedModel,
                                               compiler: GrammarCompiler) -> None:
    # Writes members while it can (`,` before `}`): held to two.
    schema = {"type": "object", "properties": PROPS, "maxProperties": 2}
    _, value, _ = write(lm, compiler, schema, '{",abc}1: ', keywords=False)
    assert len(value) == 3
    controller, value, _ = write(lm, compiler, schema, '{",abc}1: ')
    assert value == {"a": 1, "b": 1} and controller.stats()["keyword_retries"] == 1
    # Writes `b` and closes: `b` needs `c`.
    needs = {"type": "object", "properties": PROPS, "dependentRequired": {"b": ["c"]}}
    controller, value, _ = write(lm, compiler, needs, '{"b}c,1: ')
    assert value == {"b": 1, "c": 1} and valid(needs, value)


def test_a_value_matching_not_is_chosen_again(lm: LoadedModel,
                                              compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"s": {
        "type": "string", "pattern": "^[a-z]$", "not": {"enum": ["a", "b"]}}},
        "required": ["s"]}
    controller, value, _ = write(lm, compiler, schema, '":, ' + LETTERS + "}")
    assert value == {"s": "c"} and controller.stats()["keyword_retries"] == 2


def test_a_fault_the_grammar_forces_is_left_as_written(lm: LoadedModel,
                                                      compiler: GrammarCompiler) -> None:
    # Every item is forced to be "x": no choice to bar, so nothing is barred or retried.
    schema = {"type": "array", "items": {"const": "x"}, "minItems": 2, "maxItems": 2,
              "uniqueItems": True}
    controller, value, _ = write(lm, compiler, schema, '"x, ]')
    assert value == ["x", "x"] and "keyword_retries" not in controller.stats()
    assert controller.report('["x", "x"]')["valid"] is False


def test_with_closing_on_the_plan_follows_a_retry(lm: LoadedModel,
                                                  compiler: GrammarCompiler) -> None:
    closing = Closing(Closer(lm.tokenizer, compiler.tokenizer.decode_bytes), 200)
    controller, value, _ = write(lm, compiler, TAGS, REPEATS, closing=closing)
    assert value == {"tags": ["a", "b", "c"]}
    early = controller._early
    assert early is not None and early.text() == json.dumps(value)


def test_no_guard_and_no_cost_without_such_keywords(lm: LoadedModel,
                                                    compiler: GrammarCompiler) -> None:
    schema = {"type": "array", "items": {"type": "string", "pattern": "^[a-z]$"},
              "minItems": 2, "maxItems": 2}
    compiled = compiler.compile(Constraint("json_schema", schema))
    assert compiled.keywords is None
    controller, value, script = write(lm, compiler, schema, '"a, ]')
    assert value == ["a", "a"] and controller._guard is None and script.used_fill_mask == 0


def test_a_barred_token_is_no_draft_and_is_masked(lm: LoadedModel,
                                                  compiler: GrammarCompiler) -> None:
    """Right after a retry the barred token is out of the mask `fill_mask` writes (the
    engine asks for it: `matcher()` is None) and of drafts; one token on, neither."""
    controller = GrammarController(compiler.compile(Constraint("json_schema", TAGS)))
    ids = {ch: lm.tokenizer(ch, add_special_tokens=False)["input_ids"][0] for ch in 'a"b'}
    written = Script(lm, compiler, REPEATS).run(controller, until_barred=True)
    assert written == '{"tags": ["a", "'  # the second `a` was taken back, and barred
    assert controller.matcher() is None and controller.valid_prefix([ids["a"]]) == 0
    out = torch.zeros((lm.vocab_size + 31) // 32, dtype=torch.int32)
    controller.fill_mask(out)
    bits = np.unpackbits(out.numpy().view(np.uint8), bitorder="little")
    assert not bits[ids["a"]] and bits[ids["b"]]
    controller.advance([ids["b"]])
    assert controller.matcher() is not None
    assert controller._guard is not None and not controller._guard.barred()


@pytest.mark.real_model
def test_the_default_model_writes_valid_output_through_the_cli(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string", "maxLength": 12},
                   "minItems": 4, "maxItems": 6, "uniqueItems": True},
        "sizes": {"type": "object", "additionalProperties": {"type": "integer"},
                  "minProperties": 3, "maxProperties": 4}},
        "required": ["colors", "sizes"], "additionalProperties": False}
    prompts = ["List the colors of a rainbow as JSON.", "Repeat the word red in JSON.",
               "Write shoe sizes as JSON."]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "prompt": p, "json_schema": schema,
                                       "max_tokens": 160}) + "\n"
                           for i, p in enumerate(prompts)))
    res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(results) == len(prompts)
    for result in results:
        jsonschema.validate(result, load_schema("result-line"))
        assert result["valid"] is True, result
        jsonschema.validate(result["json"], schema)
    # "Repeat the word red" repeats items: the guard barred some (5 on this model).
    assert sum(r["stats"].get("keyword_retries", 0) for r in results) > 0


# ------------------------------------------------------------------ tool calls

def calls(*tools: tuple[str, dict[str, Any]], parallel: bool = False) -> Constraint:
    return Constraint("tool_calls", {"tools": [{"name": n, "parameters": p} for n, p in tools],
                                     "text": False, "parallel": parallel})


def test_a_tool_call_s_arguments_are_held_to_its_tool_s_keywords(
        lm: LoadedModel, compiler: GrammarCompiler) -> None:
    """The same repeated items inside a call's `arguments`: held to the tool's
    `uniqueItems` as a JSON-schema line is; the text around the call is not checked."""
    constraint = calls(("tag", TAGS))
    unguarded = GrammarController(compiler.compile(constraint), keywords=False)
    text = Script(lm, compiler, REPEATS).run(unguarded)
    [call] = tool_calls.complete_calls(text)[0]
    assert json.loads(call.arguments) == {"tags": ["a", "a", "a"]}
    controller = GrammarController(compiler.compile(constraint))
    text = Script(lm, compiler, REPEATS).run(controller)
    [call] = tool_calls.complete_calls(text)[0]
    assert json.loads(call.arguments) == {"tags": ["a", "b", "c"]}
    assert controller.stats()["keyword_retries"] == 3
    assert controller.report(text)["valid"] is True


def test_each_call_is_held_to_the_tool_it_names(lm: LoadedModel,
                                                 compiler: GrammarCompiler) -> None:
    """Two tools with the same shape, one with `uniqueItems`: a call of the other keeps
    its repeats (its schema allows them); one of the first does not."""
    free = json.loads(json.dumps(TAGS))
    del free["properties"]["tags"]["uniqueItems"]
    constraint = calls(("free", free), ("tag", TAGS))
    for name, want in (("free", ["f", "f", "f"]), ("tag", ["t", "a", "b"])):
        # The name's first letter decides the tool, and is then the item it repeats.
        controller = GrammarController(compiler.compile(constraint))
        text = Script(lm, compiler, name[0] + REPEATS).run(controller)
        first = tool_calls.complete_calls(text)[0][0]
        assert first.name == name
        assert json.loads(first.arguments)["tags"] == want
        assert controller.report(text)["valid"] is True
