"""The host-side per-step contract between the engine and a sequence's controller.

Each step the engine appends tokens to a row (one sampled token, or forced ones) and tells
the row's controller; the controller answers with a `Directive`: tokens to force next
(fast-forward: appended without sampling, fed to the model in one pass), tokens to take
back (backtrack), or stop. Before the engine samples, the controller's token mask says
which tokens may come next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Directive:
    """A controller's answer after the engine appended tokens."""

    forced: tuple[int, ...] = ()  # append these next, without sampling
    backtrack: int = 0  # first remove this many output tokens
    stop: bool = False  # the sequence is complete


CONTINUE = Directive()


@dataclass
class ControllerReport:
    """What a controller adds to its sequence's result line."""

    fields: dict[str, Any] = field(default_factory=dict)


class Controller(Protocol):
    """One per sequence. Methods raise `ControllerError`; nothing else may escape."""

    def start(self, prompt: Sequence[int]) -> Directive:
        """Called once at admission; may force the first output tokens."""
        ...

    def advance(self, tokens: Sequence[int]) -> Directive:
        """`tokens` were sampled and appended; returns what comes next."""
        ...

    def fill_mask(self, out: torch.Tensor) -> bool | Directive:
        """Write the allowed-token bitmask (int32 [words], bit i = token i) into `out`.

        Returns False when every token is allowed (the engine then skips masking the row).
        Called from a worker thread while the forward pass runs, so a controller may do its
        per-step work here. It may instead return a `Directive` (splice or stop decided from
        the tokens so far): the engine then applies it in place of sampling for this row.
        """
        ...

    def report(self, text: str) -> dict[str, Any]:
        """Fields to merge into the result line when the sequence ends (e.g. json, valid)."""
        ...
