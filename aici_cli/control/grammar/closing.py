"""Finishing a constrained value before the token limit cuts it off.

A small model can spend its whole budget inside one value (a string or number it repeats
forever) and end cut off, with no usable JSON. `Closer` finds a short way to complete the
value from the matcher's current state: at each step it takes the first token of a fixed
list that the grammar allows (closing quotes and brackets first, then the shortest
literals), and whatever the grammar forces (keys of required properties); where only a
text it just took twice fits, the grammar wants what the list lacks (the `#` of
`[0-9]+#[a-z]+`), and from there it takes the lowest-numbered allowed token it has not
taken yet. The grammar decides every token, so the completion is valid
for the schema; it is not always the shortest one, and a grammar that cannot be
completed this way within the limit gets none, and is cut off as before.

When and from where a completion is used (at the limit, on a loop) is early_close.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np

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
        for text in CLOSING_TEXTS:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                self.ids[text] = ids[0]

    def completion(self, matcher: llguidance.LLMatcher, text: str,
                   limit: int) -> list[int] | None:
        """Tokens (at most `limit`) that take a copy of `matcher`, whose output so far
        reads `text`, to a state where the grammar is complete; None when none is found.
        The matcher is not changed."""
        m = matcher.deep_copy()
        out: list[int] = []
        avoid: set[int] = set()  # once stuck repeating: the tokens already taken
        run_tried = False  # `_closing_run` tried in the string the text is in
        while len(out) <= limit:
            if m.is_stopped() or m.is_accepting():
                return out if len(out) <= limit else None
            forced = m.compute_ff_tokens()
            if m.is_error():
                return None
            if forced:
                if not m.consume_tokens(forced):
                    return None
                out += forced
                text += self.tokenizer.decode(forced)
                continue
            state = json_state(text)  # O(len(text)): once a step
            in_string = state[0]
            if in_string and not run_tried and self._quote_blocked(m):
                # A string that cannot close yet: it may want a run of one kind (`\d{10}`
                # somewhere in it, a `minLength`), which no list order makes. Tried once a
                # string.
                run_tried = True
                run = self._closing_run(m, limit - len(out))
                if run is not None and m.consume_tokens(run):
                    out += run
                    text += self.tokenizer.decode(run)
                    continue
            elif not in_string:
                run_tried = False
            # A text chosen twice in a row goes last: a pattern like `[0-9]+-[0-9]+` would
            # otherwise take "0" forever.
            order = _order_for(state)
            if len(out) >= 2 and out[-1] == out[-2]:
                order = tuple(t for t in order if self.ids.get(t) != out[-1]) + order
            choice = next((t for t in order if t in self.ids and self.ids[t] not in avoid
                           and m.validate_tokens([self.ids[t]]) == 1), None)
            token = self.ids[choice] if choice is not None else _first_allowed(m, avoid)
            if token is not None and len(out) >= 2 and token == out[-1] == out[-2]:
                # Only the text just taken twice fits of the list: the grammar wants
                # something the list lacks (the `#` of `[0-9]+#[a-z]+`). From here on no
                # token is taken twice while another is allowed.
                avoid = set(out)
                token, choice = _first_allowed(m, avoid), None
            if avoid and token is not None:
                avoid.add(token)
            if token is None or not m.consume_token(token):
                return None
            out.append(token)
            text += choice if choice is not None else self.tokenizer.decode([token])
        return None


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
