"""Run controllers in plain CPython, without a build: `StubHost` plays the host.

The stub runs the same `Session` code the component runs, against a tiny tokenizer, so a
controller's logic is unit-tested in milliseconds:

    run = StubHost(respond=["yes", "Because.\\n"]).run(yes_no, arg='{"question": "?"}')
    assert run.outputs == {"answer": "yes", "reason": "Because."}

What it simulates, and how it differs from the real host:
- tokens: greedy longest match over a vocabulary of strings (by default EOS plus one
  token per printable ASCII character), or any object with `encode`/`decode`/`__len__`;
  the EOS token decodes to "" (special tokens are skipped in text);
- `tokens_matching`: `re.fullmatch` over every token's decoded text;
- `sample`: `sampler(allowed_ids)` (default: a seeded random choice);
- segments: `respond` answers each one (a callable or a list used in order; by default
  the first option of a `choices` segment). The answer must satisfy the segment's
  grammar where the stub can check it (choice, regex, JSON); the stub then cuts it after
  the first stop string and at `max_tokens`, as the host would. There is no model.
- `fork(n)`: as on the host, each new branch runs a new session brought to the fork
  point by replaying the steps before it (storage answered from its journal), and every
  branch then steps once with its index, in branch order. Then the live branches take
  one step each per round, in tree order (the host's order depends on its batch; a
  controller should not rely on it). `run.branches` lists them, `run.line_outputs` and
  `run.storage` hold what the line shares. Past `max_branches`, a backtrack past the fork
  or a storage quota, the run ends with the host's error type in `run.error`.
- tools: `tools={name: fake}` serves fake tools to `aici_controller.tools`
  (`_stub_tools.py` says how they answer), `allow_tools` plays `--allow-tool` (default:
  every fake); `run.tool_calls` lists the calls made and their answers.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

from ._actions import (
    Action,
    Allow,
    AllTokens,
    Bitmask,
    Deny,
    Fork,
    Generate,
    Matching,
    Sample,
    Splice,
    Stop,
    TokenSet,
)
from ._controller import ControllerSpec, find_controller
from ._host import Host
from ._session import ControllerFailed, Session
from ._stub_line import LineFault, SequenceHost, StubLine, parse_output
from ._stub_tools import FakeTool, StubToolCall, StubTools

__all__ = [
    "DEFAULT_VOCAB", "FakeTool", "LineFault", "Run", "Session", "StubHost", "StubHostError",
    "StubToolCall", "TokenizerLike",
]

DEFAULT_VOCAB: tuple[str, ...] = ("<eos>",) + tuple(
    c for c in string.printable if c not in "\r\x0b\x0c"
)


class TokenizerLike(Protocol):
    """What the stub needs from a real tokenizer (it must not add special tokens)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def __len__(self) -> int: ...


class StubHostError(AssertionError):
    """The test set-up is wrong (no answer for a segment, an answer the grammar rejects,
    a controller that never stops), as opposed to a controller error (`Run.error`)."""


@dataclass
class Run:
    """What one sequence produced under the stub host; for a controller that forked, the
    line: its fields are those of its first branch (as the result line's top level), but
    `error` is the line's (the first fault, which ended every branch)."""

    actions: list[Action] = field(default_factory=list)  # resolved, in order
    outputs: dict[str, Any] = field(default_factory=dict)  # values parsed from JSON
    logs: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the output tokens
    text: str = ""  # the output text
    error: str | None = None  # the Err message, when the controller failed
    branch: tuple[int, ...] = ()  # its index at each fork on its way (() before any)
    branches: list[Run] = field(default_factory=list)  # after a fork: each, in tree order
    line_outputs: dict[str, Any] = field(default_factory=dict)  # set_line_output values
    storage: dict[str, bytes] = field(default_factory=dict)  # the line's, at the end
    tool_calls: list[StubToolCall] = field(default_factory=list)  # the line's, in order

    @property
    def trace(self) -> list[str]:
        """The actions in their SDK spelling: `["fixed(' A: ')", "gen(choice=[...])", ...]`."""
        return [str(a) for a in self.actions]


Respond = Callable[[Generate], str]
Sampler = Callable[[list[int]], int]


class StubHost(Host):
    """A `Host` for native tests; `run` drives a controller the way the engine does."""

    def __init__(
        self,
        vocab: Sequence[str] | TokenizerLike | None = None,
        *,
        eos: str | int = "<eos>",
        respond: Respond | Sequence[str] | None = None,
        sampler: Sampler | None = None,
        seed: int = 0,
        max_branches: int = 16,
        tools: Mapping[str, FakeTool | Callable[[dict[str, Any]], Any]] | None = None,
        allow_tools: Iterable[str] | None = None,
    ) -> None:
        self.max_branches = max_branches  # sequences a run may have, as --max-branches
        self.tools = StubTools(tools, allow_tools)  # fake tools, and the calls made to them
        self._tokenizer: TokenizerLike | None = None
        if vocab is None:
            vocab = DEFAULT_VOCAB
        if isinstance(vocab, str):
            raise TypeError("vocab is a list of token strings or a tokenizer, not one string")
        if isinstance(vocab, Sequence):
            self._texts: list[str] = list(vocab)
            self._ids = {text: i for i, text in enumerate(self._texts)}
            self._longest = max(len(t) for t in self._texts)
        else:
            self._tokenizer = vocab
            self._texts = [vocab.decode([i]) for i in range(len(vocab))]
        if isinstance(eos, int):
            self._eos = eos
        elif eos in self._texts:
            self._eos = self._texts.index(eos)
        else:
            raise ValueError(f"the EOS token {eos!r} is not in the vocabulary")
        if respond is None or callable(respond):
            self._respond: Respond = respond or _default_answer
        else:
            self._respond = _answers_in_order(list(respond))
        self._sampler: Sampler = sampler or random.Random(seed).choice
        self._sets: list[frozenset[int]] = []
        self._set_of: dict[str, int] = {}
        self.logs: list[str] = []
        self.outputs: dict[str, Any] = {}
        self.line = StubLine()  # storage and line outputs of `start`'s session

    # Host primitives.

    def vocab_size(self) -> int:
        return len(self._texts)

    def eos_token(self) -> int:
        return self._eos

    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            return list(self._tokenizer.encode(text))
        ids, i = [], 0
        while i < len(text):
            for n in range(min(self._longest, len(text) - i), 0, -1):
                token = self._ids.get(text[i : i + n])
                if token is not None and token != self._eos:
                    ids.append(token)
                    i += n
                    break
            else:
                raise StubHostError(
                    f"the stub vocabulary cannot tokenize {text[i]!r}: pass StubHost(vocab=...)"
                )
        return ids

    def decode(self, tokens: Sequence[int]) -> str:
        kept = [t for t in tokens if t != self._eos]
        if self._tokenizer is not None:
            return self._tokenizer.decode(kept)
        return "".join(self._texts[t] for t in kept)

    def token_bytes(self, token: int) -> bytes:
        return self.decode([token]).encode()

    def tokens_matching(self, pattern: str) -> int:
        if pattern not in self._set_of:
            try:
                regex = re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"tokens_matching({pattern!r}): {exc}") from None
            ids = frozenset(i for i in range(len(self._texts)) if regex.fullmatch(self.decode([i])))
            self._set_of[pattern] = len(self._sets)
            self._sets.append(ids)
        return self._set_of[pattern]

    def log(self, message: str) -> None:
        self.logs.append(message)

    def set_output(self, key: str, value: str) -> None:
        self.outputs[key] = parse_output(value)

    def set_line_output(self, key: str, value: str) -> None:
        self.line.outputs[key] = parse_output(value)

    def storage_get(self, key: str) -> bytes | None:
        return self.line.get(key)

    def storage_set(self, key: str, value: bytes) -> None:
        self.line.put("set", key, bytes(value))

    def storage_append(self, key: str, value: bytes) -> int:
        new = self.line.storage.get(key, b"") + bytes(value)
        self.line.put("append", key, new)
        return len(new)

    def list_tools(self) -> list[tuple[str, str, str]]:
        return self.tools.list_tools()

    def call_tool(self, name: str, arguments: str) -> tuple[bool, str]:
        return self.tools.call_tool(name, arguments)

    # Driving a controller.

    def start(
        self,
        controller: ControllerSpec | ModuleType,
        arg: str = "",
        prompt: str | Sequence[int] = "",
    ) -> Session:
        """A session to step by hand (`session.step(backtrack, tokens, segment_text)`)."""
        self.logs, self.outputs, self.line = [], {}, StubLine()
        self.tools.calls = []
        return Session(_spec(controller), self, arg, self._prompt(prompt))

    def run(
        self,
        controller: ControllerSpec | ModuleType,
        arg: str = "",
        prompt: str | Sequence[int] = "",
        *,
        max_steps: int = 10_000,
    ) -> Run:
        """Run one line to `stop` (every branch, if it forks) or to the first error."""
        spec = _spec(controller)
        self.logs, self.outputs, self.line = [], {}, StubLine()
        self.tools.calls = []
        root = _Sequence(
            (), SequenceHost(self, self.line, self.logs, self.outputs), spec, arg,
            self._prompt(prompt),
        )
        root.run.outputs, root.run.logs = self.outputs, self.logs
        line = _Lineage(self, spec, arg, root)
        steps = 0
        while line.error is None:
            live = sorted((s for s in line.sequences if not s.done), key=lambda s: s.path)
            if not live:
                break
            for seq in live:
                steps += 1
                if steps > max_steps:
                    raise StubHostError(f"the controller did not stop within {max_steps} steps")
                line.step(seq)
                if line.error is not None:
                    break
        return line.result()

    def _prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)

    def allowed(self, tokens: TokenSet) -> list[int]:
        """The ids in a resolved token set, ascending."""
        every = range(len(self._texts))
        if isinstance(tokens, AllTokens):
            return list(every)
        if isinstance(tokens, Allow):
            return sorted(set(tokens.tokens))
        if isinstance(tokens, Deny):
            denied = set(tokens.tokens)
            return [t for t in every if t not in denied]
        if isinstance(tokens, Bitmask):
            words = tokens.words
            return [t for t in every if t // 32 < len(words) and words[t // 32] >> (t % 32) & 1]
        if isinstance(tokens, Matching):
            assert tokens.handle is not None
            members = self._sets[tokens.handle]
            return [t for t in every if (t in members) != tokens.negated]
        raise TypeError(f"not a token set: {tokens!r}")

    def _sample(self, tokens: TokenSet) -> int:
        allowed = self.allowed(tokens)
        if not allowed:
            raise StubHostError(f"sample({tokens}) allows no token of the stub vocabulary")
        token = self._sampler(allowed)
        if token not in allowed:
            raise StubHostError(f"the sampler chose {token}, which {tokens} does not allow")
        return token

    def _segment(self, segment: Generate) -> tuple[str, list[int]]:
        answer = self._respond(segment)
        _check_answer(segment, answer)
        cut = len(answer)
        for s in segment.stop:
            at = answer.find(s)
            if at >= 0:
                cut = min(cut, at + len(s))
        tokens = self.tokenize(answer[:cut])[: segment.max_tokens]
        return self.decode(tokens), tokens


def _spec(controller: ControllerSpec | ModuleType) -> ControllerSpec:
    if isinstance(controller, ControllerSpec):
        return controller
    if isinstance(controller, ModuleType):
        return find_controller(controller)
    raise TypeError(f"expected a @controller or a module, got {type(controller).__name__}")


Step = tuple[int, tuple[int, ...], "str | None", "int | None"]  # backtrack, tokens, text, branch


class _Sequence:
    """One sequence of a line under the stub: its session, host, record, step journal."""

    def __init__(self, path: tuple[int, ...], host: SequenceHost, spec: ControllerSpec,
                 arg: str, prompt: list[int]) -> None:
        self.path = path
        self.host = host
        self.session = Session(spec, host, arg, prompt)
        self.run = Run(outputs=host.outputs, logs=host.logs, branch=path)
        self.inputs: list[Step] = []  # every step's input, in order (for replays)
        self.next: Step = (0, (), None, None)
        self.floor: int | None = None  # output tokens before its latest fork
        self.done = False


class _Lineage:
    """A line's sequences under the stub, driven as the host drives them (see the module
    doc): one step at a time, forks replayed, a fault ending every branch."""

    def __init__(self, stub: StubHost, spec: ControllerSpec, arg: str, root: _Sequence) -> None:
        self.stub = stub
        self.spec = spec
        self.arg = arg
        self.prompt = list(root.session.ctx.prompt)
        self.sequences = [root]
        self.forked = False
        self.error: str | None = None

    def step(self, seq: _Sequence) -> None:
        """One step of `seq` with its pending input; a fork steps every branch once."""
        inp, seq.next = seq.next, (0, (), None, None)
        try:
            action = seq.session.step(*inp)
        except ControllerFailed as exc:
            self._fail(seq, exc.message)
            return
        except LineFault as fault:
            self._fail(seq, str(fault))
            return
        seq.inputs.append(inp)
        seq.run.actions.append(action)
        out = seq.run.tokens
        if isinstance(action, Stop):
            seq.done = True
        elif isinstance(action, Sample):
            token = self.stub._sample(action.tokens)
            out.append(token)
            seq.next = (0, (token,), None, None)
        elif isinstance(action, Generate):
            text, tokens = self.stub._segment(action)
            out.extend(tokens)
            seq.next = (0, tuple(tokens), text, None)
        elif isinstance(action, Splice):
            assert action.tokens is not None
            if seq.floor is not None and action.backtrack > len(out) - seq.floor:
                self._fail(seq, f"bad_action: splice backtracks {action.backtrack} tokens past "
                                f"the fork point: only {len(out) - seq.floor} were generated "
                                "since the fork")
                return
            del out[len(out) - action.backtrack :]
            out.extend(action.tokens)
            seq.next = (action.backtrack, tuple(action.tokens), None, None)
        elif isinstance(action, Fork):
            self._fork(seq, action.branches)

    def _fork(self, seq: _Sequence, n: int) -> None:
        live = len(self.sequences)
        if live + n - 1 > self.stub.max_branches:
            self._fail(seq, f"bad_action: fork({n}) would make {live + n - 1} branches for the "
                            f"line, more than max_branches {self.stub.max_branches}")
            return
        self.forked = True
        base = seq.path
        branches = [seq] + [self._replica(seq, base + (k,)) for k in range(1, n)]
        seq.path = seq.run.branch = base + (0,)
        for k, branch in enumerate(branches):
            branch.floor = len(seq.run.tokens)
            branch.next = (0, (), None, k)
        self.sequences += branches[1:]
        for branch in branches:
            self.step(branch)
            if self.error is not None:
                return

    def _replica(self, seq: _Sequence, path: tuple[int, ...]) -> _Sequence:
        """A new sequence in `seq`'s state: a new session replaying `seq`'s steps."""
        host = SequenceHost(self.stub, seq.host.line)
        host.replay = iter(list(seq.host.journal))
        new = _Sequence(path, host, self.spec, self.arg, self.prompt)
        for i, (inp, expected) in enumerate(zip(seq.inputs, seq.run.actions)):
            try:
                got = new.session.step(*inp)
            except ControllerFailed as exc:
                raise StubHostError(f"replaying step {i + 1} for a new branch: {exc}") from None
            if got != expected:
                raise StubHostError(
                    f"replaying step {i + 1} for a new branch, the controller answered {got} "
                    f"where it had answered {expected}: a controller must act alike given "
                    "the same inputs (no clock, no randomness)"
                )
        host.replay = None
        host.journal = list(seq.host.journal)
        new.inputs = list(seq.inputs)
        new.run.actions = list(seq.run.actions)
        new.run.tokens = list(seq.run.tokens)
        return new

    def _fail(self, seq: _Sequence, message: str) -> None:
        seq.run.error = message
        seq.done = True
        self.error = message

    def result(self) -> Run:
        line = self.sequences[0].host.line
        for seq in self.sequences:
            seq.run.text = self.stub.decode(seq.run.tokens)
        if not self.forked:
            run = self.sequences[0].run
        else:
            ordered = [s.run for s in sorted(self.sequences, key=lambda s: s.path)]
            first = ordered[0]
            run = Run(actions=first.actions, outputs=first.outputs, logs=first.logs,
                      tokens=first.tokens, text=first.text, error=self.error,
                      branch=first.branch, branches=ordered)
        run.line_outputs = dict(line.outputs)
        run.storage = dict(line.storage)
        run.tool_calls = list(self.stub.tools.calls)
        return run


def _default_answer(segment: Generate) -> str:
    if segment.grammar is not None and segment.grammar.kind == "choice":
        return segment.grammar.value[0]
    raise StubHostError(f"no answer for {segment}: pass StubHost(respond=...)")


def _answers_in_order(answers: list[str]) -> Respond:
    pending = list(answers)

    def respond(segment: Generate) -> str:
        if not pending:
            raise StubHostError(f"no answer left for {segment} ({len(answers)} given)")
        return pending.pop(0)

    return respond


def _check_answer(segment: Generate, answer: str) -> None:
    grammar = segment.grammar
    if not isinstance(answer, str):
        raise StubHostError(f"respond() returned {type(answer).__name__}, not str")
    if grammar is None:
        return
    if grammar.kind == "choice" and answer not in grammar.value:
        raise StubHostError(f"{answer!r} is not one of {list(grammar.value)}")
    if grammar.kind == "regex":
        assert isinstance(grammar.value, str)
        try:
            regex = re.compile(grammar.value)
        except re.error:
            return  # llguidance syntax that Python's re does not know: no check
        if not regex.fullmatch(answer):
            raise StubHostError(f"{answer!r} does not match the segment's regex {grammar.value!r}")
    if grammar.kind == "json-schema":
        try:
            json.loads(answer)
        except ValueError as exc:
            raise StubHostError(f"{answer!r} is not JSON ({exc})") from None
