"""The host-side per-step contract between the engine and a sequence's controller.

Each step the engine appends tokens to a row (one sampled token, or fast-forward tokens)
and tells the row's controller; the controller answers with a `Directive`: tokens to
fast-forward next (appended without sampling, fed to the model in one pass), tokens to
take back (backtrack), or stop. Before the engine samples, the controller's token mask
says which tokens may come next.

Every capability the engine uses is a method of `Controller`; `ControllerBase` gives the
defaults of a controller that has none of the optional ones (no grammar matcher, no
drafts, nothing to release), so the engine never probes a controller for attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import llguidance
import torch

from aici_cli.control.line_scope import LineScope
from aici_cli.core.errors import ControllerError


@dataclass(frozen=True)
class Directive:
    """A controller's answer after the engine appended tokens."""

    ff_tokens: tuple[int, ...] = ()  # fast-forward: append these next, without sampling
    backtrack: int = 0  # first remove this many output tokens
    stop: bool = False  # the sequence is complete
    # The finish_reason of that stop: "stop", or "length" (the controller ended the
    # sequence without finishing its value, as `max_tokens` would: a loop it cut).
    finish: str = "stop"
    # Split the sequence into this many branches after the tokens above (0: no fork). The
    # engine then asks `fork` for the other branches' controllers and `enter_branch`
    # of each, this one included (it continues as branch 0).
    fork: int = 0


CONTINUE = Directive()


class Controller(Protocol):
    """One per sequence. Methods raise `ControllerError`; nothing else may escape."""

    def start(self, prompt: Sequence[int]) -> Directive:
        """Called once at admission; may fast-forward the first output tokens."""
        ...

    def advance(self, tokens: Sequence[int]) -> Directive:
        """`tokens` were sampled and appended; returns what comes next."""
        ...

    def on_eos(self) -> Directive | None:
        """End-of-sequence was sampled. None: the sequence ends normally; a directive:
        the controller took it as the end of a segment only, and the sequence goes on."""
        ...

    def matcher(self) -> llguidance.LLMatcher | None:
        """The llguidance matcher that constrains the next token, if there is one: the
        engine fills those masks for the whole batch at once (in place of `fill_mask`)."""
        ...

    def fill_mask(self, out: torch.Tensor) -> bool | Directive:
        """Write the allowed-token bitmask (int32 [words], bit i = token i) into `out`.

        Called (for controllers whose `matcher()` is None) from a worker thread while the
        forward pass runs, so a controller may do its per-step work here. Returns False
        when every token is allowed (the engine then skips masking the row). It may
        instead return a `Directive` (splice or stop decided from the tokens so far): the
        engine then applies it in place of sampling for this row.
        """
        ...

    def matcher_fault(self) -> ControllerError:
        """The error of a `matcher()` that failed while the engine filled its mask."""
        ...

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a draft) the controller would accept as sampled from its
        current state, consuming nothing; 0 when it cannot tell in advance."""
        ...

    def report(self, text: str) -> dict[str, Any]:
        """Fields to merge into the result line when the sequence ends (e.g. json, valid)."""
        ...

    def stats(self) -> dict[str, float | bool | str]:
        """Extra figures for the result's `stats`: where `controller_ms` went (ms), or
        flags such as `closed_early`."""
        ...

    def close(self) -> None:
        """The sequence ended: release what the controller holds (a guest instance)."""
        ...

    def join_line(self, scope: LineScope) -> None:
        """Before `start`: what the line's sequences share (storage, the line's outputs)."""
        ...

    def fork(self, n: int) -> list[Controller]:
        """After a directive with `fork=n`: the controllers of branches 1..n-1, each in
        the state this one is in now. Raises ControllerError (the line then ends)."""
        ...

    def enter_branch(self, index: int) -> Directive:
        """The first decision of branch `index` after a fork (branch 0 is the controller
        that forked)."""
        ...


class ControllerBase:
    """Defaults of the optional capabilities: no grammar matcher, no drafts, no extra
    stats, nothing to release; end-of-sequence ends the sequence."""

    def start(self, prompt: Sequence[int]) -> Directive:
        return CONTINUE

    def advance(self, tokens: Sequence[int]) -> Directive:
        return CONTINUE

    def on_eos(self) -> Directive | None:
        return None

    def matcher(self) -> llguidance.LLMatcher | None:
        return None

    def fill_mask(self, out: torch.Tensor) -> bool | Directive:
        return False

    def matcher_fault(self) -> ControllerError:
        return ControllerError("internal_error", "the controller's mask failed")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return 0

    def report(self, text: str) -> dict[str, Any]:
        return {}

    def stats(self) -> dict[str, float | bool | str]:
        return {}

    def close(self) -> None:
        return None

    def join_line(self, scope: LineScope) -> None:
        return None

    def fork(self, n: int) -> list[Controller]:
        raise ControllerError("bad_action", "this controller cannot fork")

    def enter_branch(self, index: int) -> Directive:
        raise ControllerError("bad_action", "this controller cannot fork")
