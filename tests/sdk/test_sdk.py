"""The guest SDK in plain CPython: examples under the stub host, the step protocol, checks.

No build here (milliseconds per test); `test_build.py` runs the same code in a component.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import pytest
from aici_controller import (
    ALL,
    Action,
    Allow,
    Bitmask,
    Context,
    ControllerFailed,
    Deny,
    Generate,
    Host,
    Matching,
    Sample,
    Splice,
    Stop,
    TokenController,
    allow,
    backtrack,
    controller,
    deny,
    find_controller,
    fixed,
    gen,
    gen_json,
    log,
    not_matching,
    sample,
    set_output,
    splice_tokens,
    stop,
    tokens_matching,
)
from aici_controller.testing import StubHost, StubHostError
from sdk_examples import load_example


def has_lowercase(text: str) -> bool:
    return any("a" <= ch <= "z" for ch in text)


# --- the examples -------------------------------------------------------------------


def test_yes_no_runs_two_segments_and_sets_outputs() -> None:
    host = StubHost(respond=["no", "Grass is green, not blue.\n"])
    run = host.run(load_example("yes_no"), arg='{"question": "Is grass blue?"}', prompt="Q: ")
    assert run.error is None
    assert run.trace == [
        "fixed(' Answer: ')",
        "gen(choice=['yes', 'no'], max_tokens=256)",
        "fixed('\\nReason: ')",
        "gen(regex='[^\\\\n]{1,120}\\\\n', max_tokens=60)",
        "stop()",
    ]
    assert run.outputs == {"answer": "no", "reason": "Grass is green, not blue."}
    assert run.logs == ["question: Is grass blue?"]
    assert run.text == " Answer: no\nReason: Grass is green, not blue.\n"


def test_yes_no_default_answer_is_the_first_choice_and_arg_is_optional() -> None:
    def respond(segment: Generate) -> str:
        assert segment.grammar is not None
        return "yes" if segment.grammar.kind == "choice" else "Because.\n"

    run = StubHost(respond=respond).run(load_example("yes_no"))
    assert run.outputs == {"answer": "yes", "reason": "Because."}
    assert run.logs == []


def test_no_lowercase_samples_only_tokens_without_lowercase() -> None:
    host = StubHost(sampler=lambda allowed: allowed[len(allowed) // 2])
    run = host.run(load_example("no_lowercase"), arg='{"max_tokens": 5}')
    assert run.error is None
    assert run.trace == ["sample(not_matching('(?s).*[a-z].*'))"] * 5 + ["stop()"]
    assert len(run.tokens) == 5 and not has_lowercase(run.text)
    assert run.outputs == {"tokens": 5}


def test_no_lowercase_set_excludes_every_lowercase_token() -> None:
    host = StubHost()
    session = host.start(load_example("no_lowercase"))
    action = session.step(0, [])
    assert isinstance(action, Sample) and isinstance(action.tokens, Matching)
    allowed = host.allowed(action.tokens)
    texts = [host.token_text(t) for t in allowed]
    assert not any(has_lowercase(t) for t in texts)
    assert "A" in texts and "\n" in texts and host.eos_token() in allowed  # EOS decodes to ""
    assert len(allowed) == host.vocab_size() - 26


def test_no_lowercase_defaults_to_16_tokens_and_stops_at_eos() -> None:
    run = StubHost(sampler=lambda allowed: allowed[-1]).run(load_example("no_lowercase"))
    assert len(run.tokens) == 16 and isinstance(run.actions[-1], Stop)
    eos_first = StubHost(sampler=lambda allowed: allowed[0])  # id 0 is EOS
    run = eos_first.run(load_example("no_lowercase"))
    assert run.tokens == [0] and run.trace[-1] == "stop()" and run.outputs == {"tokens": 1}


def test_profile_chains_fixed_json_and_free_text() -> None:
    person = {"name": "Ada", "age": 36, "languages": ["en", "fr"]}
    host = StubHost(respond=[json.dumps(person), "Wrote the first program.\nIgnored."])
    run = host.run(load_example("profile"))
    assert run.error is None
    assert [type(a).__name__ for a in run.actions] == [
        "Splice",
        "Generate",
        "Splice",
        "Generate",
        "Stop",
    ]
    schema_segment, bio_segment = run.actions[1], run.actions[3]
    assert isinstance(schema_segment, Generate) and schema_segment.grammar is not None
    assert schema_segment.grammar.kind == "json-schema"
    assert json.loads(str(schema_segment.grammar.value))["required"] == [
        "name",
        "age",
        "languages",
    ]
    assert str(bio_segment) == "gen(max_tokens=40, stop=['\\n'])"
    assert run.outputs == {"profile": person, "name": "Ada", "bio": "Wrote the first program."}
    assert run.text.endswith("\nBio: Wrote the first program.\n")


def test_profile_bio_is_cut_at_max_tokens() -> None:
    host = StubHost(respond=['{"name": "A", "age": 1, "languages": []}', "abcdefgh\n"])
    run = host.run(load_example("profile"), arg='{"max_bio_tokens": 3}')
    assert run.outputs["bio"] == "abc"


def test_profile_reports_truncated_json_as_the_sequence_error() -> None:
    long_name = "x" * 200  # the JSON segment stops at max_tokens=120, mid-string
    host = StubHost(respond=[json.dumps({"name": long_name, "age": 1, "languages": []})])
    run = host.run(load_example("profile"))
    assert run.error is not None and run.error.startswith("ValueError: gen_json:")
    assert "max_tokens=120" in run.error
    assert run.trace[-1].startswith("gen(json_schema=")  # no action after the failure


def test_rewrite_backtracks_a_lowercase_word() -> None:
    run = StubHost(respond=["paris"]).run(load_example("rewrite"))
    assert run.trace == [
        "fixed('Name: ')",
        "gen(regex='[A-Za-z]{1,12}', max_tokens=8)",
        "backtrack(5, 'Paris')",
        "fixed('.\\n')",
        "stop()",
    ]
    assert run.outputs == {"word": "paris", "final": "Paris", "rewrote": True}
    assert run.text == "Name: Paris.\n"


def test_rewrite_keeps_a_capitalized_word() -> None:
    run = StubHost(respond=["Rome"]).run(load_example("rewrite"))
    assert "backtrack" not in " ".join(run.trace)
    assert run.outputs == {"word": "Rome", "final": "Rome", "rewrote": False}
    assert run.text == "Name: Rome.\n"


@pytest.mark.parametrize("name", ["yes_no", "no_lowercase", "profile", "rewrite", "vote"])
def test_every_example_defines_exactly_one_controller(name: str) -> None:
    assert find_controller(load_example(name)).name


# --- the step protocol --------------------------------------------------------------


def test_first_step_has_no_tokens_and_each_yield_receives_the_right_value() -> None:
    received: list[Any] = []

    @controller
    def probe(ctx: Context):  # type: ignore[no-untyped-def]
        received.append((yield sample(ALL)))
        received.append((yield gen(max_tokens=4)))
        received.append((yield gen(max_tokens=4)))
        received.append((yield fixed("ab")))
        received.append((list(ctx.tokens), ctx.last_backtrack, ctx.last_tokens))

    host = StubHost()
    a, b = host.tokenize("ab")
    session = host.start(probe)
    assert isinstance(session.step(0, []), Sample)
    assert isinstance(session.step(0, [a]), Generate)
    assert isinstance(session.step(0, [a, b], "seg-text"), Generate)
    assert session.step(0, [b]) == Splice(0, "ab", (a, b))  # no text: decoded tokens
    assert isinstance(session.step(0, [a, b]), Stop)  # the splice's echo
    assert received == [a, "seg-text", "b", None, ([a, a, b, b, a, b], 0, (a, b))]


def test_splice_echo_and_backtrack_update_context_tokens() -> None:
    seen: list[tuple[list[int], int]] = []

    @controller
    class Recorder(TokenController):
        def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
            seen.append((list(ctx.tokens), ctx.last_backtrack))
            if len(ctx.tokens) == 3 and not ctx.last_backtrack:
                return backtrack(1, "z")
            return sample(ALL)

    host = StubHost()
    session = host.start(Recorder)
    session.step(0, [])
    session.step(0, [1, 2, 3])
    assert session.step(1, [9]) == sample(ALL)
    assert seen == [([], 0), ([1, 2, 3], 0), ([1, 2, 9], 1)]


def test_generator_return_and_stop_end_the_sequence() -> None:
    @controller
    def short(ctx: Context):  # type: ignore[no-untyped-def]
        yield fixed("x")

    @controller
    def explicit(ctx: Context):  # type: ignore[no-untyped-def]
        yield stop()
        raise AssertionError("not resumed after stop()")

    host = StubHost()
    assert host.run(short).trace == ["fixed('x')", "stop()"]
    session = host.start(explicit)
    assert isinstance(session.step(0, []), Stop)
    assert session.finished and isinstance(session.step(0, []), Stop)


def test_user_errors_become_the_error_message_and_are_logged() -> None:
    @controller
    def failing(ctx: Context):  # type: ignore[no-untyped-def]
        yield fixed("a")
        raise KeyError("missing")

    host = StubHost()
    run = host.run(failing)
    assert run.error == "KeyError: 'missing'"
    assert run.trace == ["fixed('a')"]
    assert len(run.logs) == 1 and run.logs[0].startswith("controller error: KeyError: 'missing'")
    assert "test_sdk.py:" in run.logs[0] and "in failing" in run.logs[0]
    assert "_session.py" not in run.logs[0]  # SDK frames are left out


def test_a_failed_session_keeps_failing() -> None:
    @controller
    class Broken(TokenController):
        def start(self, ctx: Context) -> None:
            raise RuntimeError("bad start")

        def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
            return stop()

    session = StubHost().start(Broken)
    with pytest.raises(ControllerFailed, match="^RuntimeError: bad start$"):
        session.step(0, [])
    with pytest.raises(ControllerFailed, match="already failed: RuntimeError: bad start"):
        session.step(0, [])


def test_bad_arg_json_is_an_error_not_a_crash() -> None:
    run = StubHost().run(load_example("yes_no"), arg="{oops")
    assert run.error is not None and run.error.startswith(
        "ValueError: the controller arg is not JSON"
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("text", "yielded str 'text': expected an action"),
        (None, "yielded NoneType None: expected an action"),
        (gen_json({"type": "object"}), "use `x = yield from gen_json"),
    ],
)
def test_yielding_a_non_action_is_a_clear_error(value: Any, message: str) -> None:
    @controller
    def wrong(ctx: Context):  # type: ignore[no-untyped-def]
        yield value

    run = StubHost().run(wrong)
    assert run.error is not None and message in run.error


def test_token_controller_returning_none_is_a_clear_error() -> None:
    @controller
    class Forgetful(TokenController):
        def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
            return None  # type: ignore[return-value]

    run = StubHost().run(Forgetful)
    assert run.error == (
        "TypeError: Forgetful.step() returned NoneType None: expected an action "
        "(fixed(...), gen(...), sample(...), backtrack(...), fork(...) or stop())"
    )


def test_backtrack_past_the_generated_tokens_is_an_error() -> None:
    @controller
    def greedy(ctx: Context):  # type: ignore[no-untyped-def]
        yield fixed("ab")
        yield backtrack(3)

    run = StubHost().run(greedy)
    assert run.error == "ValueError: backtrack(3) removes more than the 2 tokens generated so far"


def test_per_token_controller_start_runs_once_and_steps_see_new_tokens() -> None:
    calls: list[Any] = []

    @controller
    class Counter(TokenController):
        def start(self, ctx: Context) -> None:
            calls.append(("start", ctx.arg, ctx.prompt))
            self.n = ctx.arg_json()["n"]

        def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
            calls.append(list(new_tokens))
            return stop() if len(ctx.tokens) >= self.n else sample(allow([7]))

    run = StubHost().run(Counter, arg='{"n": 2}', prompt=[4, 5])
    assert calls == [("start", '{"n": 2}', (4, 5)), [], [7], [7]]
    assert run.tokens == [7, 7] and run.trace == ["sample(allow([7]))"] * 2 + ["stop()"]


def test_token_sets_are_resolved_once_per_pattern() -> None:
    class CountingHost(StubHost):
        def __init__(self) -> None:
            super().__init__()
            self.patterns: list[str] = []

        def tokens_matching(self, pattern: str) -> int:
            self.patterns.append(pattern)
            return super().tokens_matching(pattern)

    @controller
    class Digits(TokenController):
        def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
            if len(ctx.tokens) == 4:
                return stop()
            return sample(tokens_matching("[0-9]") if len(ctx.tokens) % 2 else not_matching("."))

    host = CountingHost()
    run = host.run(Digits)
    assert host.patterns == [".", "[0-9]"]
    assert all(host.token_text(t).isdigit() for t in run.tokens[1::2])
    assert all(host.token_text(t) in ("", "\n") for t in run.tokens[0::2])  # EOS or newline


def test_module_level_log_and_set_output_need_a_running_controller() -> None:
    with pytest.raises(RuntimeError, match="no running controller"):
        log("x")
    with pytest.raises(RuntimeError, match="no running controller"):
        set_output("k", 1)


def test_outputs_are_json_and_non_serializable_values_are_errors() -> None:
    @controller
    def outputs(ctx: Context):  # type: ignore[no-untyped-def]
        set_output("n", 3)
        set_output("obj", {"a": [1, None]})
        ctx.set_output("via_ctx", "s")
        set_output("bad", object())
        yield stop()

    run = StubHost().run(outputs)
    assert run.outputs == {"n": 3, "obj": {"a": [1, None]}, "via_ctx": "s"}
    assert run.error is not None and "must be JSON-serializable" in run.error


def test_context_exposes_the_host_tokenizer() -> None:
    @controller
    def inspect_ctx(ctx: Context):  # type: ignore[no-untyped-def]
        yield fixed("hi")
        set_output("text", ctx.text())
        set_output("decoded", ctx.decode(ctx.tokenize("ok")))
        set_output("bytes", list(ctx.token_bytes(ctx.tokens[0])))
        set_output("eos", ctx.eos_token)
        set_output("vocab", ctx.vocab_size)
        set_output("at_eos", ctx.at_eos)

    host = StubHost()
    run = host.run(inspect_ctx)
    assert run.outputs == {
        "text": "hi",
        "decoded": "ok",
        "bytes": [ord("h")],
        "eos": 0,
        "vocab": host.vocab_size(),
        "at_eos": False,
    }


# --- @controller and find_controller ------------------------------------------------


def plain(ctx: Context) -> None:
    return None


async def asynchronous(ctx: Context) -> None:
    return None


def no_args():  # type: ignore[no-untyped-def]
    yield stop()


class NotToken:
    def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
        return stop()


class NoStep(TokenController):
    pass


class NeedsArgs(TokenController):
    def __init__(self, limit: int) -> None:
        self.limit = limit

    def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
        return stop()


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (plain, "'plain' is not a generator function: it must `yield` actions"),
        (asynchronous, "'asynchronous' is async"),
        (no_args, "must take one argument, the Context: def no_args(ctx)"),
        (NotToken, "class 'NotToken' must subclass aici_controller.TokenController"),
        (NoStep, "class 'NoStep' does not define step(self, ctx, new_tokens)"),
        (NeedsArgs, "'NeedsArgs' must be constructible without arguments"),
        (42, "@controller got int 42"),
        (None, "use @controller without parentheses"),
    ],
)
def test_controller_rejects_bad_targets_with_clear_messages(target: Any, message: str) -> None:
    with pytest.raises(TypeError) as info:
        controller(target)
    assert message in str(info.value)


def test_controller_rejects_double_decoration_and_stays_callable() -> None:
    @controller
    def once(ctx: Context):  # type: ignore[no-untyped-def]
        yield stop()

    with pytest.raises(TypeError, match="decorated with @controller twice"):
        controller(once)
    assert once.kind == "generator" and once.name.endswith("once")
    assert isinstance(next(once(None)), Stop)  # calling the spec calls the function


def _module(name: str, **values: Any) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(values)
    return module


def test_find_controller_wants_exactly_one_defined_in_the_module() -> None:
    spec = controller(_gen_fn)
    here = spec.module
    with pytest.raises(ValueError, match="does not define a controller: decorate a generator"):
        find_controller(_module(here))
    assert find_controller(_module(here, a=spec, alias=spec)) is spec  # an alias counts once
    with pytest.raises(ValueError, match="defines 2 controllers"):
        find_controller(_module(here, a=spec, b=controller(_other_gen_fn)))
    with pytest.raises(ValueError, match="does not define a controller"):
        find_controller(_module("elsewhere", imported=spec))  # imported ones do not count


def _gen_fn(ctx: Context):  # type: ignore[no-untyped-def]
    yield stop()


def _other_gen_fn(ctx: Context):  # type: ignore[no-untyped-def]
    yield stop()


# --- actions and token sets ---------------------------------------------------------


def test_token_set_helpers_and_complements() -> None:
    assert allow([1, 2]) == Allow((1, 2)) and ~allow([1, 2]) == Deny((1, 2))
    assert ~deny([3]) == allow([3])
    assert tokens_matching("[a-z]+") == Matching("[a-z]+")
    assert ~tokens_matching("[a-z]+") == not_matching("[a-z]+") == Matching("[a-z]+", True)
    assert ~~not_matching("x") == not_matching("x")
    assert str(not_matching("x")) == "not_matching('x')" and str(ALL) == "ALL"
    with pytest.raises(ValueError, match="complement of ALL is empty"):
        ~ALL  # noqa: B018
    with pytest.raises(ValueError, match="at least one token"):
        allow([])
    with pytest.raises(ValueError, match="invalid regex"):
        tokens_matching("[unclosed")
    with pytest.raises(ValueError, match="is not a token id"):
        deny([-1])
    with pytest.raises(TypeError, match="takes a token set"):
        sample([1, 2])  # type: ignore[arg-type]


def test_bitmask_sets_one_bit_per_token() -> None:
    mask = Bitmask.from_tokens([0, 33, 63], vocab_size=70)
    assert mask.words == (1, 2 | 1 << 31, 0)
    host = StubHost(vocab=[str(i) for i in range(70)], eos="0")
    assert host.allowed(mask) == [0, 33, 63]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Bitmask.from_tokens([70], vocab_size=70)


def test_gen_builds_segments_and_checks_its_arguments() -> None:
    segment = gen(json_schema={"type": "integer"}, max_tokens=5, stop="\n")
    assert segment.grammar is not None and segment.grammar.value == '{"type": "integer"}'
    assert segment.stop == ("\n",) and segment.max_tokens == 5
    assert gen().grammar is None and gen(choices=["a"]).grammar.value == ("a",)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="at most one grammar, got regex, choices"):
        gen(regex="a", choices=["a"])
    with pytest.raises(TypeError, match="list of strings"):
        gen(choices="ab")
    with pytest.raises(ValueError, match="nothing to choose from"):
        gen(choices=[])
    with pytest.raises(ValueError, match="must be at least 1"):
        gen(max_tokens=0)
    with pytest.raises(ValueError, match="the schema is not JSON"):
        gen(json_schema="{nope")
    with pytest.raises(TypeError, match="non-empty string"):
        gen(stop=[""])


def test_splice_builders() -> None:
    assert fixed("x") == Splice(0, "x") and str(fixed("x")) == "fixed('x')"
    assert backtrack(2) == Splice(2, "") and str(backtrack(2, "y")) == "backtrack(2, 'y')"
    assert splice_tokens(1, [5]) == Splice(1, "", (5,))
    assert str(splice_tokens(1, [5])) == "splice_tokens(1, [5])"
    with pytest.raises(ValueError, match="token count must be an int >= 0"):
        backtrack(-1)
    with pytest.raises(TypeError, match="fixed\\(\\) takes a str"):
        fixed(3)  # type: ignore[arg-type]


# --- the stub host ------------------------------------------------------------------


def test_stub_host_is_a_host_with_conveniences() -> None:
    host = StubHost()
    assert isinstance(host, Host)
    assert host.token_text(host.tokenize("Q")[0]) == "Q"
    host.set_output_value("k", [1])
    assert host.outputs == {"k": [1]}
    host.set_output("raw", "not json")
    assert host.outputs["raw"] == "not json"


def test_stub_host_word_vocab_and_tokenizer_like() -> None:
    words = StubHost(vocab=["<eos>", " ", "yes", "no", "y"], eos="<eos>")
    assert words.tokenize("yes no y") == [2, 1, 3, 1, 4]

    class Chars:
        def encode(self, text: str) -> list[int]:
            return [ord(c) - ord("a") + 1 for c in text]

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(i + ord("a") - 1) if i else "" for i in ids)

        def __len__(self) -> int:
            return 27

    host = StubHost(vocab=Chars(), eos=0)
    assert host.tokenize("abc") == [1, 2, 3] and host.decode([0, 1, 2]) == "ab"
    handle = host.tokens_matching("[xyz]")
    assert host.allowed(Matching("[xyz]", False, handle)) == [24, 25, 26]


def test_stub_host_reports_set_up_mistakes() -> None:
    with pytest.raises(StubHostError, match="cannot tokenize"):
        StubHost().tokenize("é")
    with pytest.raises(StubHostError, match="pass StubHost\\(respond=...\\)"):
        StubHost().run(load_example("rewrite"))
    with pytest.raises(StubHostError, match="does not match the segment's regex"):
        StubHost(respond=["two words"]).run(load_example("rewrite"))
    with pytest.raises(StubHostError, match="is not one of"):
        StubHost(respond=["maybe"]).run(load_example("yes_no"))

    @controller
    def forever(ctx: Context):  # type: ignore[no-untyped-def]
        while True:
            yield sample(ALL)

    with pytest.raises(StubHostError, match="did not stop within 50 steps"):
        StubHost().run(forever, max_steps=50)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        StubHost(vocab=["a"], eos="<eos>")
