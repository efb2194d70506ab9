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
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

from ._actions import (
    Action,
    Allow,
    AllTokens,
    Bitmask,
    Deny,
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

__all__ = ["DEFAULT_VOCAB", "Run", "Session", "StubHost", "StubHostError", "TokenizerLike"]

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
    """What one sequence produced under the stub host."""

    actions: list[Action] = field(default_factory=list)  # resolved, in order
    outputs: dict[str, Any] = field(default_factory=dict)  # values parsed from JSON
    logs: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the output tokens
    text: str = ""  # the output text
    error: str | None = None  # the Err message, when the controller failed

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
    ) -> None:
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
        try:
            self.outputs[key] = json.loads(value)
        except ValueError:
            self.outputs[key] = value  # the WIT contract: kept as a string

    # Driving a controller.

    def start(
        self,
        controller: ControllerSpec | ModuleType,
        arg: str = "",
        prompt: str | Sequence[int] = "",
    ) -> Session:
        """A session to step by hand (`session.step(backtrack, tokens, segment_text)`)."""
        if isinstance(controller, ControllerSpec):
            spec = controller
        elif isinstance(controller, ModuleType):
            spec = find_controller(controller)
        else:
            raise TypeError(f"expected a @controller or a module, got {type(controller).__name__}")
        self.logs, self.outputs = [], {}
        prompt_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        return Session(spec, self, arg, prompt_ids)

    def run(
        self,
        controller: ControllerSpec | ModuleType,
        arg: str = "",
        prompt: str | Sequence[int] = "",
        *,
        max_steps: int = 10_000,
    ) -> Run:
        """Run one sequence to `stop` or to the controller's error."""
        session = self.start(controller, arg, prompt)
        run = Run(outputs=self.outputs, logs=self.logs)
        out = run.tokens
        tokens: list[int] = []
        backtrack, segment_text = 0, None
        for _ in range(max_steps):
            try:
                action = session.step(backtrack, tokens, segment_text)
            except ControllerFailed as exc:
                run.error = exc.message
                break
            run.actions.append(action)
            segment_text = None
            backtrack = 0
            if isinstance(action, Stop):
                break
            if isinstance(action, Sample):
                tokens = [self._sample(action.tokens)]
            elif isinstance(action, Generate):
                segment_text, tokens = self._segment(action)
            elif isinstance(action, Splice):
                assert action.tokens is not None
                backtrack, tokens = action.backtrack, list(action.tokens)
                del out[len(out) - backtrack :]
            out.extend(tokens)
        else:
            raise StubHostError(f"the controller did not stop within {max_steps} steps")
        run.text = self.decode(out)
        return run

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
