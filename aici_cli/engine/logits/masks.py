"""Token masks: filled beside the forward pass, applied to the logits in place.

A row's mask is a bitmask (int32 [words], bit t = token t allowed). Rows with an
llguidance matcher (built-in grammars, wasm grammar segments) are filled in one parallel
call; other controllers fill their own row, a line's rows in order and the lines in
parallel on a few threads (`TokenMasks._fill_custom`). The packed words are unpacked bitwise where
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

import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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


# Threads that fill the guests' masks: one a core, up to 8 (a step's guests are short
# calls; more threads than cores only queue).
CUSTOM_THREADS = max(2, min(8, os.cpu_count() or 2))

# Bit j of a byte, for the unpacking below: [8] uint8 per device.
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[b, W] int32 bitmask (bit t of word t // 32: token t allowed) -> [b, V] bool, on
    the words' device, bitwise: the words as little-endian bytes (byte j of word w holds
    tokens 32 w + 8 j ...), each shifted by 0..7 and masked to its low bit ([b, 4W, 8]
    uint8 of work, no host read); on the CPU numpy's `unpackbits` of the same bytes."""
    assert sys.byteorder == "little", "the bitmask's bytes are read little-endian"
    if words.device.type == "cpu":  # numpy's unpacking, one pass: ~15x torch's ops here
        unpacked = np.unpackbits(words.contiguous().numpy().view(np.uint8), axis=1,
                                 count=vocab_size, bitorder="little")
        return torch.from_numpy(unpacked.view(np.bool_))
    return unpack_bits_bitwise(words, vocab_size)


def unpack_bits_bitwise(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`unpack_bits` in torch's bitwise ops, on any device (an accelerator's path)."""
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
        self.pool: ThreadPoolExecutor | None = None  # the guests' masks, in parallel

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
        for k, answer in self._fill_custom(custom):
            if isinstance(answer, ControllerError):
                failed[k] = answer
            elif isinstance(answer, Directive):
                deferred[k] = answer
            elif answer:
                constrained.add(k)
        words = self._stage(rows, constrained)
        if self.device.type == "cpu":
            return MaskVerdict(unpack_bits(words, self.vocab_size), failed, deferred,
                               constrained=frozenset(constrained))
        return MaskVerdict(None, failed, deferred, words, frozenset(constrained))

    def _fill_custom(self, custom: Sequence[tuple[int, int, MaskSource]]
                     ) -> list[tuple[int, bool | Directive | ControllerError]]:
        """The rows whose controller fills its own mask (WebAssembly guests, custom
        controllers), each line's rows in order on one thread and the lines in parallel
        (a guest's wasm runs without the GIL): 64 guests in a batch no longer wait on each
        other. The rows of one line share its scope (storage, a fork's branches), so they
        are never called at once."""
        by_line: dict[int, list[tuple[int, int, MaskSource]]] = {}
        for item in custom:
            scope = getattr(item[2], "scope", None)
            by_line.setdefault(id(scope) if scope is not None else -1 - item[0], []).append(item)
        groups = list(by_line.values())
        if len(groups) < 2:
            return [answer for group in groups for answer in self._fill_line(group)]
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=CUSTOM_THREADS,
                                           thread_name_prefix="aici-guest-mask")
        return [answer for done in self.pool.map(self._fill_line, groups) for answer in done]

    def _fill_line(self, group: Sequence[tuple[int, int, MaskSource]]
                   ) -> list[tuple[int, bool | Directive | ControllerError]]:
        out: list[tuple[int, bool | Directive | ControllerError]] = []
        for k, row, controller in group:
            try:
                out.append((k, controller.fill_mask(self.bitmask[row])))
            except Exception as e:
                out.append((k, ControllerError(*controller_fault(e))))
        return out

    def close(self) -> None:
        """Stops the guests' mask threads (started at the first step that needs them)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

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


def allowed_mass(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[w, V] logits (before the masks) and their rows' allowed tokens -> [w]: the
    probability the softmax gives the allowed tokens, on the device. One exp pass over
    [w, V] in float32 and two sums (~half of two log-sum-exps)."""
    x = logits.float()
    e = (x - x.amax(dim=-1, keepdim=True)).exp_()
    return (e * allowed).sum(dim=-1) / e.sum(dim=-1)


def empty_masks(verdict: MaskVerdict, empty: Sequence[bool]) -> None:
    """The rows whose mask allowed no token (read back with the step's tokens) join
    `verdict.failed`, but those that answered with a directive."""
    for k, none_allowed in enumerate(empty):
        if none_allowed and k not in verdict.deferred:
            verdict.failed.setdefault(
                k, ControllerError("empty_mask", "the mask allows no token"))
