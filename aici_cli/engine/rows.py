"""Row bookkeeping: which generation holds each cache row, which keys a row still holds
for the next line, which row a generation gets, and who takes part in the next pass.
The queues (who waits for a row, the lines read ahead) are the scheduler's.

Row i of the table is row i of the KV cache. A finished generation's row is released at
once and refilled at the next admission (continuous batching).

Prefix cache. A released row keeps its keys until it is overwritten, so a new line whose
prompt starts like the tokens a row holds (a shared few-shot prefix, a system prompt, the
same prompt for `n` samples) takes those keys instead of recomputing them: in place when
it is given that row, otherwise copied (the plan names the copy; the model runner makes
it with `RowCache.copy_prefix` before the pass, exact: slot s holds position s in every
row). The index is a scan over the rows, not a radix tree or block hashes: the cache
holds one sequence per row, at most `batch_size` of them, and comparing a prompt with
each is a vectorized compare of microseconds; a tree pays off only when many more cached
sequences than rows are kept (a paged cache).

Forks use the same path: a new branch of a fork is a generation whose prompt and output
so far are the forking row's tokens (`Generation.cacheable`), so its first pass takes
their keys from that row (or, if it waited, from the row that kept them) and feeds only
the tokens the forking row had not fed yet: nothing before the fork is computed again.

The scheduler's admission reads up to `lookahead` lines ahead (bounded, so a 10 GB stdin
still streams); the table picks the one whose prefix is cached (`next_line`) and gives
each generation the idle row whose keys serve it best, evicting the idle row whose keys
serve the waiting lines least (`place`).

A compiled run's tail (no line can come any more) moves its last lines down to the lowest
rows (`compact`), so that the compiled step's smaller graph holds them: a lone last line
in row 5 of 8 would otherwise pay for 8 rows a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aici_cli.core.job import Job
from aici_cli.engine.forward.compiled import smallest_bucket
from aici_cli.engine.generation import Generation

# Prompt tokens one pass takes on; further new rows wait for the next pass. Bounds the
# activations of a pass (and its latency for the rows already decoding).
PREFILL_TOKENS_PER_PASS = 4096

# A new row sits a pass out, to copy keys a row of this pass is about to compute, only
# when that saves at least this many prompt tokens: below it, computing them again costs
# less than a pass without the row (on CPU a token of prefill is a few % of a pass).
WAIT_MIN_TOKENS = 32


@dataclass
class Prepared:
    """A line read ahead and tokenized, waiting for a row; its controllers are built
    only when it is admitted (a wasm guest's store is not cheap to hold)."""

    job: Job
    prompt: list[int]
    tokens: np.ndarray  # the prompt, for prefix comparisons
    earlier: list[dict[str, Any]] = field(default_factory=list)  # results of past attempts

    @classmethod
    def of(cls, job: Job, prompt: list[int],
           earlier: list[dict[str, Any]] | None = None) -> Prepared:
        return cls(job, prompt, np.asarray(prompt, dtype=np.int64), earlier or [])


def prompt_keys(n: int, held_prompt: int, prompt: int) -> int:
    """Of `n` common tokens, how many a line whose prompt is `prompt` tokens long may take
    from a row whose first `held_prompt` keys were its line's prompt: as many as keep each
    key's kind, a prompt token's key for a prompt token and a generated token's for a
    generated one. A 16-bit run computes the two kinds on different kernels
    (models/quant/prompt_tokens.py), and a line's keys must be those it would compute
    itself, or its text would depend on which line ran before it (a prompt that quotes
    another line's answer). Equal prompt lengths (a fork's branches, a line's samples)
    keep every common key."""
    return n if held_prompt == prompt else min(n, held_prompt, prompt)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


Copy = tuple[int, int, int]  # (src, dst, n): row dst takes row src's first n slots


class RowTable:
    def __init__(self, size: int, prefix_cache: bool = True,
                 prompt_kernels: bool = False) -> None:
        """`prompt_kernels`: prompt tokens may run other kernels than generated ones (a
        16-bit run's dense copies): a line takes a key of its own kind only
        (`prompt_keys`)."""
        self.prefix_cache = prefix_cache
        self.prompt_kernels = prompt_kernels
        self.gens: list[Generation | None] = [None] * size
        # Tokens whose keys an idle row still holds (valid until it is overwritten), and
        # how many of them were its line's prompt (`prompt_keys`).
        self.held: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(size)]
        self.held_prompt = [0] * size
        # When each row was last released (a counter): the eviction's tie-break.
        self.released_at = [0] * size
        self._releases = 0
        # Rows that may run at once; lowered when a pass runs out of memory.
        self.live_cap = size

    def busy(self) -> bool:
        return any(g is not None for g in self.gens)

    def live(self) -> int:
        return sum(g is not None for g in self.gens)

    def release(self, row: int) -> None:
        """The row's generation finished: its keys stay, for a later line to take."""
        gen = self.gens[row]
        if gen is not None and self.prefix_cache:
            self._hold(row, gen)
        self._releases += 1
        self.released_at[row] = self._releases
        self.gens[row] = None

    # ----------------------------------------------------------------------- admission

    def has_room(self) -> bool:
        """Whether a row could take a generation now."""
        return self.live() < self.live_cap and None in self.gens

    def place(self, gen: Generation, ahead: Sequence[Prepared]) -> None:
        """Give `gen` the idle row that serves it best (`row_for`)."""
        self.gens[self.row_for(np.asarray(gen.cacheable(), dtype=np.int64), ahead)] = gen

    def _prompt_len(self, row: int) -> int:
        """How many of the tokens `row`'s cache holds were its line's prompt."""
        gen = self.gens[row]
        return self.held_prompt[row] if gen is None else len(gen.prompt)

    def _rows_tokens(self) -> list[np.ndarray]:
        """What each row's cache holds now: a live generation's fed tokens, or an idle
        row's kept keys."""
        out = []
        for row, gen in enumerate(self.gens):
            if gen is None:
                out.append(self.held[row])
            else:
                out.append(np.asarray((gen.prompt + gen.output)[: gen.length], dtype=np.int64))
        return out

    def next_line(self, ahead: Sequence[Prepared]) -> int:
        """Index in `ahead` (lines read ahead) of the line to admit next: the longest
        cached prefix, the earliest line among equals (input order when nothing is
        cached)."""
        if not self.prefix_cache or len(ahead) == 1:
            return 0
        rows = self._rows_tokens()
        best, best_n = 0, -1
        for i, line in enumerate(ahead):
            n = max((common_prefix(line.tokens, held) for held in rows), default=0)
            if n > best_n:
                best, best_n = i, n
        return best

    def row_for(self, prompt: np.ndarray, ahead: Sequence[Prepared]) -> int:
        """The idle row a new generation goes to: the one whose kept keys share the most
        with its prompt (they are reused in place); when none shares any, eviction: the
        one whose keys serve the lines read ahead least (by the tokens they would save),
        and among those the least recently released. (Lines read ahead that an idle row
        serves are admitted first, so the read-ahead rarely decides; recency keeps the
        prefixes that lines keep coming back to.)"""
        idle = [row for row, gen in enumerate(self.gens) if gen is None]
        if not self.prefix_cache:
            return idle[0]
        shared = [common_prefix(prompt, self.held[row]) for row in idle]
        if max(shared) > 0:
            return idle[shared.index(max(shared))]

        def value(row: int) -> tuple[int, int]:
            saves = max((common_prefix(line.tokens, self.held[row]) for line in ahead),
                        default=0)
            return saves, self.released_at[row]

        return min(idle, key=value)

    def compact(self) -> list[Copy]:
        """Move the live generations past the smallest compiled bucket that holds them
        (`compiled.smallest_bucket`) into the idle rows below it, and return the copies
        that move their keys (made before the next pass, as a prefix copy). For a run's
        tail, once no line can come: the compiled CPU step costs the rows of its graph,
        and a lone last line in row 5 of 8 would otherwise pay for 8 (22 against 7 ms a
        step, default model, int4, AMX Xeon). A generation that has not taken its first
        pass stays. The rows it leaves keep its keys, as a released row does."""
        live = [i for i, g in enumerate(self.gens) if g is not None]
        if not live:
            return []
        bound = smallest_bucket(len(live), len(self.gens))
        holes = [i for i in range(bound) if self.gens[i] is None]
        copies: list[Copy] = []
        for src in (i for i in live if i >= bound):
            gen = self.gens[src]
            if not holes or gen is None or gen.stats.forward_passes == 0 or gen.length == 0:
                continue
            dst = holes.pop(0)
            copies.append((src, dst, gen.length))
            self.gens[dst], self.gens[src] = gen, None
            self.held[dst] = np.zeros(0, dtype=np.int64)  # the live generation defines it
            if self.prefix_cache:
                self._hold(src, gen)
        return copies

    def _hold(self, row: int, gen: Generation) -> None:
        """`row` keeps the keys `gen` fed, for a later line to take."""
        self.held[row] = np.asarray((gen.prompt + gen.output)[: gen.length], dtype=np.int64)
        self.held_prompt[row] = len(gen.prompt)

    # ---------------------------------------------------------------------- the pass

    def take_part(self) -> tuple[list[int], list[Generation | None], list[Copy]]:
        """The span of live rows, the generation of each row taking part in this pass
        (None: idle, or a new row that waits: for the prefill budget, or for a row of this
        pass that computes keys it can copy next pass), and the prefix copies to make
        before the pass, in order. A new row first takes the longest prefix of its prompt
        that any row's cache holds."""
        live = [i for i, g in enumerate(self.gens) if g is not None]
        rows = list(range(live[0], live[-1] + 1))
        gens = [self.gens[i] for i in rows]
        budget = PREFILL_TOKENS_PER_PASS
        prefilling: list[np.ndarray] = []  # prompts new rows of this pass compute
        copies: list[Copy] = []
        for k, gen in enumerate(gens):
            if gen is None or gen.stats.forward_passes > 0:
                continue
            prompt = np.asarray(gen.cacheable(), dtype=np.int64)
            if self.prefix_cache:
                cached = self._take_cached(rows[k], gen, prompt, copies)
                soon = max((common_prefix(prompt, p) for p in prefilling), default=0)
                gain = min(soon, gen.cache_limit()) - cached
                if gain > 0 and gain >= min(WAIT_MIN_TOKENS, gen.cache_limit()):
                    gens[k] = None  # takes those keys next pass instead
                    continue
            if budget <= 0:
                gens[k] = None
                continue
            budget -= len(gen.pending)
            prefilling.append(prompt)
        return rows, gens, copies

    def _take_cached(self, row: int, gen: Generation, prompt: np.ndarray,
                     copies: list[Copy]) -> int:
        """Give the new generation in `row` the longest prefix of its prompt that a row's
        cache holds (its own row's kept keys in place, another row's copied: added to
        `copies`), but at least its last prompt token to feed, for its own next-token
        logits. Returns its length."""
        best_row, best = row, 0
        for other, tokens in enumerate(self._rows_tokens()):
            # Its own row: the keys kept there, or already taken in place.
            own = other == row and not gen.length
            n = common_prefix(prompt, self.held[row] if own else tokens)
            if self.prompt_kernels:
                held = self.held_prompt[row] if own else self._prompt_len(other)
                n = prompt_keys(n, held, len(gen.prompt))
            if n > best or (n == best and other == row):
                best_row, best = other, n
        best = min(best, gen.cache_limit())
        if best > gen.length:
            if best_row != row:
                copies.append((best_row, row, best))
            gen.take_cached(best)
        self.held[row] = np.zeros(0, dtype=np.int64)  # the live generation defines it now
        return gen.length
