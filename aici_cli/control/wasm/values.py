"""Conversion between wasmtime-py's values and the host's action types (`actions.py`).

The rest of the host never sees wasmtime's `Record`/`Variant` shapes. Every value a guest
returns is checked here against the vocabulary and the contract: a malformed one is a
`bad_action` ControllerError (the guest stays usable).

wasmtime-py represents a variant value as `Variant(tag, payload)` only when two of its
cases' Python classes overlap; otherwise the value is its bare payload (None for a
payload-less case). Readers accept both shapes, so a wasmtime-py that changes its mind
still converts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from wasmtime.component import Record, Variant

from aici_cli.control.actions import (
    Action,
    Fork,
    Generate,
    Sample,
    Segment,
    Splice,
    StepInput,
    Stop,
    TokenSet,
    TokenSetKind,
)
from aici_cli.control.wasm.faults import clip
from aici_cli.control.wasm.services import HostServices
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import ControllerError


@dataclass(frozen=True)
class Lowering:
    """How wasmtime-py wants the component's variant-like values that the host builds:
    tagged `Variant`s or bare payloads (see `signatures.is_tagged`)."""

    segment_text: bool = False  # step-input.segment-text: option<string>
    branch: bool = False  # step-input.branch: option<u32> (0.2.0)
    tokens_matching: bool = False  # tokens-matching's result<u32, string>
    storage_get: bool = False  # storage get's option<list<u8>> (0.2.0)
    tools: bool = False  # whether the component imports aici:tools (linked only then)
    call_tool: bool = False  # call-tool's result<string, string>



def _option(value: Any, tagged: bool) -> Any:
    if not tagged:
        return value
    return Variant("none") if value is None else Variant("some", value)


def step_record(inp: StepInput, text_tagged: bool, branch_tagged: bool | None) -> Record:
    """`inp` as the `step-input` record wasmtime-py lowers; `text_tagged` /
    `branch_tagged`: whether its options are `Variant`s (see `signatures.is_tagged`);
    `branch_tagged` None: a 0.1.0 record, which has no `branch` field."""
    # wasmtime-py reads record fields by their WIT names (hyphens included) and wants
    # a `list`, not a tuple, for `list<u32>`.
    step = Record()
    fields: list[tuple[str, Any]] = [
        ("backtrack", int(inp.backtrack)),
        ("tokens", [int(t) for t in inp.tokens]),
        ("segment-text", _option(inp.segment_text, text_tagged)),
    ]
    if branch_tagged is not None:
        fields.append(("branch", _option(inp.branch, branch_tagged)))
    for name, value in fields:
        setattr(step, name, value)
    return step


def split_result(value: Any) -> tuple[bool, Any]:
    """`result<action, string>`: untagged today (an action is a Variant, an error a str)."""
    if isinstance(value, Variant) and value.tag in ("ok", "err"):
        return value.tag == "ok", value.payload
    if isinstance(value, str):
        return False, value
    return True, value


def _case(value: Any, infer: Callable[[Any], str | None], what: str) -> tuple[str, Any]:
    """(tag, payload) of a variant value in either shape wasmtime-py returns."""
    if isinstance(value, Variant):
        return value.tag, value.payload
    tag = infer(value)
    if tag is None:
        raise ControllerError("bad_action", f"cannot read {what} from {clip(repr(value), 200)}")
    return tag, value


def _infer_action(v: Any) -> str | None:
    if v is None:
        return "stop"
    if isinstance(v, int):
        return "fork"
    if isinstance(v, Record):
        if hasattr(v, "max-tokens"):
            return "generate"
        if hasattr(v, "ff-tokens"):
            return "splice"
    return None


def _infer_token_set(v: Any) -> str | None:
    return "all" if v is None else None


def _infer_grammar(v: Any) -> str | None:
    return "choice" if isinstance(v, list) else None


def to_action(value: Any, vocab: int, services: HostServices) -> Action:
    tag, payload = _case(value, _infer_action, "an action")
    if tag == "stop":
        return Stop()
    if tag == "fork":
        n = int(payload)
        if n < 2:
            raise ControllerError("bad_action", f"fork({n}): a fork makes at least 2 branches")
        return Fork(n)
    if tag == "sample":
        return Sample(to_token_set(payload, vocab, services))
    if tag == "splice":
        ff = _token_ids(getattr(payload, "ff-tokens"), vocab, "splice ff-tokens")
        return Splice(backtrack=int(payload.backtrack), ff_tokens=ff)
    if tag == "generate":
        return Generate(_to_segment(payload))
    raise ControllerError("bad_action", f"unknown action {tag!r}")


def _to_segment(payload: Any) -> Segment:
    max_tokens = int(getattr(payload, "max-tokens"))
    if max_tokens <= 0:
        raise ControllerError("bad_action", "generate: segment max-tokens is 0")
    grammar = payload.grammar
    if isinstance(grammar, Variant) and grammar.tag in ("none", "some"):
        grammar = grammar.payload  # option in its tagged shape
    return Segment(
        grammar=None if grammar is None else _to_constraint(grammar),
        max_tokens=max_tokens,
        stop=tuple(str(s) for s in payload.stop),
    )


def to_token_set(value: Any, vocab: int, services: HostServices) -> TokenSet:
    tag, payload = _case(value, _infer_token_set, "a token set")
    if tag == "all":
        return TokenSet("all")
    if tag in ("allow", "deny"):
        ids = _token_ids(payload, vocab, f"sample {tag}")
        if tag == "allow" and not ids:
            raise ControllerError("bad_action", "sample: the allow-list is empty")
        return TokenSet(cast(TokenSetKind, tag), ids)
    if tag == "bitmask":
        return TokenSet("bitmask", _bitmask_words(payload, vocab))
    if tag in ("host-set", "not-host-set"):
        handle = int(payload)
        if not services.has_host_set(handle):
            raise ControllerError("bad_action", f"sample: unknown host-set handle {handle}")
        return TokenSet(cast(TokenSetKind, tag), handle=handle)
    raise ControllerError("bad_action", f"unknown token set {tag!r}")


def _bitmask_words(payload: Any, vocab: int) -> tuple[int, ...]:
    """The u32 words of a `bitmask` token set: one bit per token id of the vocabulary."""
    words = tuple(int(w) for w in payload)
    need = (vocab + 31) // 32
    if len(words) != need:
        raise ControllerError(
            "bad_action",
            f"sample: bitmask has {len(words)} words; a vocabulary of {vocab} needs {need}",
        )
    tail = vocab % 32
    last = words[-1] if words else 0
    past = last >> tail if tail else 0  # the bits of ids >= vocab, in the last word
    if not (any(words[:-1]) or last ^ (past << tail)):
        raise ControllerError("bad_action", "sample: the bitmask allows no token")
    if past:
        # A guest that sets them has its vocabulary size wrong (e.g. a padded logits
        # size); for a model with padded logits they would allow tokens with no text.
        extra = (past & -past).bit_length() - 1  # the lowest such bit
        raise ControllerError(
            "bad_action",
            f"sample: bitmask allows token id {vocab + extra}, outside the vocabulary "
            f"(size {vocab})",
        )
    return words


def _to_constraint(value: Any) -> Constraint:
    """A segment's WIT `grammar` as the constraint the built-in controllers enforce."""
    tag, payload = _case(value, _infer_grammar, "a grammar")
    if tag == "choice":
        return Constraint("choice", [str(s) for s in payload])
    if tag == "json-schema":
        try:
            return Constraint("json_schema", json.loads(str(payload)))
        except ValueError as e:
            raise ControllerError("bad_action", f"segment JSON schema is not JSON: {e}") from None
    if tag == "regex":
        return Constraint("regex", str(payload))
    if tag == "lark":
        return Constraint("lark", str(payload))
    raise ControllerError("bad_action", f"unknown grammar {tag!r}")


def _token_ids(values: Any, vocab: int, what: str) -> tuple[int, ...]:
    ids = tuple(int(t) for t in values)
    if ids and max(ids) >= vocab:
        t = next(t for t in ids if t >= vocab)
        raise ControllerError(
            "bad_action", f"{what}: token id {t} is outside the vocabulary (size {vocab})"
        )
    return ids
