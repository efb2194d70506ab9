"""The scheduler: the owner of everything a step changes between passes. It holds the row
table (rows.py: which generation holds each cache row, the keys idle rows keep, the prefix
choice), the lines read ahead, the queue of generations waiting for a row (a started
line's samples, a fork's new branches, a next attempt's), the next attempts to launch, and
the forked lines to drop.

Between steps, in this order: lines are read ahead (up to `lookahead`, `read_ahead`);
next attempts are launched and idle rows filled, waiting generations first (`admit`).
Then one step, vLLM v1's shape:

    schedule()  ->  StepPlan  ->  ModelRunner.execute_model()  ->  StepOutput
                ->  update_from_output()  ->  the generations that finished

`schedule` makes the plan, data only (plan.py). `update_from_output` applies the output:
rows that failed end with their error, the update hands the tokens to the controllers
(update.py), the step's times are recorded, the forks asked for are made (decisions.py),
the finished rows are released (their keys stay for the next line that shares their
prefix), and the sequences of a forked line that failed are dropped. Nothing is admitted
or launched while a step runs; the engine makes the results of what finished
(finishing.py) and hands next attempts back (`requeue`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

from aici_cli.core.job import BadLine, Job
from aici_cli.core.line_stats import StepTimes
from aici_cli.engine.branches import Ending
from aici_cli.engine.clock import Now
from aici_cli.engine.decisions import Decisions
from aici_cli.engine.draft import propose
from aici_cli.engine.generation import Generation
from aici_cli.engine.intake import Emit, LineIntake
from aici_cli.engine.launch import Launcher
from aici_cli.engine.logits.logit_rules import LogitRules
from aici_cli.engine.logits.logprobs import TokenBytes, fed_offsets, fill_fed
from aici_cli.engine.logits.masks import MaskSource
from aici_cli.engine.logits.sampler import MIN_TEMPERATURE, Draw
from aici_cli.engine.plan import StepOutput, StepPlan
from aici_cli.engine.rows import Prepared, RowTable
from aici_cli.engine.trace_hooks import EngineTracer
from aici_cli.engine.update import Update

# A source may yield None: a live feed (a Ray worker's, aici_cli/run/distributed/worker.py) with
# nothing ready now, that is not exhausted; the run asks it again after its next step.
Source = Iterator[Job | BadLine | None]
_END = object()


class Scheduler:
    def __init__(self, table: RowTable, intake: LineIntake, launcher: Launcher,
                 update: Update, decisions: Decisions, *, lookahead: int, draft_tokens: int,
                 eos: Collection[int], masked_logprobs: bool, token_bytes: TokenBytes,
                 now: Now, tracer: Callable[[], EngineTracer],
                 decode_compiled: Callable[[], bool] | None = None) -> None:
        """`decode_compiled`: whether one-token steps run compiled now (a draft then costs
        an eager pass); None when they never do (`--compile off`)."""
        self.table = table
        self.intake = intake
        self.launcher = launcher
        self.update = update
        self.decisions = decisions
        self.lookahead = max(1, lookahead)
        self.draft_tokens = draft_tokens
        self.eos = eos
        self.masked_logprobs = masked_logprobs
        self.token_bytes = token_bytes
        self.now = now
        self.tracer = tracer  # the engine's current tracer (trace hooks)
        self.decode_compiled = decode_compiled
        self.ahead: list[Prepared] = []  # lines read ahead, not yet admitted, in input order
        # Generations of admitted lines (samples, branches, attempts) waiting for a row.
        self.waiting: deque[Generation] = deque()
        self.retries: deque[Prepared] = deque()  # next attempts, launched at the next admit
        self.step_times: list[StepTimes] = []  # every step's, for the run's summary
        self._dropping = False  # a forked line failed: its other sequences are to go
        self._finished: list[Generation] = []  # ended since the last hand-over, in order
        self._planned: tuple[StepPlan, tuple[Generation | None, ...]] | None = None

    # ------------------------------------------------------------------------- state

    def busy(self) -> bool:
        """Whether a row holds a generation."""
        return self.table.busy()

    def pending(self) -> bool:
        """Whether a generation waits for a row, or a next attempt for its launch."""
        return bool(self.waiting or self.retries)

    def idle(self) -> bool:
        """No row has work and no line waits for one."""
        return not (self.table.busy() or self.ahead or self.pending())

    def has_room(self) -> bool:
        """Whether a row could take a generation now."""
        return self.table.has_room()

    # ----------------------------------------------------------------------- admission

    def read_ahead(self, source: Source, emit: Emit) -> Source | None:
        """Read lines until `lookahead` wait for a row; returns the source, or None once
        it is exhausted. Bad lines are answered at once (they need no row)."""
        while len(self.ahead) < self.lookahead:
            item = next(source, _END)
            if item is _END:
                return None
            if item is None:  # a live source with nothing ready now
                break
            assert isinstance(item, (Job, BadLine))
            prepared = self.intake.prepare(item, emit)
            if prepared is not None:
                self.ahead.append(prepared)
        return source

    def admit(self, emit: Emit, new_lines: bool) -> list[Generation]:
        """Launch the next attempts queued since the last step (their generations wait
        ahead of new lines, and are admitted even once `new_lines` is False: a started
        line must still get its result), then fill idle rows, first with waiting
        generations, then (if `new_lines`) with lines read ahead, those with the longest
        cached prefix first. Returns the generations that finished at once."""
        while self.retries:
            self.waiting.extend(self._launch(self.retries.popleft(), emit))
        while self.table.has_room():
            if not self.waiting:
                if not new_lines or not self.ahead:
                    break
                line = self.ahead.pop(self.table.next_line(self.ahead))
                self.waiting.extend(self._launch(line, emit))
                continue
            self.table.place(self.waiting.popleft(), self.ahead)
        self._drop_failed()
        return self._take_finished()

    def requeue(self, attempts: Iterable[Prepared]) -> None:
        """Next attempts of lines (retry.py): launched at the next admission."""
        self.retries.extend(attempts)

    def _launch(self, line: Prepared, emit: Emit) -> list[Generation]:
        return self.launcher.launch(line, emit, self._ended, self._wait)

    def _wait(self, gen: Generation) -> None:
        """`gen` waits for a row, behind the generations already waiting."""
        self.waiting.append(gen)

    def _ended(self, gen: Generation) -> None:
        """`gen` finished (its row, if any, is released): its result is made after this
        step or admission. A forking line's sequence learns at once what becomes of it
        (a fault ends the line, whose other sequences are then dropped)."""
        if gen.branch is not None:
            assert gen.finish is not None
            if gen.branch.end(gen.finish.reason == "error") is Ending.FAILS:
                self._dropping = True
        self._finished.append(gen)

    def _take_finished(self) -> list[Generation]:
        finished, self._finished = self._finished, []
        return finished

    def _drop_failed(self) -> None:
        """Free the rows of the sequences of lines that failed after a fork (their result
        is due), and take their waiting branches out of the queue."""
        if not self._dropping:
            return
        self._dropping = False

        def doomed(gen: Generation | None) -> bool:
            return gen is not None and gen.branch is not None and gen.branch.line.failed

        for row, gen in enumerate(self.table.gens):
            if gen is not None and doomed(gen):
                self.table.release(row)
                if gen.controller is not None:
                    gen.controller.close()
        kept: deque[Generation] = deque()
        for gen in self.waiting:
            if doomed(gen):
                if gen.controller is not None:
                    gen.controller.close()
            else:
                kept.append(gen)
        self.waiting = kept

    # ---------------------------------------------------------------------------- plan

    def schedule(self, input_closed: bool) -> StepPlan:
        """The next step's plan. `input_closed`: no line can come any more (the source is
        read to its end, or admission stopped)."""
        started = self.now()
        # A compiled run's tail moves its last lines down to the rows of a smaller graph.
        moves = (self.table.compact() if self.decode_compiled is not None
                 and self.decode_compiled() and self._tail(input_closed) else [])
        span, gens, copies = self.table.take_part()  # who feeds what in this pass
        copies = moves + copies  # the moved rows' keys first: a prefix copy may read them
        # Only a compiled decode step reads `steps_ahead` (whether compiling pays) and
        # `rows_bound`: without one, the plan skips the walks over the queues and rows.
        compiles = self.decode_compiled is not None
        plan = _plan(gens, span, copies, started, self._drafts(gens), self._offsets(gens),
                     self._steps_ahead(gens) if compiles else 0,
                     self._rows_bound(span, input_closed) if compiles else 0)
        self._planned = (plan, tuple(gens))
        return plan

    def _drafts(self, gens: list[Generation | None]) -> list[list[int]]:
        # Without drafts, would this be a one-token step run compiled?
        compiled = (self.draft_tokens > 1 and self.decode_compiled is not None
                    and self.decode_compiled()
                    and all(g is None or len(g.pending) == 1 for g in gens))
        drafts = propose_drafts(gens, self.draft_tokens, self.eos, compiled)
        if self.masked_logprobs:  # no masks at draft positions: no drafts for those rows
            drafts = [[] if g is not None and g.logprobs is not None else d
                      for g, d in zip(gens, drafts)]
        return drafts

    def _offsets(self, gens: list[Generation | None]) -> list[list[int]]:
        """Per row, the offsets of the positions (before its next-token one) whose logits
        it needs: a scored choice's, or the fast-forwarded tokens' for raw logprobs."""
        offsets: list[list[int]] = [[] for _ in gens]
        for k, gen in enumerate(gens):
            if gen is None:
                continue
            if gen.scored is not None:
                offsets[k] = gen.scored.offsets(gen.length, len(gen.prompt))
            elif gen.logprobs is not None and not self.masked_logprobs:
                offsets[k] = fed_offsets(gen)
        return offsets

    def _rows_bound(self, span: list[int], input_closed: bool) -> int:
        """The rows the run can still occupy: the pass's span (it ends at the highest
        busy row) once no line can come and none waits for a row, else every row. A
        fork's branch may still go past it; the compiled step then takes its full-size
        graph."""
        if not self._tail(input_closed):
            return len(self.table.gens)
        return span[-1] + 1

    def _tail(self, input_closed: bool) -> bool:
        """Whether no line can take a row any more: the input is read to its end, and
        none is read ahead or waits."""
        return input_closed and not self.ahead and not self.pending()

    def _steps_ahead(self, gens: list[Generation | None]) -> int:
        """An upper bound of the one-token steps still to come: the tokens the running,
        waiting and read-ahead lines may still generate, over the rows."""
        running = [g for g in (*gens, *self.waiting) if g is not None]
        tokens = sum(max(0, g.job.max_tokens - len(g.output)) for g in running)
        tokens += sum(p.job.max_tokens for p in self.ahead)
        return tokens // max(1, len(self.table.gens))

    # -------------------------------------------------------------------------- update

    def update_from_output(self, plan: StepPlan, output: StepOutput) -> list[Generation]:
        """Apply a step: rows that failed end with their error, the others' tokens go to
        their controllers, the forks asked for are made, finished rows are released and a
        failed forked line's sequences dropped. Returns the generations that finished (in
        the order their results go out)."""
        assert self._planned is not None and self._planned[0] is plan, "not the last plan"
        gens, self._planned = self._planned[1], None
        if output.fits is not None:  # a pass ran out of memory: fewer rows from now on
            self.table.live_cap = min(self.table.live_cap, output.fits)
        for k, err in output.failed.items():
            gen = gens[k]
            assert gen is not None
            gen.finish_with("error", (err.type, err.message))
        self._retire(plan, gens, output.failed)
        served = ([None if k in output.failed else g for k, g in enumerate(gens)]
                  if output.failed else list(gens))
        applied = self.update.apply(served, plan, output)
        self.step_times.append(output.clock.finish(output.times, applied.controller_ms))
        self.tracer().step(output.clock, output.times, served)  # trace hook
        for k in applied.forking:  # between steps now: the forks asked for in this one
            gen = gens[k]
            assert gen is not None
            self.decisions.make_fork(gen, self._ended, self._wait)
        self._retire(plan, gens, applied.done)
        self._drop_failed()
        return self._take_finished()

    def _retire(self, plan: StepPlan, gens: Sequence[Generation | None],
                positions: Iterable[int]) -> None:
        """Free the rows of the generations at `positions` that finished; a generation
        that still takes its readout keeps its row."""
        for k in positions:
            gen = gens[k]
            row = plan.span[k]
            if (gen is None or gen.finish is None or self.table.gens[row] is not gen
                    or self._takes_readout(gen)):
                continue
            if (gen.logprobs is not None and self.masked_logprobs
                    and gen.finish.reason != "error"):
                # Tokens fast-forwarded as the line ended (a grammar's last forced tokens,
                # a closing completion) were never fed: forced, so logprob 0 when masked.
                fill_fed(gen, None, self.token_bytes)
            self.table.release(row)
            self._ended(gen)

    def _takes_readout(self, gen: Generation) -> bool:
        """Whether a finished generation keeps its row for its readout, one more pass only
        to read logprobs: its last tokens were fast-forwarded and never fed, and the line
        wants their (raw) logprobs."""
        return (gen.logprobs is not None and not self.masked_logprobs
                and gen.finish is not None and gen.finish.reason != "error"
                and len(gen.logprobs) < len(gen.output) and bool(gen.pending)
                and gen.stats.forward_passes > 0 and not gen.read_out)


def propose_drafts(gens: Sequence[Generation | None], k: int, eos: Collection[int],
                   compiled: bool = False) -> list[list[int]]:
    """A prompt-lookup draft per row (empty: none) of up to `k` tokens, within the token
    budget (draft.py), for greedy rows past their prefill whose drafts pay in a pass of
    these rows (`DraftGate.worth`; `compiled`: drafting would turn a compiled step
    eager)."""
    drafts: list[list[int]] = [[] for _ in gens]
    if k < 2:
        return drafts
    rows = sum(1 for gen in gens if gen is not None)  # the rows sharing the pass
    for i, gen in enumerate(gens):
        if (gen is None or gen.length == 0 or gen.scored is not None
                or gen.finish is not None
                or gen.job.sampling.temperature >= MIN_TEMPERATURE
                or not gen.draft.worth(len(gen.output), compiled, rows, k - 1)):
            continue
        n = min(k, gen.job.max_tokens - len(gen.output))
        if n < 2:
            continue
        controller = gen.controller
        drafts[i] = propose(gen.prompt, gen.output, n, gen.job.stop_token_ids, eos,
                            controller.valid_prefix if controller is not None else None)
    return drafts


# Long: one walk over the step's rows builds every per-row field of the plan (it runs every
# step); split, each part would walk the rows again.
def _plan(gens: list[Generation | None], span: list[int], copies: list[tuple[int, int, int]],
          started: float, drafts: list[list[int]], offsets: list[list[int]],
          steps_ahead: int, rows_bound: int) -> StepPlan:
    """The plan of a step whose rows `span` hold `gens`: what each feeds, reads and
    samples, as data. Syncs the rows' logit rules with their outputs (the runner only
    reads them)."""
    lengths: list[int] = []
    chunks: list[tuple[int, ...]] = []
    outputs: list[int] = []
    draws: list[Draw | None] = []
    masks: list[MaskSource | None] = []
    rules: list[LogitRules | None] = []
    logprobs: set[int] = set()
    scoring: set[int] = set()
    readout: set[int] = set()
    prompt: list[int] = []
    fed = prefill = 0
    for k, g in enumerate(gens):
        if g is None:
            prompt.append(0)
            lengths.append(0)
            chunks.append(())
            outputs.append(0)
            draws.append(None)
            masks.append(None)
            rules.append(None)
            continue
        lengths.append(g.length)
        chunks.append(tuple(g.pending))
        prompt.append(max(0, min(len(g.pending), len(g.prompt) - g.length)))
        outputs.append(len(g.output))
        fed += len(g.pending)
        prefill += g.stats.forward_passes == 0
        # Scored choices and rows taking their readout are read, not sampled (no mask).
        read_only = g.scored is not None or g.finish is not None
        if g.scored is not None:
            scoring.add(k)
        if g.finish is not None:
            readout.add(k)
        if g.logprobs is not None and g.scored is None:
            logprobs.add(k)
        draws.append(None if read_only else Draw(g.job.sampling, g.stream))
        masks.append(g.controller if g.finish is None else None)
        r = g.rules if not read_only else None
        if r is not None:
            r.sync(g.output)
        rules.append(r)
    fed += sum(len(d) - 1 for d in drafts if d)
    return StepPlan(tuple(span), tuple(lengths), tuple(chunks), tuple(copies),
                    tuple(tuple(d) for d in drafts), tuple(tuple(o) for o in offsets),
                    tuple(draws), tuple(masks), tuple(rules), tuple(outputs),
                    frozenset(logprobs), frozenset(scoring), frozenset(readout),
                    "prefill" if prefill else "decode", fed, steps_ahead, rows_bound, started,
                    tuple(prompt))
