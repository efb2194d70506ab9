"""One packed forward pass over the rows of a step, with drafts, and out of memory.

Out of memory, a pass is rerun in halves (same rows, same tokens: the step goes on
unchanged; keys a failed pass wrote are rewritten at the same slots), drafts are dropped,
and fewer rows are admitted from then on (`fits`, which the scheduler reads). A row that
cannot run even alone fails.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aici_cli.engine.forward.attention import deterministic_pass
from aici_cli.engine.forward.cache import RowCache
from aici_cli.engine.forward.decode_steps import DecodeSteps
from aici_cli.engine.forward.deterministic import install as install_tiled_linears
from aici_cli.engine.forward.inputs import (
    AttentionLayout,
    ForwardInputs,
    Readout,
    build_inputs,
    forward,
)
from aici_cli.engine.forward.step_builds import BuildSource
from aici_cli.models.load import LoadedModel
from aici_cli.models.quant import prompt_tokens
from aici_cli.models.quant.dense_copies import WideRows


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA raises OutOfMemoryError; the CPU allocator raises a RuntimeError saying so."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and (
        "out of memory" in str(e) or "can't allocate memory" in str(e))


@dataclass
class PassOutput:
    """`every`: logits for each row's next token (rows 0..b-1), then row i's extra
    positions from `extra_at[i]`: first those it asked to score (`scored[i]`, in that
    order), then one after each fed draft token but the last. In the model's dtype, cut to
    the vocabulary. `out_of_memory`: positions of the rows that could not run even alone.
    `hidden`: `every` holds the rows' final (normed) hidden states [b, hidden] instead of
    logits (a pass run with `project` False), for the masked projection."""

    every: torch.Tensor
    extra_at: list[int]
    scored: Sequence[Sequence[int]]
    out_of_memory: list[int]
    hidden: bool = False

    def next_token_logits(self, b: int) -> torch.Tensor:
        """[b, V], a view: masks apply in place and greedy argmax needs no fp32 copy (a
        bf16 value widens to fp32 exactly); `sample` widens what it samples."""
        return self.every[:b]

    def scored_logits(self, k: int) -> torch.Tensor:
        """[len(scored[k]), V]: row k's logits at the positions it asked to score."""
        at = self.extra_at[k]
        return self.every[at : at + len(self.scored[k])]

    def draft_argmax(self, b: int) -> torch.Tensor:
        """The model's own pick after every extra position [extra], in one call for the
        batch, on the device (read back with the step's tokens; only those after draft
        tokens are used, see `draft_at`)."""
        return self.every[b:].argmax(dim=-1)

    def draft_at(self, k: int, b: int) -> int:
        """Where row k's draft picks start in `draft_argmax(b)`."""
        return self.extra_at[k] - b + len(self.scored[k])


class ModelPass:
    def __init__(self, lm: LoadedModel, cache: RowCache, deterministic: bool = False,
                 compile: str = "off", wide_prefill: bool = False) -> None:
        """`deterministic`: the deterministic mode's passes, batch-invariant
        (`--deterministic`, see engine/forward/deterministic.py);
        `compile`: when one-token steps run compiled (compiled.py); `wide_prefill`: prompt
        tokens on dense copies in one GEMM a pass, not in tiles (`--wide-prefill`)."""
        self.lm = lm
        self.wide_prefill = wide_prefill
        self.cache = cache
        self.fits: int | None = None  # rows that fit in one pass, once one ran out of memory
        self.prompt: list[int] = []  # the running pass's prompt tokens per row (`run`)
        self.layout = AttentionLayout.for_config(lm.model.config)
        self.deterministic = deterministic
        if deterministic:
            install_tiled_linears(lm.model, deterministic_pass)
        self.decode = DecodeSteps(compile, lm.model, cache, cache.rows, lm.device,
                                  deterministic, BuildSource.of(lm))
        # Dense copies of the int4 layers for prompt tokens, where that pays here.
        self.wide = None if deterministic else WideRows.for_model(lm.model)

    def run(self, first_row: int, lengths: Sequence[int], chunks: Sequence[Sequence[int]],
            drafts: list[list[int]], scored: Sequence[Sequence[int]] | None = None,
            steps_ahead: int = 0, rows_bound: int = 0, project: bool = True,
            prompt: Sequence[int] | None = None) -> PassOutput:
        """Row `first_row + i`, whose cache holds `lengths[i]` tokens, feeds `chunks[i]`
        (empty: it sits the pass out) and its draft but its last token (a draft d is
        checked against the logits after d[0..-2]: its last token needs no pass of its
        own). `scored[i]`: offsets in row i's chunk (before the last) whose logits it
        needs too. Out of memory, `drafts` is cleared and the pass retried without.
        `steps_ahead`: a bound of the one-token steps still to come (whether compiling
        the decode step pays, compiled.py); `rows_bound`: of the rows the run can still
        occupy (0: unknown, every row). `project` False (no drafts, no scored positions:
        the masked projection's passes): the rows' final hidden states, not their logits.
        `prompt[i]`: how many of chunk i's first tokens are its line's prompt (None: none),
        the tokens that run on dense copies where a 16-bit run has them (`WideRows`)."""
        self.prompt = list(prompt) if prompt is not None else [0] * len(chunks)
        b = len(chunks)
        scored = scored if scored is not None else [() for _ in chunks]
        assert project or not (any(drafts) or any(scored)), "hidden states: next tokens only"
        one_token = not any(drafts) and not any(scored) and all(len(c) <= 1 for c in chunks)
        if one_token:
            one = self._one_token(first_row, lengths, chunks, steps_ahead, rows_bound, project)
            if one is not None:
                return PassOutput(self._vocab(one, project), [b] * b, scored, [], not project)
        started = time.perf_counter()
        if any(drafts):
            fed = [[*c, *d[:-1]] for c, d in zip(chunks, drafts)]
            readouts = [_readout(len(c), s, len(d)) for c, s, d in zip(chunks, scored, drafts)]
            try:
                self.cache.ensure_capacity(max(a + len(c) for a, c in zip(lengths, fed)))
                inputs = build_inputs(first_row, lengths, fed, self.layout, self.lm.device,
                                      readouts, self.deterministic)
                every = self._pass(inputs, fed)
                return PassOutput(self._vocab(every), inputs.extra_at, scored, [])
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                drafts[:] = [[] for _ in drafts]
        readouts = [_readout(len(c), s, 0) for c, s in zip(chunks, scored)]
        logits, extra_at, out_of_memory = self._forward(first_row, lengths, chunks, readouts,
                                                        project)
        if one_token:  # timed for `auto`'s forecast (decode_steps.py)
            self.decode.note_eager(time.perf_counter() - started)
        return PassOutput(self._vocab(logits, project), extra_at, scored, out_of_memory,
                          not project)

    def _one_token(self, first_row: int, lengths: Sequence[int], chunks: Sequence[Sequence[int]],
                   steps_ahead: int, rows_bound: int, project: bool) -> torch.Tensor | None:
        """The compiled step's logits [b, V] for a pass where every row feeds at most one
        token, or None to run it eagerly (not compiled, or out of memory)."""
        step = self.decode.pick(steps_ahead if self.decode.compiled else 0,
                                first_row + len(chunks), rows_bound)
        if step is None or not self.cache.keys:  # buffers exist after the first eager pass
            return None
        compiling = step.bucket(first_row + len(chunks), rows_bound) not in step.compile_s
        try:
            self.cache.ensure_capacity(max(a + len(c) for a, c in zip(lengths, chunks)))
            return step.run(first_row, list(lengths), [c[0] if c else None for c in chunks],
                            rows_bound, project)
        except Exception as e:
            if is_out_of_memory(e):
                return None
            if not compiling:
                raise
            # Compiling failed (a toolchain problem, an op inductor cannot lower): the run
            # goes on eagerly; the eager pass rewrites any key the failed call wrote.
            self.decode.give_up(e)
            return None

    def _pass(self, inputs: ForwardInputs, fed: Sequence[Sequence[int]],
              project: bool = True) -> torch.Tensor:
        """One eager packed pass over `inputs` (inputs.forward), whose rows feed `fed` (in
        row order, packed), their prompt tokens (`self.prompt`) on the dense copies where
        the run makes them."""
        if self.wide is None:
            return self._forward_pass(inputs, project)
        runs, start = [], 0
        for n, tokens in zip(self.prompt, fed):
            runs.append((start, min(n, len(tokens))))
            start += len(tokens)
        self.wide.before_pass(sum(n for _, n in runs))
        if not self.wide.dense:
            return self._forward_pass(inputs, project)
        with prompt_tokens.feeding([r for r in runs if r[1]], start, inputs.input_ids.device,
                                   tiled=not self.wide_prefill):
            return self._forward_pass(inputs, project)

    def _forward_pass(self, inputs: ForwardInputs, project: bool) -> torch.Tensor:
        if project:
            return forward(self.lm.model, self.cache, inputs)
        return forward(self.lm.model, self.cache, inputs, project=False)

    def _vocab(self, logits: torch.Tensor, project: bool = True) -> torch.Tensor:
        """Drop the padding columns some models carry past the tokenizer's vocabulary
        (hidden states, `project` False, are kept whole)."""
        v = self.lm.vocab_size
        return logits[:, :v] if project and logits.shape[-1] > v else logits

    def _forward(self, first_row: int, lengths: Sequence[int], chunks: Sequence[Sequence[int]],
                 readouts: list[Readout | None],
                 project: bool = True) -> tuple[torch.Tensor, list[int], list[int]]:
        """One packed pass: the logits of each row's readout positions (next tokens [b, V],
        then the extras from `extra_at`; hidden states [b, hidden] with `project` False),
        and the rows that could not run even alone for lack of memory (their logits are
        zeros)."""
        try:
            self.cache.ensure_capacity(max(a + len(c) for a, c in zip(lengths, chunks)))
            inputs = build_inputs(first_row, lengths, chunks, self.layout, self.lm.device,
                                  readouts, self.deterministic)
            out = self._pass(inputs, chunks, project)
            return out, inputs.extra_at, []
        except Exception as e:
            if not is_out_of_memory(e):
                raise
        active = [k for k, c in enumerate(chunks) if c]
        if len(active) == 1:
            return self._alone_out_of_memory(chunks, readouts, active, project)
        self.fits = max(1, min(self.fits or len(active), len(active) // 2))
        halves = active[: len(active) // 2], active[len(active) // 2 :]
        parts = [self._forward(first_row, lengths,
                               [c if k in half else [] for k, c in enumerate(chunks)],
                               readouts, project)
                 for half in halves]
        # Both halves lay out every row's extras alike (a row that sits a half out gets
        # placeholders): take each row's logits from its own half.
        logits, extra_at = parts[0][0], parts[0][1]
        for k in halves[1]:
            logits[k] = parts[1][0][k]
            readout = readouts[k]
            n = len(readout.extras) if readout is not None else 0
            logits[extra_at[k] : extra_at[k] + n] = parts[1][0][extra_at[k] : extra_at[k] + n]
        return logits, extra_at, parts[0][2] + parts[1][2]

    def _alone_out_of_memory(self, chunks: Sequence[Sequence[int]],
                             readouts: Sequence[Readout | None], active: list[int],
                             project: bool = True) -> tuple[torch.Tensor, list[int], list[int]]:
        b = len(chunks)
        extra_at, total = [], b
        for r in readouts:
            extra_at.append(total)
            total += len(r.extras) if r is not None else 0
        width = self.lm.vocab_size if project else self.lm.model.config.hidden_size
        logits = torch.zeros(total, width, dtype=self.lm.dtype,
                             device=self.lm.device)
        return logits, extra_at, active


def _readout(pending: int, scored: Sequence[int], draft: int) -> Readout | None:
    """Row readout: its next token after `pending` tokens, the `scored` offsets, and one
    position per draft token fed (a draft of `draft` tokens feeds all but its last)."""
    if not scored and draft < 2:
        return None
    extras = (*scored, *range(pending, pending + draft - 1))
    return Readout(pending - 1, extras)
