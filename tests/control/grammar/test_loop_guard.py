"""The loop guard's detector (`loops.find_loop`) and the grammar controller that uses it.

Properties, on generated inputs:
- the fast detector agrees with the definition (a unit of p <= MAX_PERIOD characters
  repeated over at least `min_span(p)` characters at the end), computed by brute force;
- every kind of loop a small model writes (digit runs with no token-aligned period,
  whitespace runs, a growing key, repeated list items and key/value pairs) is caught,
  whatever JSON comes before it;
- a controller fed a looping output closes the value at once, validly, and one fed a
  value that does not loop never closes it;
- a line ends whole at its budget whatever its closer finds near where it stands
  (an earlier value boundary, or the output's start), and tokens an undo took back do
  not count against `max_tokens`.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aici_cli.control.base import Directive
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.grammar.closing import Closer, json_state
from aici_cli.control.grammar.early_close import Closing
from aici_cli.control.grammar.hints import NO_HINTS, Hints
from aici_cli.control.grammar.loops import MAX_PERIOD, find_loop, min_span
from aici_cli.core.constraint import Constraint
from aici_cli.models import LoadedModel

PROPS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


def loops_by_definition(text: str) -> bool:
    """Brute force: some period p has text[-s:] == text[-s-p:-p] for s = span - p."""
    for p in range(1, MAX_PERIOD + 1):
        s = 0
        while s < len(text) - p and text[len(text) - 1 - s] == text[len(text) - 1 - s - p]:
            s += 1
        if s > 0 and s + p >= min_span(p):
            return True
    return False


@PROPS
@given(st.text(alphabet="ab, 0\"", max_size=120))
def test_the_detector_agrees_with_the_definition(text: str) -> None:
    assert (find_loop(text) is not None) == loops_by_definition(text)


@PROPS
@given(st.lists(st.sampled_from(["ab", "a", "b", "ab, ", "x"]), max_size=60).map("".join))
def test_the_detector_agrees_with_the_definition_on_repetitive_text(text: str) -> None:
    assert (find_loop(text) is not None) == loops_by_definition(text)


# What comes before a loop: any JSON text.
PREFIXES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=6,
).map(lambda v: json.dumps({"data": v})[:-1] + ', "x": ')

UNITS = st.one_of(
    st.sampled_from(["1234567890", "0", "7", "01", "\u205f", " ", "\u3000", "_self",
                     ", dark", "1, ", "\"tautaue\", ", "2000000; ", "ab"]),
    st.text(alphabet="abcdefghij0123456789 ,:\"", min_size=1, max_size=40),  # any unit
    st.builds(lambda k, v: f'"{k}": {json.dumps(v)}, ', st.text("abcxyz", min_size=1,
                                                                 max_size=12),
              st.integers() | st.text(max_size=10)),  # a repeated key/value pair
)


@PROPS
@given(PREFIXES, UNITS, st.integers(0, 3))
def test_every_kind_of_loop_is_caught(prefix: str, unit: str, extra: int) -> None:
    times = -(-min_span(len(unit)) // len(unit)) + extra
    loop = find_loop(prefix + unit * times)
    assert loop is not None
    assert len(unit) % loop.period == 0  # the unit itself, or a smaller period within it


# ------------------------------------------------------------------ the controller

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "code": {"type": "string"}, "n": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "scores": {"type": "array", "items": {"type": "integer"}}},
    "required": ["name"]}


@pytest.fixture(scope="module")
def compiler(lm: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(lm.tokenizer, lm.vocab_size, lm.eos_token_ids)


def feed(lm: LoadedModel, compiler: GrammarCompiler, text: str,
         max_tokens: int = 10_000, closer: Closer | None = None,
         seen: list[Directive] | None = None,
         then: str | None = None) -> tuple[GrammarController, list[int]]:
    """A JSON-schema controller with closing on, fed `text`'s tokens one at a time as a
    model would sample them (until it stops); returns it and the output. `closer`: in
    place of the run's; `seen` collects every directive the controller answered; `then`:
    what the model writes instead once a loop of `text` was undone (without it, it
    stops there: the token it would write is barred)."""
    closer = closer or Closer(lm.tokenizer, compiler.tokenizer.decode_bytes)
    grammar = compiler.compile(Constraint("json_schema", SCHEMA))
    controller = GrammarController(grammar, closing=Closing(closer, max_tokens))
    decode = compiler.tokenizer.decode_bytes
    # The text's own tokens, by the byte offset each starts at: the model writes the next
    # one from wherever the output (with the grammar's forced tokens) has got to.
    starts: dict[int, int] = {}

    def aim(at: int, more: str) -> bytes:
        for t in lm.tokenizer(more, add_special_tokens=False)["input_ids"]:
            starts[at] = t
            at += len(decode([t]))
        return more.encode()

    target = aim(0, text)
    output: list[int] = []
    directive = controller.start([])
    output += directive.ff_tokens
    seen = seen if seen is not None else []
    seen.append(directive)
    undone = 0
    while not directive.stop:
        written = decode(output)
        if controller.stats().get("loops_undone", 0) > undone:  # the model goes another way
            undone += 1
            if then is None:
                break
            starts = {k: v for k, v in starts.items() if k < len(written)}
            target = written + aim(len(written), then)
        token = starts.get(len(written))
        if not target.startswith(written) or token is None:
            break  # done, or the grammar forced something else (its own completion)
        if not controller.valid_prefix([token]):
            break  # the grammar (or a bar) would not let the model write this token
        output.append(token)
        directive = controller.advance([token])
        seen.append(directive)
        if directive.backtrack:
            del output[len(output) - directive.backtrack :]
        output += directive.ff_tokens
    return controller, output


def loop_stats(controller: GrammarController) -> dict[str, Any]:
    """The controller's stats without `undone_tokens`, which counts tokens where a loop
    was undone, and only where the loop guard acted."""
    stats = dict(controller.stats())
    undone = stats.pop("undone_tokens", 0)
    acted = bool(stats.get("loops_undone")) or str(stats.get("close_reason", "")).startswith(
        "loop")
    assert undone >= 0 and (acted or not undone) and (undone or not stats.get("loops_undone"))
    return stats


# Text before a loop, its unit and how often it is written; what the model writes where
# its loop's first token is barred (a way on), and then to finish the value.
LOOPS = [
    ('{"name": "a", "code": "', "1234567890", 12, "x", '"}'),
    ('{"name": "', "\u205f", 60, "a", '"}'),
    ('{"name": "x", "n": 1', "0", 80, "5", "}"),
    ('{"name": "x", "tags": ["light"', ', "dark"', 30, 'er"', ']}'),
    ('{"name": "x", "scores": [', "1, ", 40, "2, ", "3]}"),
    ('{"name": "dereferenced_by', "_self", 20, "x", '"}'),
    ('{"name": "', "2000000; ", 12, "x", '"}'),
]


@pytest.mark.parametrize(("before", "unit", "times", "other", "end"), LOOPS)
def test_a_loop_is_undone_and_the_model_goes_another_way(
        lm: LoadedModel, compiler: GrammarCompiler, before: str, unit: str, times: int,
        other: str, end: str) -> None:
    """The first loop is taken back to its second unit and the token there barred: a
    model that writes something else there and ends the value ends it as it wrote it,
    not closed."""
    controller, output = feed(lm, compiler, before + unit * times, then=other + end)
    assert loop_stats(controller) == {"loops_undone": 1}
    written = lm.tokenizer.decode(output)
    assert written.startswith(before + unit[:1]) and written.endswith(other + end)
    assert find_loop(written) is None
    jsonschema.validate(json.loads(written), SCHEMA)


@pytest.mark.parametrize(("before", "unit", "times", "other", "end"), LOOPS)
def test_a_loop_after_an_undone_one_is_closed_from_where_it_began(
        lm: LoadedModel, compiler: GrammarCompiler, before: str, unit: str, times: int,
        other: str, end: str) -> None:
    """A model that loops again after the undo: the value is closed from where the second
    loop began (one unit of it kept), valid."""
    again = other + unit * times
    controller, output = feed(lm, compiler, before + unit * times, then=again)
    assert loop_stats(controller) == {"closed_early": True, "close_reason": "loop",
                                  "loops_undone": 1}
    written = lm.tokenizer.decode(output)
    jsonschema.validate(json.loads(written), SCHEMA)
    assert find_loop(written) is None
    # Closed from the loop's start: at most its first unit, the way on and a second unit
    # kept after the text before it, and a short completion.
    assert written.startswith(before) and other in written
    assert len(written) <= len(before) + 3 * len(unit) + len(other) + 12, written


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries(
    {"name": st.text(alphabet="abcdefgh XYZ.-", max_size=40)},
    optional={"n": st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: round(x, 3)),
              "tags": st.lists(st.sampled_from(["red", "green", "blue", "amber"]),
                               max_size=3, unique=True),
              "scores": st.lists(st.integers(-999, 999), max_size=4, unique=True)}))
def test_a_value_that_does_not_loop_is_never_closed(lm: LoadedModel,
                                                    compiler: GrammarCompiler,
                                                    value: dict[str, Any]) -> None:
    order = list(SCHEMA["properties"])  # the grammar keeps the schema's property order
    value = dict(sorted(value.items(), key=lambda kv: order.index(kv[0])))
    text = json.dumps(value)
    if loops_by_definition(text):
        return  # hypothesis wrote a loop itself ("aaaa..."): not this property's case
    controller, output = feed(lm, compiler, text)
    assert loop_stats(controller) == {}
    assert json.loads(lm.tokenizer.decode(output)) == value


# ------------------------------------------------------------------ loops nothing closes


class NoCompletion(Closer):
    """A closer that finds no completion from anywhere (as on some real schemas)."""

    def completion(self, matcher: Any, text: str, limit: int,
                   hints: Hints = NO_HINTS) -> list[int] | None:
        return None


class NoCompletionInALoop(Closer):
    """A closer that finds completions until the output loops, and none after."""

    def completion(self, matcher: Any, text: str, limit: int,
                   hints: Hints = NO_HINTS) -> list[int] | None:
        return None if find_loop(text) else super().completion(matcher, text, limit, hints)


# Text before a loop, the loop's unit, and how often it is written; what the model writes
# after the loop is undone, before it loops again.
CUTS = [
    ('{"name": "a", "code": "', "1234567890", 12, "x"),
    ('{"name": "white', ", dark", 20, "er"),
    ('{"name": "x", "tags": ["light"', ', "dark"', 30, 'er"'),
    ('{"name": "', "\u205f", 60, "a"),
    ('{"name": "x", "scores": [', "1, ", 40, "2, "),
    ('{"name": "v', ", 1.0.0.0.0.12345678.0.0", 8, "x"),
]


def ended_at_the_loop(lm: LoadedModel, compiler: GrammarCompiler, before: str, looping: str,
                      other: str | None, max_tokens: int = 10_000) -> str:
    """Feed `before + looping` (and, once it was undone, `other + looping`) with a closer
    that never completes: the line must end as cut at the (second) loop's start (a
    "length" stop, close_reason loop_unclosable). Returns the output's text."""
    seen: list[Directive] = []
    controller, output = feed(lm, compiler, before + looping, max_tokens,
                              NoCompletion(lm.tokenizer, compiler.tokenizer.decode_bytes),
                              seen, then=None if other is None else other + looping)
    stats = loop_stats(controller)
    assert stats == {"closed_early": True, "close_reason": "loop_unclosable",
                     "loops_undone": 1}
    last = seen[-1]
    assert last.stop and last.finish == "length" and not last.ff_tokens
    assert all(d.finish == "stop" for d in seen[:-1])
    assert len(output) < max_tokens
    return str(lm.tokenizer.decode(output))


@pytest.mark.parametrize(("before", "unit", "times", "other"), CUTS)
def test_a_loop_nothing_closes_is_cut_where_it_begins(lm: LoadedModel,
                                                      compiler: GrammarCompiler,
                                                      before: str, unit: str,
                                                      times: int, other: str) -> None:
    written = ended_at_the_loop(lm, compiler, before, unit * times, other)
    assert written.startswith(before)  # the text before the loop, unchanged
    assert other[0] in written[len(before):]  # and the model's way on after the undo
    assert find_loop(written) is None  # and the loop gone
    # Cut at the token where the second loop begins.
    assert len(written) <= len(before) + 2 * len(unit) + len(other) + 8, (written, before)


@pytest.mark.parametrize(("before", "unit", "times", "other"), CUTS)
def test_a_loop_is_closed_from_where_it_began_not_from_where_it_is(
        lm: LoadedModel, compiler: GrammarCompiler, before: str, unit: str,
        times: int, other: str) -> None:
    """A closer that finds nothing where the text loops: the close comes from the loop's
    start."""
    closer = NoCompletionInALoop(lm.tokenizer, compiler.tokenizer.decode_bytes)
    seen: list[Directive] = []
    controller, output = feed(lm, compiler, before + unit * times, closer=closer, seen=seen,
                              then=other + unit * times)
    assert loop_stats(controller) == {"closed_early": True, "close_reason": "loop",
                                  "loops_undone": 1}
    assert seen[-1].stop and seen[-1].finish == "stop"
    written = lm.tokenizer.decode(output)
    jsonschema.validate(json.loads(written), SCHEMA)
    assert find_loop(written) is None
    assert written.startswith(before) and other in written


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.text(alphabet="abcdefgh XYZ.-", max_size=30), UNITS.filter(lambda u: "\"" not in
                                                                    u and "\\" not in u),
       st.booleans())
def test_with_no_completion_loops_end_early_and_the_rest_run_unchanged(
        lm: LoadedModel, compiler: GrammarCompiler, name: str, unit: str,
        loops: bool) -> None:
    """Whatever a string holds before it loops, a closer that never completes still
    ends a loop before the limit, the text before it unchanged; a value that does not
    loop runs as written (nothing to close it with)."""
    before = '{"name": "' + name
    if not loops:
        if loops_by_definition(before):
            return
        controller, output = feed(lm, compiler, before, closer=NoCompletion(
            lm.tokenizer, compiler.tokenizer.decode_bytes))
        assert loop_stats(controller) == {}
        assert lm.tokenizer.decode(output) == before
        return
    if loops_by_definition(before):
        return  # hypothesis wrote a loop already in the name
    times = -(-min_span(len(unit)) // len(unit)) + 2
    other = "Q" if unit[0] != "Q" else "R"
    written = ended_at_the_loop(lm, compiler, before, unit * times, other, max_tokens=4_000)
    assert written.startswith(before)
    assert find_loop(written) is None


# ------------------------------------------------------------------ ends at the budget


class OnlyBetweenMembers(Closer):
    """A closer that completes only from the output's start or right after a `{`, `[` or
    `,` (none inside a string or a loop, none after a value): as where the values'
    `pattern`s defeat it."""

    def completion(self, matcher: Any, text: str, limit: int,
                   hints: Hints = NO_HINTS) -> list[int] | None:
        if text and (json_state(text)[0] or find_loop(text) or not text.rstrip().endswith(
                ("{", "[", ","))):
            return None
        return super().completion(matcher, text, limit, hints)


@pytest.mark.parametrize(("before", "unit", "times", "other"), CUTS)
def test_a_loop_nothing_closes_near_is_closed_from_an_earlier_boundary(
        lm: LoadedModel, compiler: GrammarCompiler, before: str, unit: str,
        times: int, other: str) -> None:
    """Nothing completes where the second loop begins, nor where the output is: the value
    is closed from an earlier value boundary (or its start), whole, never cut inside a
    string."""
    closer = OnlyBetweenMembers(lm.tokenizer, compiler.tokenizer.decode_bytes)
    seen: list[Directive] = []
    controller, output = feed(lm, compiler, before + unit * times, closer=closer, seen=seen,
                              then=other + unit * times)
    assert loop_stats(controller) == {"closed_early": True, "close_reason": "loop",
                                  "loops_undone": 1}
    assert seen[-1].stop and seen[-1].finish == "stop"
    jsonschema.validate(json.loads(lm.tokenizer.decode(output)), SCHEMA)


@pytest.mark.parametrize("max_tokens", [12, 30, 57])
def test_a_line_that_lost_its_plan_still_closes_at_the_limit(
        lm: LoadedModel, compiler: GrammarCompiler, max_tokens: int) -> None:
    """A string written to the budget where no plan was ever made (no completion from
    inside it): the line closes whole within `max_tokens`, not cut in the string."""
    closer = OnlyBetweenMembers(lm.tokenizer, compiler.tokenizer.decode_bytes)
    words = " ".join(f"w{i}q{i * 7 % 13}" for i in range(80))  # no loop in it
    seen: list[Directive] = []
    controller, output = feed(lm, compiler, '{"name": "' + words, max_tokens, closer, seen)
    assert loop_stats(controller) == {"closed_early": True, "close_reason": "limit"}
    assert seen[-1].stop and seen[-1].finish == "stop"
    assert len(output) <= max_tokens
    jsonschema.validate(json.loads(lm.tokenizer.decode(output)), SCHEMA)


# The loops of LOOPS written inside a string: the model may write on in it after the undo.
IN_STRINGS = [case[:4] for case in LOOPS if json_state(case[0])[0]]


@pytest.mark.parametrize(("before", "unit", "times", "other"), IN_STRINGS)
def test_tokens_an_undo_took_back_do_not_count_against_max_tokens(
        lm: LoadedModel, compiler: GrammarCompiler, before: str, unit: str, times: int,
        other: str) -> None:
    """A loop is undone; the model then writes on (no loop) past the budget: the line is
    closed at the limit only once its kept tokens reach it."""
    max_tokens = 160
    words = " ".join(f"w{i}q{i * 7 % 13}" for i in range(160))
    seen: list[Directive] = []
    controller, output = feed(lm, compiler, before + unit * times, max_tokens, seen=seen,
                              then=other + words)
    assert loop_stats(controller) == {"closed_early": True, "close_reason": "limit",
                                  "loops_undone": 1}
    jsonschema.validate(json.loads(lm.tokenizer.decode(output)), SCHEMA)
    assert max_tokens - 8 <= len(output) <= max_tokens
    # Counted, the tokens taken back would have ended the line that much earlier.
    undone = controller.stats()["undone_tokens"]
    assert undone > 0 and len(output) > max_tokens - max(undone, 8)


@pytest.mark.parametrize("text", ["1.1" + "0" * 80, "-2" + "57" * 40, "3" * 90])
def test_a_whole_value_that_loops_on_ends_where_its_loop_began(
        lm: LoadedModel, compiler: GrammarCompiler, text: str) -> None:
    """A number is whole at any digit (the grammar accepts it), so it is never closed at
    the limit; its loop still ends it: at the loop's second unit, not at `max_tokens`."""
    closer = Closer(lm.tokenizer, compiler.tokenizer.decode_bytes)
    controller = GrammarController(compiler.compile(Constraint("json_schema",
                                                               {"type": "number"})),
                                   closing=Closing(closer, 512))
    output = list(controller.start([]).ff_tokens)
    directive = Directive()
    for token in lm.tokenizer(text, add_special_tokens=False)["input_ids"]:
        output.append(token)
        directive = controller.advance([token])
        del output[len(output) - directive.backtrack :]
        if directive.stop:
            break
    assert directive.stop and directive.finish == "stop"
    assert loop_stats(controller) == {"closed_early": True, "close_reason": "loop"}
    written = lm.tokenizer.decode(output)
    assert text.startswith(written) and len(written) <= 44, written
    assert isinstance(json.loads(written), (int, float))
