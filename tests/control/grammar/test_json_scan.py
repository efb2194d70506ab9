"""The JSON scanner: every value's end found at the byte it ends, at its path, with where
it and its member began, however the text is split into feeds and spaced."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.control.grammar.json_scan import JsonScanner, Step, ValueEnd

_SCALARS = (st.none() | st.booleans() | st.integers(-10**6, 10**6)
            | st.floats(allow_nan=False, allow_infinity=False)
            | st.text(alphabet=st.characters(codec="utf-8"), max_size=6))
VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(alphabet=st.characters(codec="utf-8"), max_size=4), inner,
                      max_size=4),
    max_leaves=12,
)
SPACE = st.sampled_from(["", " ", "\n", "  ", "\t"])


@st.composite
def spaced(draw: st.DrawFn, value: Any) -> tuple[str, list[tuple[tuple[Step, ...], str]]]:
    """`value` serialized with random whitespace between tokens; also every value in it
    as (path, its text), in the order values end (children before their parent)."""
    ends: list[tuple[tuple[Step, ...], str]] = []

    def write(v: Any, path: tuple[Step, ...]) -> str:
        if isinstance(v, dict):
            parts = []
            for k, item in v.items():
                key = json.dumps(k, ensure_ascii=draw(st.booleans()))
                parts.append(f"{draw(SPACE)}{key}{draw(SPACE)}:{draw(SPACE)}"
                             f"{write(item, (*path, k))}{draw(SPACE)}")
            text = "{" + ",".join(parts) + draw(SPACE) + "}"
        elif isinstance(v, list):
            items = [f"{draw(SPACE)}{write(item, (*path, i))}{draw(SPACE)}"
                     for i, item in enumerate(v)]
            text = "[" + ",".join(items) + draw(SPACE) + "]"
        else:
            text = json.dumps(v, ensure_ascii=draw(st.booleans()))
        ends.append((path, text))
        return text

    return write(value, ()), ends


def scan(data: bytes, cuts: list[int]) -> list[ValueEnd]:
    scanner = JsonScanner()
    ended: list[ValueEnd] = []
    at = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        ended += scanner.feed(data[at:cut])
        at = cut
    return ended


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_value_ends_at_its_path_with_its_text(data: st.DataObject) -> None:
    value = data.draw(VALUES)
    text, expected = data.draw(spaced(value))
    raw = (text + " ").encode()  # a trailing space ends a bare top-level scalar
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=8))
    ended = scan(raw, cuts)
    assert [(e.path, raw[e.start:e.end].decode()) for e in ended] == expected
    for e in ended:
        assert json.loads(raw[e.start:e.end]) == json.loads(raw[e.start:e.end].decode())
        if e.path:  # a member: its key's quote (or the item itself) at member_start
            member = raw[e.member_start:e.end].decode()
            if isinstance(e.path[-1], str):
                key, _ = json.JSONDecoder().raw_decode(member)
                assert key == e.path[-1]
            else:
                assert e.member_start == e.start
            assert e.separator == -1 or raw[e.separator:e.separator + 1] == b","
            assert raw[e.parent_start:e.parent_start + 1] in (b"{", b"[")


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_at_every_prefix_the_values_ended_are_those_whose_text_is_whole(
        data: st.DataObject) -> None:
    text, expected = data.draw(spaced(data.draw(VALUES)))
    raw = text.encode()
    scanner = JsonScanner()
    seen: list[ValueEnd] = []
    for i in range(len(raw)):
        seen += scanner.feed(raw[i:i + 1])
        # Every value reported so far ended within the prefix, in order.
        assert all(e.end <= i + 1 for e in seen)
    assert [(e.path, raw[e.start:e.end].decode()) for e in seen] == [
        (p, t) for p, t in expected if not (p == () and t[0] not in "{[\"")]


def test_members_count_and_separators() -> None:
    raw = b'{"a": [1, 2], "b": {"c": null}}'
    ended = scan(raw, [3, 9, 20])
    by_path = {e.path: e for e in ended}
    assert list(by_path) == [("a", 0), ("a", 1), ("a",), ("b", "c"), ("b",), ()]
    assert by_path[("a", 1)].count == 2 and by_path[("a", 1)].separator == raw.index(b",")
    b = by_path[("b",)]
    assert (b.count, raw[b.member_start:b.member_start + 3]) == (2, b'"b"')
    assert raw[b.separator:b.separator + 1] == b"," and b.separator < b.member_start
    assert by_path[()].parent_start == -1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="abc_", min_size=1, max_size=6),
                          st.dictionaries(st.text(alphabet="xyz{}<>", max_size=3), VALUES,
                                          max_size=3)), min_size=1, max_size=3),
       st.lists(st.integers(1, 7), min_size=1, max_size=40))
def test_a_call_scanner_follows_each_call_s_json_and_skips_the_rest(
        calls: list[tuple[str, dict[str, Any]]], splits: list[int]) -> None:
    """Over a tool-call output, the values of each call's JSON object at their paths with
    their texts (offsets the output's), whatever the feeds (of at most a few bytes, as
    tokens are); and the name of the tool the call being written names."""
    from aici_cli.control import tool_calls
    from aici_cli.control.grammar.keyword_guard import CallScanner

    text = tool_calls.calls_text([tool_calls.ToolCall(n, json.dumps(a)) for n, a in calls])
    data = text.encode()
    scanner, ends, at, names = CallScanner(), [], 0, []
    while at < len(data):
        size = splits[len(ends) % len(splits)]
        for end in scanner.feed(data[at : at + size]):
            ends.append(end)
            if end.path and end.path[0] == "arguments":
                names.append(scanner.name)
        at += size
    assert bytes(scanner.text) == data
    want: list[tuple[tuple[Step, ...], Any]] = []
    for name, args in calls:
        call = json.dumps({"name": name, "arguments": args}).encode()
        want += [(e.path, json.loads(call[e.start : e.end])) for e in scan(call, [])]
    assert [(e.path, json.loads(data[e.start : e.end])) for e in ends] == want
    # Every argument value was read while its call's name was known.
    assert names == [n for n, a in calls for e in scan(json.dumps(
        {"name": n, "arguments": a}).encode(), []) if e.path and e.path[0] == "arguments"]
