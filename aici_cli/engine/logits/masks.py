"""Token masks: filled beside the forward pass, applied to the logits in place.

A row's mask is a bitmask (int32 [words], bit t = token t allowed). Rows with an
llguidance matcher (built-in grammars, wasm grammar segments) are filled in one parallel
call; other controllers fill their own row. The packed words are unpacked bitwise where
the logits are (`unpack_bits`: on the CPU in the worker, beside the pass; on an
accelerator there, after one non-blocking copy of the words from pinned memory, never
unpacked on the host), and applying is one `masked_fill` with -inf where a token is not
allowed. Whether a row allows no token at all is computed there too and read back with
the step's tokens (`apply_masks`, `empty_masks`).

This is the one place the model runner calls into a row's controller: through the
narrow `MaskSource` view the plan gives it (the controller's `matcher`, `fill_mask` and
`matcher_fault`), on the mask worker thread, beside the forward pass. It never sees a
generation.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import llguidance
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

    # [b, V] bool on the logits' device, True where a token is allowed (unconstrained rows:
    # all True); None: no row is constrained. On the CPU the worker unpacks it beside the
    # pass; on an accelerator it is unpacked there, from `words`, by `allowed_on`.
    allowed: torch.Tensor | None
    failed: dict[int, ControllerError]
    deferred: dict[int, Directive]  # the controller answered with a directive, not a mask
    # [b, W] int32, the step rows' bitmask (all ones where unconstrained), in pinned memory
    # where it crosses to an accelerator; None where `allowed` is already unpacked.
    words: torch.Tensor | None = None
    constrained: frozenset[int] = frozenset()  # positions whose mask applies

    def allowed_on(self, device: torch.device, vocab_size: int) -> torch.Tensor | None:
        """The [b, V] allowed tokens on `device`: the packed words cross over in one
        non-blocking copy (b W int32: 1/8 of the unpacked bools' bytes) and are unpacked
        there; nothing is read back."""
        if self.allowed is None and self.words is not None:
            self.allowed = unpack_bits(self.words.to(device, non_blocking=True), vocab_size)
        return self.allowed


# Bit j of a byte, for the unpacking below: [8] uint8 per device.
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[b, W] int32 bitmask (bit t of word t // 32: token t allowed) -> [b, V] bool, on
    the words' device, bitwise: the words as little-endian bytes (byte j of word w holds
    tokens 32 w + 8 j ...), each shifted by 0..7 and masked to its low bit. [b, 4W, 8]
    uint8 of work, no host read."""
    assert sys.byteorder == "little", "the bitmask's bytes are read little-endian"
    shifts = _SHIFTS.get(words.device)
    if shifts is None:
        shifts = _SHIFTS[words.device] = torch.arange(8, dtype=torch.uint8,
                                                      device=words.device)
    b = words.shape[0]
    as_bytes = words.contiguous().view(torch.uint8)  # [b, 4W]
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1  # [b, 4W, 8]
    return bits.view(b, -1)[:, :vocab_size].bool()


class TokenMasks:
    """The batch's bitmask buffer and the parallel llguidance filler. `device`: where the
    logits are: on the CPU the worker unpacks the masks beside the pass, elsewhere it
    leaves the packed words in pinned memory for the step to send over."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = device if device is not None else torch.device("cpu")
        # bitmask[i]: allowed tokens of cache row i (bit t = token t).
        self.bitmask = torch.zeros((rows, self.words), dtype=torch.int32)
        # The step's rows' words, gathered for the copy over: pinned on an accelerator.
        self.staged = torch.zeros((rows, self.words), dtype=torch.int32,
                                  pin_memory=self.device.type == "cuda")
        self.executor = llguidance.LLExecutor()

    def fill(self, rows: Sequence[int], sources: Sequence[MaskSource | None]) -> MaskVerdict:
        """Runs in the worker thread, beside the forward pass. `sources[k]` fills row
        `rows[k]`'s mask (None: the row is not masked). Everything by position in `rows`:
        the allowed tokens, the controllers that failed, and the rows whose controller
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
        constrained = {k for k, _ in grammar_k}
        for k, row, controller in custom:
            try:
                answer = controller.fill_mask(self.bitmask[row])
            except Exception as e:
                failed[k] = ControllerError(*controller_fault(e))
                continue
            if isinstance(answer, Directive):
                deferred[k] = answer
            elif answer:
                constrained.add(k)
        words = self._stage(rows, constrained)
        if self.device.type == "cpu":
            return MaskVerdict(unpack_bits(words, self.vocab_size), failed, deferred,
                               constrained=frozenset(constrained))
        return MaskVerdict(None, failed, deferred, words, frozenset(constrained))

    def _stage(self, rows: Sequence[int], constrained: set[int]) -> torch.Tensor:
        """[b, W] int32: the step rows' words, all ones (every token) where a row is not
        constrained; a view of the staging buffer (pinned on an accelerator)."""
        words = self.staged[: len(rows)]
        torch.index_select(self.bitmask, 0, torch.tensor(list(rows), dtype=torch.long),
                           out=words)
        free = [k for k in range(len(rows)) if k not in constrained]
        if free:
            words[free] = -1
        return words


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor | None) -> tuple[
        torch.Tensor, torch.Tensor | None]:
    """Mask `logits` [b, V] in place with `allowed` ([b, V] bool on its device, None: no
    mask); returns each row's greedy pick [b] and, with a mask, whether it allows no token
    at all [b] bool: both on the device, read back with the step's tokens (a row whose
    mask allows nothing cannot continue; the caller fails it instead of sampling)."""
    if allowed is None:
        return logits.argmax(dim=-1), None
    logits.masked_fill_(~allowed, float("-inf"))
    best, greedy = logits.max(dim=-1)  # [b]: the greedy pick, and whether any is allowed
    return greedy, torch.isneginf(best)


def empty_masks(verdict: MaskVerdict, empty: Sequence[bool]) -> None:
    """The rows whose mask allowed no token (read back with the step's tokens) join
    `verdict.failed`, but those that answered with a directive."""
    for k, none_allowed in enumerate(empty):
        if none_allowed and k not in verdict.deferred:
            verdict.failed.setdefault(
                k, ControllerError("empty_mask", "the mask allows no token"))
