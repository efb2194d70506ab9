"""Finishing a constrained value before the token limit cuts it off.

A small model can spend its whole budget inside one value (a string or number it repeats
forever) and end cut off, with no usable JSON. `Closer` finds a short way to complete the
value from the matcher's current state: at each step it takes the first token of a fixed
list that the grammar allows (closing quotes and brackets first, then the shortest
literals), and whatever the grammar forces (keys of required properties). Where the
list cannot go on, the schema's hints (hints.py) are tried: the next required key
where an object cannot close yet, and a sample of a `pattern` or `format` where a string
cannot (`0.0.0` for a version number, an `iglu:` URI). Where only a text it just took
twice fits, the grammar wants what neither has (the `#` of `[0-9]+#[a-z]+`), and from
there it takes the lowest-numbered allowed token it has not taken yet. The grammar
decides every token, so the completion is valid for the grammar; it is not always the
shortest one, and a grammar that cannot be completed this way within the limit gets
none.

Cost per walk: a matcher copy, then per completion token a `validate_tokens` call for
each candidate text tried (a handful), and a bitmask (~0.1 ms at a 49k vocabulary) only
where no text of the list fits; p50 0.2-0.4 ms, p99 2-9 ms, from random and from real
models' states (bench/closing_walk.py). early_close.py bounds how often it runs.

When and from where a completion is used (at the limit, on a loop) is early_close.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from aici_cli.control.grammar.distinct_keys import DistinctKeys
from aici_cli.control.grammar.hints import NO_HINTS, Hints

# The closing tokens, by the JSON state they suit (tried in order; the grammar decides).
# Values come with and without the space a separator may leave to them (": ", ", ").
# A bare space is the last resort everywhere.
IN_STRING = ('"', '"}', '"]', ':', '-', '0', '.', 'a', ' ')
AFTER_OPEN_OBJECT = ('}', '"', ' ')
_VALUES = ('0', ' 0', 'null', ' null', 'false', ' false', '""', ' ""', '"', ' "', '[', ' [',
           '{', ' {', '1', ' 1', 'a')
AFTER_OPEN_ARRAY = (']', *_VALUES, ' ')
VALUE = (*_VALUES, ' ')
AFTER_VALUE_IN_OBJECT = ('}', ',', ' ')
AFTER_VALUE_IN_ARRAY = (']', ',', ' ')
AFTER_VALUE = ('}', ']', ',', ' ')
CLOSING_TEXTS = tuple(dict.fromkeys(IN_STRING + AFTER_OPEN_OBJECT + AFTER_OPEN_ARRAY + VALUE
                                    + AFTER_VALUE_IN_OBJECT + AFTER_VALUE_IN_ARRAY))

def json_state(text: str) -> tuple[bool, list[str], str]:
    """Where a JSON prefix stands: inside a string, the open brackets, and the last
    significant thing seen ("" start, "{", "[", ":", ",", or "v" after a value)."""
    stack: list[str] = []
    in_string = escaped = False
    last = ""
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string, last = False, "v"
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append(ch)
            last = ch
        elif ch in "}]":
            if stack:
                stack.pop()
            last = "v"
        elif ch in ":,":
            last = ch
        elif not ch.isspace():
            last = "v"
    return in_string, stack, last


def boundaries(text: bytes) -> list[int]:
    """The byte offsets in a JSON prefix right after each `{` and `[`, and right before
    and after each `,`, outside strings, in order: the places a value can be closed from
    with whole members only (nothing cut inside a string or a number)."""
    found: list[int] = []
    in_string = escaped = False
    for i, b in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:
                in_string = False
        elif b == 0x22:
            in_string = True
        elif b in b"{[":
            found.append(i + 1)
        elif b == 0x2C:  # comma
            found += [i, i + 1]
    return found


def closing_order(text: str) -> tuple[str, ...]:
    """The closing texts to try next after `text`, most useful first."""
    return _order_for(json_state(text))


def _order_for(state: tuple[bool, list[str], str]) -> tuple[str, ...]:
    in_string, stack, last = state
    if in_string:
        return IN_STRING
    if last == "{":
        return AFTER_OPEN_OBJECT
    if last == "[":
        return AFTER_OPEN_ARRAY
    if last in ("", ":", ","):
        return VALUE
    if stack:
        return AFTER_VALUE_IN_OBJECT if stack[-1] == "{" else AFTER_VALUE_IN_ARRAY
    return AFTER_VALUE


@dataclass
class _Walk:
    """A walk's completion (None: none found) and its choices: (position, token) where
    it chose among allowed tokens, rather than took what the grammar forced."""

    tokens: list[int] | None
    choices: list[tuple[int, int]]


class Closer:
    """Completions from a matcher's state; one per run (it only holds token ids)."""

    def __init__(self, tokenizer: Any,
                 decode_bytes: Callable[[list[int]], bytes] | None = None) -> None:
        """`tokenizer`: the model's (HF); `decode_bytes`: tokens to their exact bytes (the
        grammar tokenizer's, llguidance `LLTokenizer.decode_bytes`), for the loop guard."""
        self.tokenizer = tokenizer
        self.decode_bytes: Callable[[list[int]], bytes] = decode_bytes or (
            lambda ids: str(tokenizer.decode(list(ids))).encode())
        self.ids: dict[str, int] = {}
        self._tokens: dict[str, list[int]] = {}  # hint texts, tokenized once a run
        for text in CLOSING_TEXTS:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                self.ids[text] = ids[0]

    def completion(self, matcher: llguidance.LLMatcher, text: str, limit: int,
                   hints: Hints = NO_HINTS) -> list[int] | None:
        """Tokens (at most `limit`) that take a copy of `matcher`, whose output so far
        reads `text`, to a state where the grammar is complete; None when none is found.
        `hints`: the schema's (hints.py). The matcher is not changed."""
        return self._walk(matcher, text, limit, hints, frozenset()).tokens

    def variants(self, matcher: llguidance.LLMatcher, text: str, limit: int,
                 hints: Hints = NO_HINTS, tries: int = 8) -> Iterator[list[int]]:
        """The completion, then up to `tries` others: each the walk again with one of the
        first's choices barred (its first choices first). For a value the grammar cannot
        tell valid (an exclusive `oneOf`, `minProperties`), where `{}` closes the grammar
        but not the schema, and `{"previous": ""}` would."""
        first = self._walk(matcher, text, limit, hints, frozenset())
        if first.tokens is None:
            return
        yield first.tokens
        seen = {tuple(first.tokens)}
        for choice in first.choices[:tries]:
            other = self._walk(matcher, text, limit, hints, frozenset([choice])).tokens
            if other is not None and tuple(other) not in seen:
                seen.add(tuple(other))
                yield other

    def walk(self, matcher: llguidance.LLMatcher, text: str, limit: int, hints: Hints,
             barred: frozenset[tuple[int, int]]) -> tuple[list[int] | None,
                                                          list[tuple[int, int]]]:
        """The completion with `barred` (position in the completion, token) choices not
        taken, and its choices (position, token)."""
        found = self._walk(matcher, text, limit, hints, barred)
        return found.tokens, found.choices

    # Long: one loop over the walk's state (matcher copy, text, keys, choices); each way on
    # (forced, required key, closing run, sample, closing text) reads and extends it.
    def _walk(self, matcher: llguidance.LLMatcher, text: str, limit: int, hints: Hints,
              barred: frozenset[tuple[int, int]]) -> _Walk:
        """The walk of the module docstring from a copy of `matcher`. `barred`: (position
        in the completion, token) pairs the walk does not choose there."""
        m = matcher.deep_copy()
        walk = _Walk([], [])
        out = walk.tokens
        assert out is not None
        avoid: set[int] = set()  # once stuck repeating: the tokens already taken
        tried_at = -1  # the string where `_closing_run` and the samples were tried
        keys = (DistinctKeys.after(hints.distinct_keys, self.decode_bytes, text)
                if hints.distinct_keys is not None else None)  # no key written twice

        def take(run: list[int] | None) -> bool:
            nonlocal text
            if not run or (len(out), run[0]) in barred or (
                    keys is not None and not keys.fits(run)) or not m.consume_tokens(run):
                return False
            walk.choices.append((len(out), run[0]))
            out.extend(run)
            text += self.tokenizer.decode(run)
            if keys is not None:
                keys.consumed(run)
            return True

        while len(out) <= limit:
            if m.is_stopped() or m.is_accepting():
                return walk if len(out) <= limit else _Walk(None, walk.choices)
            forced = m.compute_ff_tokens()
            if m.is_error() or (forced and not m.consume_tokens(forced)):
                return _Walk(None, walk.choices)
            if forced:
                out += forced
                text += self.tokenizer.decode(forced)
                if keys is not None:
                    keys.consumed(forced)
                continue
            state = json_state(text)  # O(len(text)): once a step
            in_string = state[0]
            if take(self._required_key(m, text, state, hints.keys)):
                continue
            start = _string_start(text) if in_string else -1
            if start != tried_at and in_string and self._quote_blocked(m):
                # A string that cannot close yet: it may want a run of one kind (`\d{10}`
                # somewhere in it, a `minLength`) or a pattern's characters, which no list
                # order makes. Tried once a string.
                tried_at = start
                if take(self._closing_run(m, limit - len(out))) or take(
                        self._first_valid(m, self._sample_runs(text, hints.strings))):
                    continue
            skip = avoid | {t for at, t in barred if at == len(out)} | (
                keys.barred() if keys is not None else set())
            token, choice = self._choose(m, state, out, skip)
            if token is not None and _third_round([*out, token], in_string):
                # Only what was just taken twice fits of the list (`00`, `--0--0`): the
                # grammar wants something the list lacks (the `#` of `[0-9]+#[a-z]+`, the
                # `=` of `;a=b`). From here on no token is taken twice while another is
                # allowed.
                avoid = set(out)
                token, choice = _first_allowed(m, avoid | skip), None
            if avoid and token is not None:
                avoid.add(token)
            if token is None or not m.consume_token(token):
                return _Walk(None, walk.choices)
            walk.choices.append((len(out), token))
            out.append(token)
            text += choice if choice is not None else self.tokenizer.decode([token])
            if keys is not None:
                keys.consumed([token])
        return _Walk(None, walk.choices)

    def _choose(self, m: llguidance.LLMatcher, state: tuple[bool, list[str], str],
                out: list[int], skip: set[int]) -> tuple[int | None, str | None]:
        """The next token (and its closing text, if it is one): the first of the closing
        texts for `state` the grammar allows, else the lowest-numbered allowed token;
        never one of `skip` while another is allowed."""
        # A text chosen twice in a row goes last: a pattern like `[0-9]+-[0-9]+` would
        # otherwise take "0" forever.
        order = _order_for(state)
        if len(out) >= 2 and out[-1] == out[-2]:
            order = tuple(t for t in order if self.ids.get(t) != out[-1]) + order
        choice = next((t for t in order if t in self.ids and self.ids[t] not in skip
                       and m.validate_tokens([self.ids[t]]) == 1), None)
        if choice is not None:
            return self.ids[choice], choice
        return _first_allowed(m, skip), None

    def tokens(self, text: str) -> list[int]:
        ids = self._tokens.get(text)
        if ids is None:
            ids = self._tokens[text] = list(
                self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids

    def _first_valid(self, m: llguidance.LLMatcher,
                     runs: Iterable[list[int]]) -> list[int] | None:
        """The first of `runs` the grammar takes whole from here (`validate_tokens`: no
        mask computed, microseconds a run)."""
        return next((r for r in runs if r and m.validate_tokens(r) == len(r)), None)

    def _required_key(self, m: llguidance.LLMatcher, text: str,
                      state: tuple[bool, list[str], str],
                      keys: tuple[str, ...]) -> list[int] | None:
        """Where an object wants a key and cannot close: the first of the schema's
        required keys that fits here, as the rest of the key string being written, or
        whole with its quotes (and a separator's space)."""
        in_string, stack, last = state
        if not keys or not stack or stack[-1] != "{" or last not in ("{", ","):
            return None
        if in_string:  # a key begun (the grammar forces its quote)
            written = text[_string_start(text):]
            return self._first_valid(m, (self.tokens(k[len(written):] + '"') for k in keys
                                         if k.startswith(written)))
        close = self.ids.get("}")
        if last == "{" and close is not None and m.validate_tokens([close]) == 1:
            return None
        return self._first_valid(m, (self.tokens(f'{space}"{k}"') for k in keys
                                     for space in ("", " ")))

    def _sample_runs(self, text: str, samples: tuple[str, ...]) -> Iterator[list[int]]:
        """Each sample's tail that may finish the open string, closing quote included:
        first the tail past as many characters as the string holds (the written part
        standing for the sample's head), then every other tail, longest first."""
        written = len(text) - _string_start(text)
        for sample in samples:
            tails = sorted(range(len(sample) + 1), key=lambda i: (i != written, i))
            for i in tails:
                yield self.tokens(sample[i:] + '"')

    def _quote_blocked(self, m: llguidance.LLMatcher) -> bool:
        quote = self.ids.get('"')
        return quote is not None and m.validate_tokens([quote]) == 0

    def _closing_run(self, m: llguidance.LLMatcher, room: int) -> list[int] | None:
        """The shortest `filler * k + '"'` (k < `room`, at most `MAX_RUN`) the grammar
        takes whole from here: a string that closes after a run of digits or letters.
        Checked with `validate_tokens` (no mask computed): ~2 * MAX_RUN cheap calls."""
        quote = self.ids.get('"')
        fillers = [self.ids[t] for t in ("0", "a") if t in self.ids]
        if quote is None:
            return None
        for k in range(1, min(room, MAX_RUN + 1)):
            for filler in fillers:
                run = [filler] * k + [quote]
                if m.validate_tokens(run) == len(run):
                    return run
        return None


def _string_start(text: str) -> int:
    """Where the JSON string `text` ends inside begins (the index after its quote)."""
    at = len(text)
    while (at := text.rfind('"', 0, at)) >= 0:
        if (at - len(text[:at].rstrip("\\"))) % 2 == 0:  # not an escaped quote
            return at + 1
    return 0


def _third_round(out: list[int], in_string: bool) -> bool:
    """`out` ends in a unit taken three times in a row: one token, or inside a string up to
    4 (`--0--0`). Outside strings a longer unit is how a `minItems` array fills up."""
    return any(len(out) >= 3 * p and out[-p:] == out[-2 * p : -p] == out[-3 * p : -2 * p]
               for p in range(1, 5 if in_string else 2))


# The longest run `_closing_run` tries (a `\d{16}` card number, a 20-character minimum).
MAX_RUN = 24


def _first_allowed(m: llguidance.LLMatcher, avoid: set[int] | None = None) -> int | None:
    """The lowest-numbered token the grammar allows (BPE numbers short, common tokens
    first), outside `avoid` where any is: the way on when no closing text fits, such as
    the first letters of a key the schema requires."""
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8),
                         bitorder="little")
    allowed = np.flatnonzero(bits)
    if avoid:
        fresh = allowed[~np.isin(allowed, list(avoid))]
        allowed = fresh if fresh.size else allowed
    return int(allowed[0]) if allowed.size else None
