"""The decode loop: rows refilled continuously, one batched forward pass per step.

A step, top to bottom (`Engine._step`):
  1. take the rows: new lines were admitted into idle rows (their first pass prefills the
     prompt plus any tokens their controller fast-forwards at the start);
  2. propose drafts for greedy rows (draft.py);
  3. start filling token masks in a worker thread: they depend only on tokens already
     known, so they overlap the forward pass (llguidance and torch release the GIL);
  4. one forward pass over the span of running rows, each feeding 1 sampled token,
     several fast-forward ones or, for a new line, its prompt: packed without padding
     (inputs.py, attention.py), so a long chunk costs its own tokens only;
  5. apply the masks in place, sample one token per row;
  6. hand each row's token (and its accepted draft) to its controller, which answers
     with fast-forward tokens, backtrack or stop;
  7. release finished rows: each emits its result and its row is free for the next line.

A controller's directive may fork its generation (`_fork`, branches.py): the new branches
wait for rows ahead of new lines and take the forking row's keys.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from aici_cli.control.base import Directive
from aici_cli.control.grammar import GrammarCompiler
from aici_cli.control.line_scope import LineScope
from aici_cli.control.stop_strings import find_stop
from aici_cli.engine.attention import install
from aici_cli.engine.branches import LineBranches
from aici_cli.engine.cache import RowCache
from aici_cli.engine.clock import Now, StepClock, ms
from aici_cli.engine.draft import accept_draft, propose_drafts
from aici_cli.engine.generation import Finish, Generation, SampleGroup
from aici_cli.engine.intake import ControllerFactory, Emit, LineIntake
from aici_cli.engine.invariance_check import check_run, ensure_invariant
from aici_cli.engine.logprobs import entry, fed_offsets, fill_fed, log_softmax
from aici_cli.engine.masks import MaskVerdict, TokenMasks, apply_masks, controller_fault
from aici_cli.engine.passes import ModelPass, PassOutput
from aici_cli.engine.penalties import LogitRules, checked_draft_picks, rules_before_masks
from aici_cli.engine.result_line import combine_samples, generation_result, with_answer
from aici_cli.engine.retry import next_attempt, with_attempts
from aici_cli.engine.rows import Prepared, RowTable
from aici_cli.engine.sampling import branch_generator, row_generator, sample
from aici_cli.engine.scoring import (
    choice_logprob,
    combine_scores,
    score_fields,
    scored_offsets,
    shared_token_choices,
    token_choice_results,
    token_choice_scores,
)
from aici_cli.engine.trace_hooks import NO_TRACE, EngineTracer
from aici_cli.models.load import LoadedModel
from aici_cli.vocabulary.config import EngineConfig
from aici_cli.vocabulary.errors import ControllerError
from aici_cli.vocabulary.job import Job, LineError
from aici_cli.vocabulary.line_stats import StepTimes

# A source may yield None: a live feed (a Ray worker's, aici_cli/distributed/worker.py) with
# nothing ready now, that is not exhausted; the run asks it again after its next step.
Source = Iterator[Job | LineError | None]
_END = object()


class Engine:
    """Runs jobs on one loaded model. `run` emits one result dict per job or line error.

    `now` is the clock of every timing (seconds); tests pass a fake one.
    """

    def __init__(self, lm: LoadedModel, config: EngineConfig,
                 controller_factory: ControllerFactory | None = None,
                 now: Now = time.perf_counter) -> None:
        if config.deterministic and config.check_invariance:
            ensure_invariant(lm, functools.partial(
                check_run, functools.partial(Engine, lm), config))
        self.lm = lm
        self.config = config
        self.now = now
        self.vocab_size = lm.vocab_size
        self.eos = lm.eos_token_ids
        model_cfg = lm.model.config
        self.max_positions = int(getattr(model_cfg, "max_position_embeddings", 1 << 15))
        install(lm.model)
        self.intake = LineIntake(lm, config, self.max_positions, controller_factory)
        self.cache = RowCache(
            num_layers=int(model_cfg.num_hidden_layers),
            rows=config.batch_size,
            capacity=min(config.initial_capacity, self.max_positions),
        )
        self.masked_logprobs = config.logprobs_mode == "masked"
        self.rows = RowTable(config.batch_size, self.cache, config.prefix_cache,
                             config.lookahead if config.prefix_cache else 1)
        self.model_pass = ModelPass(lm, self.cache, self.rows, config.deterministic,
                                    config.compile)
        self.masks = TokenMasks(config.batch_size, self.vocab_size)
        self.step_times: list[StepTimes] = []
        self.tracer: EngineTracer = NO_TRACE  # trace hooks (trace_hooks.py): no-ops by default
        self.origin = now()  # lines' `started_ms` count from here
        self._emit: Emit = lambda result: None  # the current run's
        self._dropping = False  # a forked line failed: drop its other sequences

    @property
    def compiler(self) -> GrammarCompiler:
        """The run's grammar compiler (built on first use: it wraps the tokenizer)."""
        return self.intake.compiler

    @property
    def compile_ms(self) -> list[float]:
        """Each grammar compile of the run, in ms."""
        return self.intake.compile_ms

    @property
    def compiled_steps(self) -> int | None:
        """One-token steps the compiled decode step ran (None: `--compile` off)."""
        compiled = self.model_pass.decode.compiled
        return None if compiled is None else compiled.steps

    def set_controller_factory(self, factory: ControllerFactory) -> None:
        """Every line admitted from now on gets its controller from `factory`."""
        self.intake.controller_factory = factory

    def in_flight(self) -> int:
        """Sequences holding a row now."""
        return self.rows.live()

    def idle(self) -> bool:
        """No row has work and no line waits for one: waiting for input costs nothing."""
        rows = self.rows
        return not (rows.busy() or rows.ahead or rows.waiting)

    # ----------------------------------------------------------------------------- run

    @torch.inference_mode()
    def run(self, items: Iterable[Job | LineError | None], emit: Emit,
            should_admit: Callable[[], bool] = lambda: True) -> None:
        """Drive every item to exactly one `emit`ted result; returns when all are done,
        or, once `should_admit` turns False, when every line already started is done
        (lines read ahead but not started then have no result). A None item means
        "nothing ready yet" (see `Source`): with such a source the run only ends on
        `should_admit`."""
        source: Source | None = iter(items)
        emit = self.tracer.wrap_emit(emit)  # trace hook
        self._emit = emit
        launch = functools.partial(self._launch, emit=emit)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aici-mask")
        try:
            while True:
                admitting = should_admit()
                if admitting and source is not None and self.rows.has_room():
                    source = self._read_ahead(source, emit)
                # Samples of a line already started are admitted even after admission of
                # new lines stopped (an interrupt): the line must still get its result.
                self.rows.admit(launch, new_lines=admitting)
                self._drop_failed()
                if not self.rows.busy():
                    if not self.rows.waiting and (
                            not admitting or (source is None and not self.rows.ahead)):
                        return
                    continue
                self._step(emit)
        finally:
            self.pool.shutdown(wait=True)

    def _read_ahead(self, source: Source, emit: Emit) -> Source | None:
        """Read lines until `lookahead` wait for a row; returns the source, or None once
        it is exhausted. Bad lines are answered at once (they need no row)."""
        while self.rows.wants_more():
            item = next(source, _END)
            if item is _END:
                return None
            if item is None:  # a live source with nothing ready now
                break
            assert isinstance(item, (Job, LineError))
            prepared = self.intake.prepare(item, emit)
            if prepared is not None:
                self.rows.ahead.append(prepared)
        return source

    # ---------------------------------------------------------------------------- step

    def _step(self, emit: Emit) -> None:
        clock = StepClock(self.now)
        rows, gens = self.rows.take_part()  # who feeds what in this pass
        kind = ("prefill" if any(g is not None and g.stats.forward_passes == 0 for g in gens)
                else "decode")
        drafts = self._drafts(gens)  # before the mask worker starts: both read matchers
        fed = sum(len(g.pending) for g in gens if g is not None)
        fed += sum(len(d) - 1 for d in drafts if d)
        # Scored choices and closing rows are read, not sampled (and need no mask).
        scoring = [k for k, g in enumerate(gens) if g is not None and g.score_from is not None]
        closing = [k for k, g in enumerate(gens) if g is not None and g.finish is not None]
        masks = self.pool.submit(self.masks.fill, rows, gens)  # overlaps the forward pass
        clock.mark("forward")
        out = self.model_pass.run(rows[0], gens, drafts, self._scored(gens, scoring))
        clock.mark("forwarded")
        verdict = self._verdict(masks.result(), out.out_of_memory)
        clock.mark("masks_ready")
        logits = out.next_token_logits(len(gens))
        raw_logprobs = self._next_logprobs(logits, gens, masked=False)
        logits = rules_before_masks(logits, gens, verdict)
        greedy = apply_masks(logits, verdict)  # the failed rows now include empty masks
        next_logprobs = self._next_logprobs(logits, gens, masked=True) or raw_logprobs
        clock.mark("masked")
        self._release(rows, gens, self._fail(gens, verdict.failed), emit)
        real = [k for k, g in enumerate(gens) if g is not None and k not in verdict.deferred
                and k not in scoring and k not in closing]
        picked = self._sample(logits, greedy.tolist(), real, gens)
        clock.mark("sampled")
        times = clock.times(kind, rows=len(real), tokens=fed)
        self._fill_fed_logprobs(gens, out)
        controller_ms = self._hand_over(gens, real, picked, drafts, out, verdict.deferred,
                                        times, next_logprobs)
        self._score(gens, scoring, out, times)  # scored choices: read once, then done
        self._close(gens, closing, times)
        self.step_times.append(clock.finish(times, controller_ms))
        self.tracer.step(clock, times, gens)  # trace hook
        self._release(rows, gens, [*real, *verdict.deferred, *scoring, *closing], emit)
        self._drop_failed()

    def _scored(self, gens: list[Generation | None], scoring: list[int]) -> list[list[int]]:
        """Per row, the offsets of the positions (before its next-token one) whose logits
        it needs: a scored choice's, or the fast-forwarded tokens' for raw logprobs."""
        scored: list[list[int]] = [[] for _ in gens]
        for k, gen in enumerate(gens):
            if gen is None:
                continue
            if k in scoring:
                scored[k] = scored_offsets(gen)
            elif gen.logprobs is not None and not self.masked_logprobs:
                scored[k] = fed_offsets(gen)
        return scored

    def _drafts(self, gens: list[Generation | None]) -> list[list[int]]:
        drafts = propose_drafts(gens, self.config.draft_tokens, self.eos)
        if self.masked_logprobs:  # no masks at draft positions: no drafts for those rows
            drafts = [[] if g is not None and g.logprobs is not None else d
                      for g, d in zip(gens, drafts)]
        return drafts

    def _next_logprobs(self, logits: torch.Tensor, gens: list[Generation | None],
                       masked: bool) -> dict[int, torch.Tensor]:
        """Log-softmax of the next-token logits of the rows that want logprobs, taken
        before the masks apply (`masked` False) or after, as the run's mode says; {} at
        the other moment."""
        if masked != self.masked_logprobs:
            return {}
        return {k: log_softmax(logits[k]) for k, g in enumerate(gens)
                if g is not None and g.logprobs is not None and g.score_from is None}

    def _fill_fed_logprobs(self, gens: list[Generation | None], out: PassOutput) -> None:
        """Logprobs of the fast-forwarded tokens this pass fed (before any new token)."""
        for k, gen in enumerate(gens):
            if gen is not None and gen.logprobs is not None and gen.score_from is None:
                logits = None if self.masked_logprobs else out.scored_logits(k)
                fill_fed(gen, logits, self.token_bytes)

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (exact, even for part of a UTF-8 character)."""
        return bytes(self.intake.compiler.tokenizer.decode_bytes([token]))

    def _score(self, gens: list[Generation | None], scoring: list[int], out: PassOutput,
               times: StepTimes) -> None:
        for k in scoring:
            gen = gens[k]
            if gen is None:  # failed (out of memory even alone)
                continue
            gen.took_part(times)
            if gen.token_choices is not None:
                gen.token_scores = token_choice_scores(out.scored_logits(k), gen.token_choices)
            else:
                gen.logprob, gen.greedy = choice_logprob(gen, out.scored_logits(k))
            gen.finish = Finish("stop")

    @staticmethod
    def _verdict(verdict: MaskVerdict, out_of_memory: list[int]) -> MaskVerdict:
        """A row that ran out of memory even alone has no logits: it fails, whatever its
        controller answered."""
        for k in out_of_memory:
            verdict.deferred.pop(k, None)
            verdict.failed[k] = ControllerError(
                "out_of_memory", "out of memory even with this sequence alone in the pass")
        return verdict

    @staticmethod
    def _sample(logits: torch.Tensor, greedy: list[int], real: list[int],
                gens: list[Generation | None]) -> list[int]:
        """One token for each row in `real` (greedy, or seeded temperature with min-p,
        top-k and top-p)."""
        chosen = [g for g in (gens[k] for k in real) if g is not None]
        return sample(logits, greedy, real, [g.job.temperature for g in chosen],
                      [g.job.top_p for g in chosen], [g.generator for g in chosen],
                      top_ks=[g.job.top_k for g in chosen],
                      min_ps=[g.job.min_p for g in chosen])

    def _hand_over(self, gens: list[Generation | None], real: list[int], picked: list[int],
                   drafts: list[list[int]], out: PassOutput,
                   deferred: dict[int, Directive], times: StepTimes,
                   next_logprobs: dict[int, torch.Tensor]) -> float:
        """Give each row its sampled token and the draft tokens the model confirmed, and
        the rows whose controller answered with a directive that directive; returns the
        controllers' ms."""
        b = len(gens)
        predicted = checked_draft_picks(out, gens, drafts, b) if any(drafts) else []
        controller_ms = 0.0
        for k, token in zip(real, picked):
            gen = gens[k]
            assert gen is not None
            if k in next_logprobs and not self._ends(gen, token):
                self._record_logprob(gen, next_logprobs[k], token)
            controller_ms += self._commit(gen, token, times)
            if drafts[k]:
                at = out.draft_at(k, b)
                take = self._take_token
                if gen.logprobs is not None:  # each draft token's from its checking position
                    rows = out.every[b + at : b + at + len(drafts[k]) - 1]
                    take = functools.partial(self._take_draft_token, rows=iter(rows))
                controller_ms += accept_draft(gen, drafts[k], token,
                                              predicted[at : at + len(drafts[k]) - 1], take)
        for k, directive in deferred.items():
            gen = gens[k]
            if gen is not None:
                self._commit_directive(gen, directive, times)
        return controller_ms

    @staticmethod
    def _fail(gens: list[Generation | None], failed: dict[int, ControllerError]) -> list[int]:
        """Rows whose mask failed (or allows nothing) cannot sample: their error is their
        finish. Returns their positions."""
        for k, err in failed.items():
            gen = gens[k]
            assert gen is not None
            gen.finish = Finish("error", (err.type, err.message))
        return list(failed)

    def _close(self, gens: list[Generation | None], closing: list[int],
               times: StepTimes) -> None:
        """Rows that took their closing pass (their logprobs are filled): done."""
        for k in closing:
            gen = gens[k]
            if gen is not None:
                gen.took_part(times)
                gen.closing = True

    def _closing_pass(self, gen: Generation) -> bool:
        """Whether a finished generation keeps its row for one more pass: its last tokens
        were fast-forwarded and never fed, and the line wants their (raw) logprobs."""
        return (gen.logprobs is not None and not self.masked_logprobs
                and gen.finish is not None and gen.finish.reason != "error"
                and len(gen.logprobs) < len(gen.output) and bool(gen.pending)
                and gen.stats.forward_passes > 0 and not gen.closing)

    def _release(self, rows: list[int], gens: list[Generation | None], ks: Iterable[int],
                 emit: Emit) -> None:
        """Free the rows of the generations at positions `ks` that finished, and emit
        their results. A released position is None in `gens` from then on."""
        for k in ks:
            gen = gens[k]
            if gen is None or gen.finish is None or self._closing_pass(gen):
                continue
            if (gen.logprobs is not None and self.masked_logprobs
                    and gen.finish.reason != "error"):
                # Tokens fast-forwarded as the line ended (a grammar's last forced tokens,
                # a closing completion) were never fed: forced, so logprob 0 when masked.
                fill_fed(gen, None, self.token_bytes)
            self.rows.release(rows[k])
            self._finish(gen, emit)
            gens[k] = None

    # ----------------------------------------------------------------------- admission

    def _launch(self, line: Prepared, emit: Emit) -> list[Generation]:
        """The generations of an admitted line that need a row: its `n` samples with their
        controllers, after each controller's `start`, or a scored line's choices. A
        controller that cannot be built becomes the line's error result (and [])."""
        job = line.job
        if job.score:
            return self._launch_scored(line, emit)
        with self.tracer.admission(job):  # trace hook
            controllers = self.intake.controllers(job, emit)
        if controllers is None:
            return []
        group = SampleGroup(job.n) if job.n > 1 else None
        branches = (LineBranches(LineScope(), job.n)
                    if any(c is not None for c in controllers) else None)
        waiting = []
        for i, controller in enumerate(controllers):
            gen = Generation(job, line.prompt, controller, row_generator(job.seed, i),
                             started=self.now(), group=group, sample=i, earlier=line.earlier,
                             line=branches)
            gen.stats.started_ms = ms(self.origin, gen.started)
            self.tracer.admitted(gen)  # trace hook
            gen.rules = LogitRules.of(job, line.prompt, self.eos)
            if self.config.step_stats:
                gen.steps = []
            if job.logprobs is not None:
                gen.logprobs = []
            if controller is not None:
                assert branches is not None
                controller.join_line(branches.scope)
                self._consult(gen, functools.partial(controller.start, line.prompt))
            if self._check_limits(gen):
                self._finish(gen, emit)
            else:
                waiting.append(gen)
        return waiting

    def _launch_scored(self, line: Prepared, emit: Emit) -> list[Generation]:
        """One row per choice, each feeding the prompt and its choice (scoring.py)."""
        job = line.job
        assert job.constraint is not None
        options: list[str] = list(job.constraint.value)
        sequences = self.intake.choice_sequences(line, emit)
        if sequences is None:
            return []
        group = SampleGroup(len(options), scoring=True)
        tokens = shared_token_choices(sequences)
        if tokens is not None:  # one row scores them all
            ids, start = sequences[0]
            gen = Generation(job, ids, None, row_generator(job.seed, 0), started=self.now(),
                             group=group, score_from=start, choice=options[0])
            gen.token_choices = tokens
            return [gen]
        waiting = []
        for i, (option, (ids, start)) in enumerate(zip(options, sequences)):
            gen = Generation(job, ids, None, row_generator(job.seed, i), started=self.now(),
                             group=group, sample=i, score_from=start, choice=option)
            gen.stats.started_ms = ms(self.origin, gen.started)
            self.tracer.admitted(gen)  # trace hook
            if start == len(ids):  # an empty choice: nothing to score
                gen.finish = Finish("stop")
                self._finish(gen, emit)
            else:
                waiting.append(gen)
        return waiting

    def _finish(self, gen: Generation, emit: Emit) -> None:
        """Emit a finished generation's result, or, for a sample, the line's result once
        its last sample finishes, or start the line's next attempt (retry.py)."""
        result = generation_result(gen, self.lm.tokenizer, self.now())
        if (gen.score_from is not None and result["finish_reason"] != "error"
                and gen.token_choices is None):
            result["score"] = score_fields(gen.choice, gen.logprob,
                                           len(gen.prompt) - gen.score_from, gen.greedy)
        branches = gen.line
        if branches is not None:
            if branches.failed:
                return  # the line's result is out: this sequence was stopped
            branches.finished(gen.sample, gen.path, result)
            if branches.forked:
                if result["finish_reason"] == "error":  # a fault ends a forked line
                    branches.failed = self._dropping = True
                    emit(with_answer(gen.job, branches.result((gen.sample, gen.path))))
                elif branches.live == 0:
                    emit(with_answer(gen.job, branches.result()))
                return
        group = gen.group
        if group is not None:
            if gen.token_choices is not None:
                options = list(gen.job.constraint.value) if gen.job.constraint else []
                group.results[:] = token_choice_results(result, options, gen.token_scores)
            else:
                group.results[gen.sample] = result
            if not group.done:
                return
            combine = combine_scores if group.scoring else combine_samples
            result = combine([r for r in group.results if r is not None])
            result["stats"].update(group.pass_times())  # a shared pass counted once
        else:
            retry = next_attempt(gen.job, result, self.config.schema_retries)
            if retry is not None:
                self._retry(Prepared.of(retry, gen.prompt, [*gen.earlier, result]), emit)
                return
            result = with_attempts(result, gen.earlier)
        emit(with_answer(gen.job, result))

    def _retry(self, line: Prepared, emit: Emit) -> None:
        """Admit a line again, as its next attempt: its generation waits for a row with the
        samples of lines already started, ahead of new lines, and is admitted even after
        an interrupt stops new lines (a started line must still get its result). Its row
        still holds the prompt's keys (prefix cache)."""
        self.rows.waiting.extend(self._launch(line, emit))

    # ------------------------------------------------------------------- controllers

    def _consult(self, gen: Generation,
                 ask: Callable[[], Directive | None]) -> tuple[bool, float]:
        """The one place a controller decides: run `ask`, apply its directive (None: the
        generation stops), and time it. A failure ends only this generation. Returns
        whether the output changed, and the controller's ms."""
        t0 = self.now()
        changed = False
        fork = 0
        try:
            directive = ask()
            if directive is None:
                gen.finish = Finish("stop")
            else:
                changed = gen.apply(directive)
                fork = directive.fork
        except Exception as e:
            gen.finish = Finish("error", controller_fault(e))
        spent = ms(t0, self.now())
        gen.stats.controller_ms += spent
        if fork and gen.finish is None:
            self._fork(gen, fork)  # times the branches' own controllers
            changed = True
        return changed, spent

    def _fork(self, gen: Generation, n: int) -> None:
        """The controller of `gen` forked into `n` branches after its current tokens: `gen`
        goes on as branch 0; branches 1..n-1 get the other controllers (`Controller.fork`)
        and wait for rows ahead of new lines. Each branch is then asked its first
        decision, in branch order. A fork past `--max-branches`, or one whose controllers
        cannot be made, ends `gen` with that error (and the line with it)."""
        line, controller = gen.line, gen.controller
        if line is None or controller is None or line.failed:
            return
        refused = line.would_exceed(n, self.config.max_branches)
        if refused is not None:
            gen.finish = Finish("error", ("bad_action", refused))
            return
        t0 = self.now()
        try:
            others = controller.fork(n)
        except Exception as e:
            gen.finish = Finish("error", controller_fault(e))
            return
        replay_ms = ms(t0, self.now()) / len(others)
        line.forked_into(n)
        base = gen.path
        gen.path, gen.fork_floor = base + (0,), len(gen.output)
        branches = [gen]
        for k, other in enumerate(others, 1):
            path = base + (k,)
            branch = gen.branch(other, branch_generator(gen.job.seed, gen.sample, path), path)
            branch.stats.controller_ms += replay_ms
            branches.append(branch)
        for k, branch in enumerate(branches):
            assert branch.controller is not None
            self._consult(branch, functools.partial(branch.controller.enter_branch, k))
            faulted = branch.finish is not None and branch.finish.reason == "error"
            if branch is not gen:  # `gen` goes on with its caller
                if self._check_limits(branch):
                    self._finish(branch, self._emit)
                else:
                    self.rows.waiting.append(branch)
            if faulted or line.failed:  # the line ends: the later branches never start
                for left in branches[k + 1 :]:
                    assert left.controller is not None
                    left.controller.close()
                return

    def _drop_failed(self) -> None:
        """Free the rows of the sequences of lines that failed after a fork (their result
        is out), and take their waiting branches out of the queue."""
        if not self._dropping:
            return
        self._dropping = False

        def doomed(gen: Generation | None) -> bool:
            return gen is not None and gen.line is not None and gen.line.failed

        for row, gen in enumerate(self.rows.gens):
            if gen is not None and doomed(gen):
                self.rows.release(row)
                if gen.controller is not None:
                    gen.controller.close()
        kept: deque[Generation] = deque()
        for gen in self.rows.waiting:
            if doomed(gen):
                if gen.controller is not None:
                    gen.controller.close()
            else:
                kept.append(gen)
        self.rows.waiting = kept

    def _ends(self, gen: Generation, token: int) -> bool:
        """Whether sampling `token` ends the generation rather than appending it: EOS, but
        with ignore_eos only where a controller takes it (a constraint's end)."""
        return token in self.eos and not (gen.job.ignore_eos and gen.controller is None)

    def _take_token(self, gen: Generation, token: int) -> float:
        """`token` follows the generation's tokens (all in the cache): end at EOS (unless
        the controller takes it as a segment's end), or append it and ask the controller
        what follows. Returns the controller's ms."""
        controller = gen.controller
        if self._ends(gen, token):
            if controller is None:
                gen.finish = Finish("stop")
                return 0.0
            _, spent = self._consult(gen, controller.on_eos)
            self._check_limits(gen)
            return spent
        gen.append(token)
        if self._check_limits(gen) or controller is None:
            return 0.0
        changed, spent = self._consult(gen, lambda: controller.advance([token]))
        if changed:  # only a changed output needs another look for stop strings
            self._check_limits(gen)
        return spent

    def _record_logprob(self, gen: Generation, logprobs: torch.Tensor, token: int) -> None:
        assert gen.logprobs is not None
        gen.logprobs += [None] * (len(gen.output) - len(gen.logprobs))
        gen.logprobs.append(entry(logprobs, token, gen.job.logprobs or 0, self.token_bytes))

    def _take_draft_token(self, gen: Generation, token: int,
                          rows: Iterator[torch.Tensor]) -> float:
        """`_take_token` for an accepted draft token, recording its logprob first: the
        accepted tokens come in draft order, draft token i + 1 checked by the logits
        after draft token i, the i-th of `rows`."""
        self._record_logprob(gen, log_softmax(next(rows)), token)
        return self._take_token(gen, token)

    def _commit(self, gen: Generation, token: int, times: StepTimes) -> float:
        """The row took part in this pass and sampled `token`; returns the controller's
        ms."""
        gen.took_part(times)
        if gen.stats.ttft_ms == 0.0:
            gen.stats.ttft_ms = ms(gen.started, self.now())
            self.tracer.first_token(gen)  # trace hook
        ff_before = gen.stats.ff_tokens
        controller_ms = self._take_token(gen, token)
        gen.record_step(times, sampled=0 if self._ends(gen, token) else 1,
                          ff_tokens=gen.stats.ff_tokens - ff_before,
                          controller_ms=controller_ms)
        return controller_ms

    def _commit_directive(self, gen: Generation, directive: Directive,
                          times: StepTimes) -> None:
        """The controller answered this pass with a directive instead of a mask (it was
        decided, and timed, in the mask worker): apply it in place of a sampled token
        (the pass's logits for this row go unused)."""
        gen.took_part(times)
        ff_before = gen.stats.ff_tokens
        try:
            gen.apply(directive)
        except Exception as e:
            gen.finish = Finish("error", controller_fault(e))
        if directive.fork and gen.finish is None:
            self._fork(gen, directive.fork)
        self._check_limits(gen)
        gen.record_step(times, sampled=0, ff_tokens=gen.stats.ff_tokens - ff_before,
                          controller_ms=0.0)

    def _check_limits(self, gen: Generation) -> bool:
        """Finish on a stop token id, a stop string or max_tokens; True when the
        generation is finished."""
        if gen.finish is not None:
            return True
        if gen.job.stop_token_ids and self._stop_token(gen):
            return True
        job = gen.job
        if job.stop and len(gen.output) > job.min_tokens:
            decode = self.lm.tokenizer.decode
            text = decode(gen.output, skip_special_tokens=True)
            if gen.stop_floor is None:  # no stop string may end within min_tokens' text
                gen.stop_floor = len(decode(gen.output[: job.min_tokens],
                                            skip_special_tokens=True)) if job.min_tokens else 0
            hit = find_stop(text, job.stop, gen.text_checked, gen.stop_floor)
            gen.text_checked = len(text)
            if hit is not None:
                gen.finish = Finish("stop", text_end=hit)
                return True
        if len(gen.output) >= gen.job.max_tokens:
            gen.finish = Finish("length")
            return True
        return False

    @staticmethod
    def _stop_token(gen: Generation) -> bool:
        """End at the first of the line's stop_token_ids in the output from min_tokens on,
        sampled or fast-forwarded alike: it and what follows it are cut off (as vLLM
        leaves a stop token out of the text). True when it ended."""
        ids = gen.job.stop_token_ids
        output = gen.output
        for at in range(max(gen.ids_checked, gen.job.min_tokens), len(output)):
            if output[at] in ids:
                gen.backtrack(len(output) - at)
                gen.finish = Finish("stop")
                return True
        gen.ids_checked = len(output)
        return False
