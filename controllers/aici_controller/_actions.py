"""What a controller can ask of the host: token sets, grammars and the five actions.

Values here are plain frozen dataclasses, built without a host: text to splice and regex
token sets stay symbolic (`Splice.text`, `Matching.pattern`) until the session resolves
them with host calls at the boundary, so they can be module-level constants and traces
stay readable. Mirrors the WIT types `token-set`, `grammar`, `segment`, `splice`, `action`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

U32_MAX = 2**32 - 1


class TokenSet:
    """Which tokens may be sampled next. `~s` is the complement where it is cheap."""

    def __invert__(self) -> TokenSet:
        raise TypeError(f"{type(self).__name__} has no cheap complement")


@dataclass(frozen=True)
class AllTokens(TokenSet):
    def __invert__(self) -> TokenSet:
        raise ValueError("the complement of ALL is empty: nothing could be sampled")

    def __str__(self) -> str:
        return "ALL"


@dataclass(frozen=True)
class Allow(TokenSet):
    tokens: tuple[int, ...]

    def __invert__(self) -> TokenSet:
        return Deny(self.tokens)

    def __str__(self) -> str:
        return f"allow({list(self.tokens)})"


@dataclass(frozen=True)
class Deny(TokenSet):
    tokens: tuple[int, ...]

    def __invert__(self) -> TokenSet:
        return Allow(self.tokens)

    def __str__(self) -> str:
        return f"deny({list(self.tokens)})"


@dataclass(frozen=True)
class Bitmask(TokenSet):
    """Bit i of word i // 32 set = token i allowed. Costly on the boundary (one u32 per 32
    tokens, about 4.5 ms for a 256k vocabulary): prefer `Matching` for vocabulary-wide sets."""

    words: tuple[int, ...]

    @classmethod
    def from_tokens(cls, tokens: Iterable[int], vocab_size: int) -> Bitmask:
        words = [0] * ((vocab_size + 31) // 32)
        for t in tokens:
            if not 0 <= t < vocab_size:
                raise ValueError(f"token {t} is outside the vocabulary (size {vocab_size})")
            words[t // 32] |= 1 << (t % 32)
        return cls(tuple(words))

    def __str__(self) -> str:
        return f"bitmask({sum(bin(w).count('1') for w in self.words)} tokens)"


@dataclass(frozen=True)
class Matching(TokenSet):
    """Tokens whose text fully matches `pattern` (Python `re`), computed on the host.

    `handle` is filled in by the session (one host call per pattern per sequence).
    """

    pattern: str
    negated: bool = False
    handle: int | None = None

    def __invert__(self) -> TokenSet:
        return Matching(self.pattern, not self.negated, self.handle)

    def __str__(self) -> str:
        name = "not_matching" if self.negated else "tokens_matching"
        return f"{name}({self.pattern!r})"


ALL = AllTokens()


def allow(tokens: Iterable[int]) -> Allow:
    """Only these token ids."""
    ids = _token_ids(tokens, "allow")
    if not ids:
        raise ValueError("allow() needs at least one token: an empty set cannot be sampled")
    return Allow(ids)


def deny(tokens: Iterable[int]) -> Deny:
    """Any token but these ids."""
    return Deny(_token_ids(tokens, "deny"))


def tokens_matching(pattern: str) -> Matching:
    """The tokens whose decoded text fully matches `pattern` (a Python regex).

    The host scans the vocabulary once per pattern; the guest only holds a handle. Note
    `.` does not match a newline: use `(?s)` when tokens may contain one.
    """
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"tokens_matching({pattern!r}): invalid regex: {exc}") from None
    return Matching(pattern)


def not_matching(pattern: str) -> Matching:
    """The complement of `tokens_matching(pattern)`."""
    return Matching(tokens_matching(pattern).pattern, negated=True)


GrammarKind = Literal["json-schema", "regex", "lark", "choice"]


@dataclass(frozen=True)
class Grammar:
    kind: GrammarKind
    value: str | tuple[str, ...]  # choice: the options; otherwise the grammar text


@dataclass(frozen=True)
class Sample:
    """Sample one token from `tokens`; the controller then receives its id."""

    tokens: TokenSet

    def __str__(self) -> str:
        return f"sample({self.tokens})"


@dataclass(frozen=True)
class Generate:
    """A segment the host runs natively; the controller then receives its text."""

    grammar: Grammar | None
    max_tokens: int
    stop: tuple[str, ...] = ()

    def __str__(self) -> str:
        parts = []
        if self.grammar is not None:
            kind, value = self.grammar.kind, self.grammar.value
            shown = list(value) if kind == "choice" else value
            parts.append(f"{kind.replace('-', '_')}={shown!r}")
        parts.append(f"max_tokens={self.max_tokens}")
        if self.stop:
            parts.append(f"stop={list(self.stop)!r}")
        return f"gen({', '.join(parts)})"


@dataclass(frozen=True)
class Splice:
    """Remove the last `backtrack` tokens, then append `text` (or `tokens`) unsampled.

    Invariant: `tokens is None` until the session tokenizes `text` on the host; a splice
    made from token ids (`splice_tokens`) carries them from the start.
    """

    backtrack: int = 0
    text: str = ""
    tokens: tuple[int, ...] | None = None

    def __str__(self) -> str:
        if self.backtrack == 0 and self.text:
            return f"fixed({self.text!r})"
        if self.text or self.tokens is None:
            return f"backtrack({self.backtrack}, {self.text!r})"
        return f"splice_tokens({self.backtrack}, {list(self.tokens)})"


@dataclass(frozen=True)
class Stop:
    """The sequence is complete."""

    def __str__(self) -> str:
        return "stop()"


@dataclass(frozen=True)
class Fork:
    """Split the sequence into `branches` that share every token so far; each branch
    continues with the controller in its current state and learns its index."""

    branches: int

    def __str__(self) -> str:
        return f"fork({self.branches})"


Action = Union[Sample, Generate, Splice, Stop, Fork]  # noqa: UP007 (runs on Python 3.10 too)
ACTION_TYPES = (Sample, Generate, Splice, Stop, Fork)


def sample(tokens: TokenSet = ALL) -> Sample:
    """Sample one token from `tokens`; `yield` it to receive the sampled token id."""
    if not isinstance(tokens, TokenSet):
        raise TypeError(
            f"sample() takes a token set (ALL, allow(...), deny(...), tokens_matching(...)), "
            f"got {type(tokens).__name__}"
        )
    return Sample(tokens)


def gen(
    *,
    json_schema: dict[str, Any] | str | None = None,
    regex: str | None = None,
    lark: str | None = None,
    choices: Sequence[str] | None = None,
    max_tokens: int = 256,
    stop: str | Sequence[str] = (),
) -> Generate:
    """A host-enforced segment; `yield` it to receive the segment's text.

    At most one grammar (none = free text). The segment ends when the grammar completes,
    after `max_tokens`, at a stop string or at end-of-sequence; the controller is not
    called in between, which is what makes segments fast.
    """
    given = [
        (name, value)
        for name, value in (
            ("json_schema", json_schema),
            ("regex", regex),
            ("lark", lark),
            ("choices", choices),
        )
        if value is not None
    ]
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise ValueError(f"gen() takes at most one grammar, got {names}")
    grammar: Grammar | None = None
    if json_schema is not None:
        grammar = Grammar("json-schema", _schema_text(json_schema))
    elif regex is not None:
        grammar = Grammar("regex", _text_arg(regex, "regex"))
    elif lark is not None:
        grammar = Grammar("lark", _text_arg(lark, "lark"))
    elif choices is not None:
        if isinstance(choices, str) or not all(isinstance(c, str) for c in choices):
            raise TypeError("gen(choices=...) takes a list of strings")
        if not choices:
            raise ValueError("gen(choices=[]) has nothing to choose from")
        grammar = Grammar("choice", tuple(choices))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise TypeError(f"gen(max_tokens=...) takes an int, got {type(max_tokens).__name__}")
    if not 1 <= max_tokens <= U32_MAX:
        raise ValueError(f"gen(max_tokens={max_tokens}) must be at least 1")
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise TypeError("gen(stop=...) takes a non-empty string or a list of them")
    return Generate(grammar, max_tokens, stops)


def gen_json(
    json_schema: dict[str, Any] | str,
    *,
    max_tokens: int = 256,
    stop: str | Sequence[str] = (),
) -> Generator[Generate, str, Any]:
    """A JSON value that follows `json_schema`: `value = yield from gen_json(schema)`."""
    text = yield gen(json_schema=json_schema, max_tokens=max_tokens, stop=stop)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"gen_json: the segment is not complete JSON ({exc}); it may have hit "
            f"max_tokens={max_tokens} or end-of-sequence: {text[:80]!r}"
        ) from None


def fixed(text: str) -> Splice:
    """Append `text` without sampling (tokenized by the host); resumes with None."""
    return Splice(0, _text_arg(text, "fixed"))


def backtrack(n: int, text: str = "") -> Splice:
    """Remove the last `n` generated tokens, then append `text`; resumes with None."""
    return Splice(_count(n, "backtrack"), _text_arg(text, "backtrack"))


def splice_tokens(n: int, tokens: Iterable[int]) -> Splice:
    """Remove the last `n` generated tokens, then append these token ids."""
    return Splice(_count(n, "splice_tokens"), "", _token_ids(tokens, "splice_tokens"))


def stop() -> Stop:
    """End the sequence (returning from a generator controller does the same)."""
    return Stop()


def fork(n: int) -> Fork:
    """Split the sequence into `n` branches (2 or more) that share every token so far:
    `branch = yield fork(3)` resumes once in each branch, with its index 0..n-1.

    The host does not recompute the shared tokens' keys. Each branch runs the controller
    from its state at the fork (the host replays the steps before it into a new instance,
    so a controller must act alike given the same inputs, which the sandbox ensures: no
    clock, no randomness). A branch may stop, backtrack (not past the fork) and fork
    again; a line runs at most `--max-branches` sequences (16 by default).
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"fork() takes an int, got {type(n).__name__}")
    if not 2 <= n <= U32_MAX:
        raise ValueError(f"fork({n}): a fork makes at least 2 branches")
    return Fork(n)


def _schema_text(schema: dict[str, Any] | str) -> str:
    if isinstance(schema, dict):
        return json.dumps(schema)
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"gen(json_schema=...): the schema is not JSON: {exc}") from None
        return schema
    raise TypeError(f"gen(json_schema=...) takes a dict or JSON text, got {type(schema).__name__}")


def _text_arg(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where}() takes a str, got {type(value).__name__}")
    return value


def _count(n: object, where: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= U32_MAX:
        raise ValueError(f"{where}({n!r}, ...): the token count must be an int >= 0")
    return n


def _token_ids(tokens: Iterable[int], where: str) -> tuple[int, ...]:
    ids = tuple(tokens)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= U32_MAX:
            raise ValueError(f"{where}(): {t!r} is not a token id")
    return ids
