"""One packed forward pass over the rows of a step, with drafts, and out of memory.

Out of memory, a pass is rerun in halves (same rows, same tokens: the step goes on
unchanged; keys a failed pass wrote are rewritten at the same slots), drafts are dropped,
and fewer rows are admitted from then on. A row that cannot run even alone fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aici_cli.engine.cache import RowCache
from aici_cli.engine.generation import Generation
from aici_cli.engine.inputs import AttentionLayout, build_inputs, forward
from aici_cli.engine.rows import RowTable
from aici_cli.models.load import LoadedModel


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA raises OutOfMemoryError; the CPU allocator raises a RuntimeError saying so."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and (
        "out of memory" in str(e) or "can't allocate memory" in str(e))


@dataclass
class PassOutput:
    """`every`: logits for each row's next token (rows 0..b-1), then after each fed draft
    token (row i's from `extra_at[i]`), in the model's dtype, cut to the vocabulary.
    `out_of_memory`: positions of the rows that could not run even alone."""

    every: torch.Tensor
    extra_at: list[int]
    out_of_memory: list[int]

    def next_token_logits(self, b: int) -> torch.Tensor:
        """[b, V], a view: masks apply in place and greedy argmax needs no fp32 copy (a
        bf16 value widens to fp32 exactly); `sample` widens what it samples."""
        return self.every[:b]

    def draft_picks(self, b: int) -> list[int]:
        """The model's own pick after every fed draft token, in one call for the batch."""
        return self.every[b:].argmax(dim=-1).tolist() if self.every.shape[0] > b else []


class ModelPass:
    def __init__(self, lm: LoadedModel, cache: RowCache, rows: RowTable) -> None:
        self.lm = lm
        self.cache = cache
        self.rows = rows
        self.layout = AttentionLayout.for_config(lm.model.config)

    def run(self, first_row: int, gens: Sequence[Generation | None],
            drafts: list[list[int]]) -> PassOutput:
        """Each row feeds its pending tokens and its draft but its last token (a draft d
        is checked against the logits after d[0..-2]: its last token needs no pass of
        its own). Out of memory, `drafts` is cleared and the pass retried without."""
        lengths = [g.length if g is not None else 0 for g in gens]
        chunks = [g.pending if g is not None else [] for g in gens]
        if any(drafts):
            fed = [c + d[:-1] for c, d in zip(chunks, drafts)]
            keep = [max(1, len(d)) for d in drafts]
            try:
                self.cache.ensure_capacity(max(a + len(c) for a, c in zip(lengths, fed)))
                inputs = build_inputs(first_row, lengths, fed, self.layout, self.lm.device,
                                      keep)
                every = forward(self.lm.model, self.cache, inputs)
                return PassOutput(self._vocab(every), inputs.extra_at, [])
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                drafts[:] = [[] for _ in drafts]
        logits, out_of_memory = self._forward(first_row, lengths, chunks)
        return PassOutput(self._vocab(logits), [len(chunks)] * len(chunks), out_of_memory)

    def _vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Drop the padding columns some models carry past the tokenizer's vocabulary."""
        v = self.lm.vocab_size
        return logits[:, :v] if logits.shape[-1] > v else logits

    def _forward(self, first_row: int, lengths: list[int],
                 chunks: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """One packed pass: the logits [b, V] of each row's last token, and the rows that
        could not run even alone for lack of memory (their logits are zeros)."""
        try:
            self.cache.ensure_capacity(max(a + len(c) for a, c in zip(lengths, chunks)))
            inputs = build_inputs(first_row, lengths, chunks, self.layout, self.lm.device)
            return forward(self.lm.model, self.cache, inputs), []
        except Exception as e:
            if not is_out_of_memory(e):
                raise
        active = [k for k, c in enumerate(chunks) if c]
        if len(active) == 1:
            logits = torch.zeros(len(chunks), self.lm.vocab_size, dtype=self.lm.dtype,
                                 device=self.lm.device)
            return logits, active
        self.rows.live_cap = max(1, min(self.rows.live_cap, len(active) // 2))
        halves = active[: len(active) // 2], active[len(active) // 2 :]
        parts = [self._forward(first_row, lengths,
                               [c if k in half else [] for k, c in enumerate(chunks)])
                 for half in halves]
        logits = parts[0][0]
        logits[halves[1]] = parts[1][0][halves[1]]
        return logits, parts[0][1] + parts[1][1]
