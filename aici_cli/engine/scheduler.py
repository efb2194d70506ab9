"""The scheduler: what the next pass feeds. It owns the row table (rows.py: which
generation holds each cache row, the prefix cache's choice of row), the lines read ahead,
and the queue of generations waiting for a row (a started line's samples, a fork's new
branches, a relaxed line's next attempt), and emits one frozen `StepPlan` per step.

Between steps, in this order: lines are read ahead (up to `lookahead`); next attempts are
launched; idle rows are filled, waiting generations first; a plan is made. Nothing is
admitted or launched while a step runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from aici_cli.engine.draft import propose_drafts
from aici_cli.engine.finishing import Finishing
from aici_cli.engine.generation import Generation
from aici_cli.engine.intake import Emit, LineIntake
from aici_cli.engine.launch import Launcher
from aici_cli.engine.logprobs import fed_offsets
from aici_cli.engine.plan import StepPlan
from aici_cli.engine.rows import Prepared, RowTable
from aici_cli.engine.scoring import scored_offsets
from aici_cli.vocabulary.job import Job, LineError

# A source may yield None: a live feed (a Ray worker's, aici_cli/distributed/worker.py) with
# nothing ready now, that is not exhausted; the run asks it again after its next step.
Source = Iterator[Job | LineError | None]
_END = object()


class Scheduler:
    def __init__(self, table: RowTable, intake: LineIntake, launcher: Launcher,
                 finishing: Finishing, draft_tokens: int, eos: frozenset[int] | set[int],
                 masked_logprobs: bool, count_steps_ahead: bool,
                 decode_compiled: Callable[[], bool] = lambda: False) -> None:
        self.table = table
        self.intake = intake
        self.launcher = launcher
        self.finishing = finishing
        self.draft_tokens = draft_tokens
        self.eos = eos
        self.masked_logprobs = masked_logprobs
        # Only a compiled decode step reads `StepPlan.steps_ahead` (whether compiling
        # pays) and `rows_bound`: without one, the plan skips the walks over the queues
        # and rows.
        self.count_steps_ahead = count_steps_ahead
        # Whether one-token steps run compiled now: a draft then costs an eager pass.
        self.decode_compiled = decode_compiled
        # Set by the run before each step: no line can come any more (the source is read
        # to its end, or admission stopped).
        self.input_closed = False

    # ----------------------------------------------------------------------- admission

    def read_ahead(self, source: Source, emit: Emit) -> Source | None:
        """Read lines until `lookahead` wait for a row; returns the source, or None once
        it is exhausted. Bad lines are answered at once (they need no row)."""
        while self.table.wants_more():
            item = next(source, _END)
            if item is _END:
                return None
            if item is None:  # a live source with nothing ready now
                break
            assert isinstance(item, (Job, LineError))
            prepared = self.intake.prepare(item, emit)
            if prepared is not None:
                self.table.ahead.append(prepared)
        return source

    def admit(self, emit: Emit, new_lines: bool) -> None:
        """Launch the next attempts queued since the last step (their generations wait
        ahead of new lines, and are admitted even once `new_lines` is False: a started
        line must still get its result), then fill idle rows."""
        while self.finishing.retries:
            self.table.waiting.extend(self._launch(self.finishing.retries.popleft(), emit))
        self.table.admit(lambda line: self._launch(line, emit), new_lines=new_lines)

    def _launch(self, line: Prepared, emit: Emit) -> list[Generation]:
        return self.launcher.launch(line, emit, self.finishing.finish, self.wait)

    def wait(self, gen: Generation) -> None:
        """`gen` waits for a row, behind the generations already waiting."""
        self.table.waiting.append(gen)

    def pending(self) -> bool:
        """Whether a generation waits for a row, or a next attempt for its launch."""
        return bool(self.table.waiting or self.finishing.retries)

    def drop_failed(self) -> None:
        """Free the rows of the sequences of lines that failed after a fork (their result
        is out), and take their waiting branches out of the queue."""
        if not self.finishing.dropping:
            return
        self.finishing.dropping = False

        def doomed(gen: Generation | None) -> bool:
            return gen is not None and gen.branches is not None and gen.branches.failed

        for row, gen in enumerate(self.table.gens):
            if gen is not None and doomed(gen):
                self.table.release(row)
                if gen.controller is not None:
                    gen.controller.close()
        kept: deque[Generation] = deque()
        for gen in self.table.waiting:
            if doomed(gen):
                if gen.controller is not None:
                    gen.controller.close()
            else:
                kept.append(gen)
        self.table.waiting = kept

    def shrink(self, fits: int | None) -> None:
        """A pass ran out of memory: at most `fits` rows run at once from now on."""
        if fits is not None:
            self.table.live_cap = min(self.table.live_cap, fits)

    # ---------------------------------------------------------------------------- plan

    def plan(self) -> StepPlan:
        span, gens = self.table.take_part()  # who feeds what in this pass
        kind = ("prefill" if any(g is not None and g.stats.forward_passes == 0 for g in gens)
                else "decode")
        drafts = self._drafts(gens)
        fed = sum(len(g.pending) for g in gens if g is not None)
        fed += sum(len(d) - 1 for d in drafts if d)
        # Scored choices and closing rows are read, not sampled (and need no mask).
        scoring = frozenset(k for k, g in enumerate(gens)
                            if g is not None and g.score_from is not None)
        closing = frozenset(k for k, g in enumerate(gens)
                            if g is not None and g.finish is not None)
        return StepPlan(tuple(span), tuple(gens), tuple(drafts),
                        tuple(self._offsets(gens, scoring)), scoring, closing, kind, fed,
                        self._steps_ahead(gens) if self.count_steps_ahead else 0,
                        self._rows_bound(span) if self.count_steps_ahead else 0)

    def _drafts(self, gens: list[Generation | None]) -> list[list[int]]:
        # Without drafts, would this be a one-token step run compiled?
        compiled = (self.draft_tokens > 1 and self.decode_compiled()
                    and all(g is None or len(g.pending) == 1 for g in gens))
        drafts = propose_drafts(gens, self.draft_tokens, self.eos, compiled)
        if self.masked_logprobs:  # no masks at draft positions: no drafts for those rows
            drafts = [[] if g is not None and g.logprobs is not None else d
                      for g, d in zip(gens, drafts)]
        return drafts

    def _offsets(self, gens: list[Generation | None], scoring: frozenset[int]) -> list[list[int]]:
        """Per row, the offsets of the positions (before its next-token one) whose logits
        it needs: a scored choice's, or the fast-forwarded tokens' for raw logprobs."""
        offsets: list[list[int]] = [[] for _ in gens]
        for k, gen in enumerate(gens):
            if gen is None:
                continue
            if k in scoring:
                offsets[k] = scored_offsets(gen)
            elif gen.logprobs is not None and not self.masked_logprobs:
                offsets[k] = fed_offsets(gen)
        return offsets

    def _rows_bound(self, span: list[int]) -> int:
        """The rows the run can still occupy: the pass's span (it ends at the highest
        busy row) once no line can come and none waits for a row, else every row. A
        fork's branch may still go past it; the compiled step then takes its full-size
        graph."""
        if not self.input_closed or self.table.ahead or self.pending():
            return len(self.table.gens)
        return span[-1] + 1

    def _steps_ahead(self, gens: list[Generation | None]) -> int:
        """An upper bound of the one-token steps still to come: the tokens the running,
        waiting and read-ahead lines may still generate, over the rows."""
        running = [g for g in (*gens, *self.table.waiting) if g is not None]
        tokens = sum(max(0, g.job.max_tokens - len(g.output)) for g in running)
        tokens += sum(p.job.max_tokens for p in self.table.ahead)
        return tokens // max(1, len(self.table.gens))
