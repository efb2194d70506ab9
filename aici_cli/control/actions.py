"""Python mirrors of the WIT contract's types (`wit/controller.wit`).

The wasm host converts wasmtime values to these at the boundary, so the rest of the host
never sees wasmtime's `Record`/`Variant` shapes. A segment's WIT `grammar` becomes the
`Constraint` the built-in controllers enforce, so both kinds of controller share one
grammar type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from aici_cli.core.constraint import Constraint

TokenSetKind = Literal["all", "allow", "deny", "bitmask", "host-set", "not-host-set"]


@dataclass(frozen=True)
class TokenSet:
    kind: TokenSetKind
    tokens: tuple[int, ...] = ()  # allow / deny: token ids; bitmask: u32 words
    handle: int = 0  # host-set / not-host-set


@dataclass(frozen=True)
class Segment:
    grammar: Constraint | None
    max_tokens: int
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sample:
    tokens: TokenSet


@dataclass(frozen=True)
class Generate:
    segment: Segment


@dataclass(frozen=True)
class Splice:
    backtrack: int
    ff_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Fork:
    """Split the sequence into `branches` (>= 2) that share every token so far."""

    branches: int


Action = Sample | Generate | Splice | Stop | Fork


@dataclass(frozen=True)
class StepInput:
    backtrack: int = 0
    tokens: tuple[int, ...] = field(default_factory=tuple)
    segment_text: str | None = None
    branch: int | None = None  # the first call after a fork: this branch's index
