"""Token masks: filled beside the forward pass, applied to the logits in place.

A row's mask is a bitmask (int32 [words], bit t = token t allowed). Rows with an
llguidance matcher (built-in grammars, wasm grammar segments) are filled in one parallel
call; other controllers fill their own row. Applying means `masked_fill` with -inf where
a token is disallowed: the words are complemented and unpacked in one pass over [b, V]
(about 0.5 ms a row at V=262k; cheaper than unpacking, then comparing).

This is the one place the model runner calls into a row's controller: through the
narrow `MaskSource` view the plan gives it (the controller's `matcher`, `fill_mask` and
`matcher_fault`), on the mask worker thread, beside the forward pass. It never sees a
generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import llguidance
import numpy as np
import torch

from aici_cli.control.base import Directive
from aici_cli.core.errors import ControllerError


class MaskSource(Protocol):
    """What fills a row's mask: the part of `control.base.Controller` a step calls while
    it runs (on the mask worker thread)."""

    def matcher(self) -> llguidance.LLMatcher | None: ...

    def fill_mask(self, out: torch.Tensor) -> bool | Directive: ...

    def matcher_fault(self) -> ControllerError: ...


def controller_fault(e: Exception) -> tuple[str, str]:
    """(type, message) of a controller failure; anything but a ControllerError is a bug in
    the host, reported as such but still confined to its sequence."""
    if isinstance(e, ControllerError):
        return e.type, e.message
    return "internal_error", f"{type(e).__name__}: {e}"


@dataclass
class MaskVerdict:
    """What the mask worker hands back, by position in the step's rows."""

    disallowed: torch.Tensor | None  # [b, V] bool; None: every token allowed everywhere
    failed: dict[int, ControllerError]
    deferred: dict[int, Directive]  # the controller answered with a directive, not a mask


class TokenMasks:
    """The batch's bitmask buffer and the parallel llguidance filler."""

    def __init__(self, rows: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        # bitmask[i]: allowed tokens of cache row i (bit t = token t).
        self.bitmask = torch.zeros((rows, self.words), dtype=torch.int32)
        self.executor = llguidance.LLExecutor()

    def fill(self, rows: Sequence[int], sources: Sequence[MaskSource | None]) -> MaskVerdict:
        """Runs in the worker thread, beside the forward pass. `sources[k]` fills row
        `rows[k]`'s mask (None: the row is not masked). Everything by position in `rows`:
        the disallowed tokens, the controllers that failed, and the rows whose controller
        answered with a directive instead of a mask."""
        failed: dict[int, ControllerError] = {}
        deferred: dict[int, Directive] = {}
        grammar: list[tuple[llguidance.LLMatcher, int]] = []
        grammar_k: list[tuple[int, MaskSource]] = []
        custom: list[tuple[int, int, MaskSource]] = []
        for k, (row, source) in enumerate(zip(rows, sources)):
            if source is None:
                continue
            matcher = source.matcher()
            if matcher is not None:  # filled in parallel with the others
                grammar.append((matcher, row))
                grammar_k.append((k, source))
            else:
                custom.append((k, row, source))
        if not grammar and not custom:
            return MaskVerdict(None, failed, deferred)
        if grammar:
            self.executor.unsafe_compute_mask_ptr(
                grammar, self.bitmask.data_ptr(), self.words * 4, self.bitmask.shape[0]
            )
            # A matcher that failed computing its mask (a per-step limit) allows only EOS:
            # end the row with its error here rather than sample that EOS.
            for (matcher, _), (k, controller) in zip(grammar, grammar_k):
                if matcher.is_error():
                    failed[k] = controller.matcher_fault()
        constrained = {row for _, row in grammar}
        for k, row, controller in custom:
            try:
                answer = controller.fill_mask(self.bitmask[row])
            except Exception as e:
                failed[k] = ControllerError(*controller_fault(e))
                continue
            if isinstance(answer, Directive):
                deferred[k] = answer
            elif answer:
                constrained.add(row)
        return MaskVerdict(self._disallowed(rows, constrained), failed, deferred)

    def _disallowed(self, rows: Sequence[int], constrained: set[int]) -> torch.Tensor:
        """[b, V] bool, True where a token is disallowed; unconstrained rows all False."""
        words = ~self.bitmask.numpy()[list(rows)]
        for k, row in enumerate(rows):
            if row not in constrained:
                words[k] = 0
        disallowed = np.unpackbits(words.view(np.uint8), axis=1, count=self.vocab_size,
                                   bitorder="little").view(np.bool_)
        return torch.from_numpy(disallowed)


def apply_masks(logits: torch.Tensor, verdict: MaskVerdict) -> torch.Tensor:
    """Mask `logits` [b, V] in place; returns each row's greedy pick [b]. A row whose
    mask allows nothing cannot continue: it joins `verdict.failed` instead of sampling."""
    disallowed = verdict.disallowed
    if disallowed is not None:
        logits.masked_fill_(disallowed.to(logits.device, non_blocking=True), float("-inf"))
    best, greedy = logits.max(dim=-1)  # [b]: the greedy pick, and whether any is allowed
    if disallowed is not None:
        for k in torch.isneginf(best).nonzero().flatten().tolist():
            if k not in verdict.deferred:
                verdict.failed.setdefault(
                    k, ControllerError("empty_mask", "the mask allows no token"))
    return greedy
