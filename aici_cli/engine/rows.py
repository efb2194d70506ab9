"""Row bookkeeping: which generation holds each cache row, who waits for one, and who
takes part in the next pass.

Row i of the table is row i of the KV cache. A finished generation's row is released at
once and refilled at the next admission (continuous batching). The `n` samples of a line
are admitted together as far as rows allow; the rest wait in `waiting`, ahead of new lines.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from aici_cli.engine.cache import RowCache
from aici_cli.engine.generation import Generation, SampleGroup
from aici_cli.jobs import Job, LineError

# Prompt tokens one pass takes on; further new rows wait for the next pass. Bounds the
# activations of a pass (and its latency for the rows already decoding).
PREFILL_TOKENS_PER_PASS = 4096

Source = Iterator[Job | LineError]


class RowTable:
    def __init__(self, size: int, cache: RowCache) -> None:
        self.cache = cache
        self.gens: list[Generation | None] = [None] * size
        # Samples of admitted lines (n > 1) still waiting for a free row.
        self.waiting: deque[Generation] = deque()
        # Rows that may run at once; lowered when a pass runs out of memory.
        self.live_cap = size

    def __iter__(self) -> Iterator[Generation | None]:
        return iter(self.gens)

    def busy(self) -> bool:
        return any(g is not None for g in self.gens)

    def live(self) -> int:
        return sum(g is not None for g in self.gens)

    def release(self, row: int) -> None:
        self.gens[row] = None

    def admit(self, source: Source | None, pull: bool,
              start: Callable[[Job | LineError], list[Generation]]) -> Source | None:
        """Fill idle rows, first with waiting samples, then (if `pull`) from `source`, up
        to `live_cap` rows in all; `start` turns an item into the generations that need a
        row (none for an item that already has its result). Returns the source, or None
        once it is exhausted."""
        live = self.live()
        for row in range(len(self.gens)):
            if self.gens[row] is not None:
                continue
            if live >= self.live_cap:
                break
            while not self.waiting:
                if not pull or source is None:
                    return source
                item = next(source, None)
                if item is None:
                    return None
                self.waiting.extend(start(item))
            self.gens[row] = self.waiting.popleft()
            live += 1
        return source

    def take_part(self) -> tuple[list[int], list[Generation | None]]:
        """The span of live rows, and the generation of each row taking part in this pass
        (None: idle, or a new row that waits: for the prefill budget, or for a sibling
        sample prefilling the same prompt in this pass). A sample whose sibling's row
        already holds the prompt copies those keys instead of prefilling them."""
        live = [i for i, g in enumerate(self.gens) if g is not None]
        rows = list(range(live[0], live[-1] + 1))
        gens = [self.gens[i] for i in rows]
        budget = PREFILL_TOKENS_PER_PASS
        prefilling: set[int] = set()  # groups whose prompt a row of this pass prefills
        for k, gen in enumerate(gens):
            if gen is None or gen.length > 0:
                continue
            if gen.group is not None:
                if id(gen.group) in prefilling:
                    gens[k] = None
                    continue
                source = self._prompt_row(gen.group)
                if source is not None:
                    self.cache.copy_prefix(source, rows[k], gen.group.prompt_len)
                    gen.adopt_prompt()
                    continue
            if budget <= 0:
                gens[k] = None
                continue
            budget -= len(gen.pending)
            if gen.group is not None:
                prefilling.add(id(gen.group))
        return rows, gens

    def _prompt_row(self, group: SampleGroup) -> int | None:
        """A row whose cache holds the group's prompt (a sibling past its prefill)."""
        for row, gen in enumerate(self.gens):
            if gen is not None and gen.group is group and gen.length >= group.prompt_len:
                return row
        return None
