"""Where a JSON text being written stands: its open containers, the path of the value
being written, and each value's end as it is reached (`JsonScanner`).

The keyword guard (keyword_guard.py) checks each value when it ends, so it needs to know,
byte by byte, when a value ends, at which path, and where it (and the member or item it
belongs to) began. The scanner works on bytes: outside strings JSON is ASCII, so every
offset it reports is a character boundary, and the bytes between two offsets are the
UTF-8 text of a value. It assumes well-formed JSON, as the grammar writes it; it does not
validate. A number or literal ends at the byte after it (`1` may yet become `12`), so a
scalar that is the whole text never ends.

Cost: a few Python operations per byte fed; no parsing (a key's text is decoded once,
when its string closes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

Step = str | int  # an object member's key, or an array item's index
_OPEN = frozenset(b"{[")
_CLOSE = frozenset(b"}]")
_SPACE = frozenset(b" \t\r\n")
_QUOTE, _BACKSLASH, _COMMA, _COLON, _OBJECT = ord('"'), ord("\\"), ord(","), ord(":"), ord("{")


@dataclass
class Frame:
    """An open container."""

    kind: int  # ord("{") or ord("[")
    start: int  # offset of its bracket
    count: int = 0  # members (items) ended so far
    key: str = ""  # an object's current member's key
    member_start: int = -1  # where the current member (its key) or item began
    separator: int = -1  # offset of the last comma seen in it
    wants_key: bool = False  # an object after `{` or `,`: a string here is a key
    keys: set[bytes] = field(default_factory=set)  # an object's keys so far, as written

    @property
    def step(self) -> Step:
        return self.key if self.kind == _OBJECT else self.count


@dataclass(frozen=True)
class ValueEnd:
    """A value ended: it spans bytes [start, end) and sits at `path`. As a member or
    item of its parent: the member began at `member_start` (its key's quote, or the item's
    first byte), after the comma at `separator` (-1: the first one). `kind`: its first
    byte (`{`, `[`, `"`, or the first byte of a number or literal). `parent_start`: the
    offset of the parent's bracket (-1 for the whole text); `count`: the parent's members
    now ended, this one included."""

    path: tuple[Step, ...]
    start: int
    end: int
    kind: int
    member_start: int
    separator: int
    parent_start: int
    count: int


@dataclass
class JsonScanner:
    """Feed it the text's bytes in order (`feed`); it answers the values each feed ended."""

    stack: list[Frame] = field(default_factory=list)
    text: bytearray = field(default_factory=bytearray)
    _string_start: int = -1  # offset of an open string's quote (-1: none open)
    _is_key: bool = False
    _escaped: bool = False
    _bare_start: int = -1  # offset of an open number or literal (-1: none open)
    repeated_key: int = -1  # offset of the last key written twice in its object (-1: none)

    def feed(self, data: bytes) -> list[ValueEnd]:
        ended: list[ValueEnd] = []
        base = len(self.text)
        self.text += data
        for i, b in enumerate(data, base):
            if self._string_start >= 0:
                self._in_string(b, i, ended)
                continue
            if self._bare_start >= 0:
                if b not in _SPACE and b not in _CLOSE and b != _COMMA:
                    continue
                start, self._bare_start = self._bare_start, -1
                ended.append(self._ended(start, i))
            self._structural(b, i, ended)
        return ended

    def open_key(self) -> bytes | None:
        """The bytes of the key being written (after its opening quote), or None outside
        a key."""
        if self._string_start < 0 or not self._is_key:
            return None
        return bytes(self.text[self._string_start + 1 :])

    def in_string(self) -> bool:
        """Whether the text ends inside a string (a key or a value)."""
        return self._string_start >= 0

    def _in_string(self, b: int, i: int, ended: list[ValueEnd]) -> None:
        if self._escaped:
            self._escaped = False
        elif b == _BACKSLASH:
            self._escaped = True
        elif b == _QUOTE:
            start, self._string_start = self._string_start, -1
            if self._is_key:
                self.stack[-1].key = json.loads(bytes(self.text[start : i + 1]))
                key, keys = bytes(self.text[start + 1 : i]), self.stack[-1].keys
                if key in keys:
                    self.repeated_key = start
                keys.add(key)
            else:
                ended.append(self._ended(start, i + 1))

    def _structural(self, b: int, i: int, ended: list[ValueEnd]) -> None:
        top = self.stack[-1] if self.stack else None
        if b in _SPACE or b == _COLON:
            return
        if b == _COMMA:
            if top is not None:
                top.separator = i
                top.member_start = -1
                top.wants_key = top.kind == _OBJECT
            return
        if b in _CLOSE:
            frame = self.stack.pop()
            ended.append(self._ended(frame.start, i + 1))
            return
        # A value (or a key) begins here.
        self._is_key = top is not None and top.wants_key
        if top is not None and top.member_start < 0:
            top.member_start = i
        if top is not None:
            top.wants_key = False
        if b == _QUOTE:
            self._string_start = i
        elif b in _OPEN:
            self.stack.append(Frame(b, i, wants_key=b == _OBJECT))
        else:
            self._bare_start = i

    def _ended(self, start: int, end: int) -> ValueEnd:
        path = tuple(f.step for f in self.stack)
        parent = self.stack[-1] if self.stack else None
        if parent is None:
            return ValueEnd(path, start, end, self.text[start], start, -1, -1, 1)
        parent.count += 1
        return ValueEnd(path, start, end, self.text[start], parent.member_start,
                        parent.separator, parent.start, parent.count)
