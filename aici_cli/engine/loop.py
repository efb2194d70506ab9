"""The decode loop: rows refilled continuously, one batched forward pass per step, in
three parts (vLLM v1's shape):

    scheduler.plan()  ->  StepPlan  ->  runner.execute()  ->  StepOutput  ->  update.apply()

The scheduler (scheduler.py) owns the rows and the queues and decides who feeds what;
the model runner (model_runner.py) runs the pass, the masks and the sampler; the update
(update.py) hands tokens to controllers. Then the engine retires the rows whose
generations finished (finishing.py makes their results) and makes the forks their
controllers asked for (decisions.py), so a step never starts a line or a branch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable

import torch

from aici_cli.control.grammar import GrammarCompiler
from aici_cli.engine.attention import install
from aici_cli.engine.cache import row_cache
from aici_cli.engine.clock import Now, StepClock
from aici_cli.engine.decisions import Decisions
from aici_cli.engine.finishing import Finishing
from aici_cli.engine.generation import Generation
from aici_cli.engine.intake import ControllerFactory, Emit, LineIntake
from aici_cli.engine.invariance_check import check_run, ensure_invariant
from aici_cli.engine.launch import Launcher
from aici_cli.engine.logprobs import fill_fed
from aici_cli.engine.model_runner import ModelRunner
from aici_cli.engine.plan import StepPlan
from aici_cli.engine.rows import RowTable
from aici_cli.engine.scheduler import Scheduler, Source
from aici_cli.engine.trace_hooks import NO_TRACE, EngineTracer
from aici_cli.engine.update import Update
from aici_cli.models.load import LoadedModel
from aici_cli.vocabulary.config import EngineConfig
from aici_cli.vocabulary.job import Job, LineError
from aici_cli.vocabulary.line_stats import StepTimes


class Engine:
    """Runs jobs on one loaded model. `run` emits one result dict per job or line error.

    `now` is the clock of every timing (seconds); tests pass a fake one. `intake` makes
    the lines' prompts and controllers (`LineIntake`; the lm-eval backend passes its own,
    which takes token ids as they are).
    """

    def __init__(self, lm: LoadedModel, config: EngineConfig,
                 controller_factory: ControllerFactory | None = None,
                 now: Now = time.perf_counter,
                 intake: type[LineIntake] = LineIntake) -> None:
        if config.deterministic and config.check_invariance:
            ensure_invariant(lm, functools.partial(
                check_run, functools.partial(Engine, lm), config))
        self.lm = lm
        self.config = config
        self.now = now
        self.eos = lm.eos_token_ids
        model_cfg = lm.model.config
        max_positions = int(getattr(model_cfg, "max_position_embeddings", 1 << 15))
        install(lm.model)
        self.tracer: EngineTracer = NO_TRACE  # trace hooks (trace_hooks.py): no-ops by default
        self.step_times: list[StepTimes] = []
        self.intake = intake(lm, config, max_positions, controller_factory)
        cache = row_cache(lm.model, num_layers=int(model_cfg.num_hidden_layers),
                          rows=config.batch_size,
                          capacity=min(config.initial_capacity, max_positions))
        self.masked_logprobs = config.logprobs_mode == "masked"
        table = RowTable(config.batch_size, cache, config.prefix_cache,
                         config.lookahead if config.prefix_cache else 1)
        tracer = lambda: self.tracer  # noqa: E731 (a tracer attached later is seen)
        self.decisions = Decisions(lm.tokenizer, self.eos, config.max_branches, now)
        self.finishing = Finishing(lm.tokenizer, config.schema_retries, now)
        launcher = Launcher(self.intake, self.decisions, self.eos, config.step_stats, now,
                            now(), tracer)
        self.runner = ModelRunner(lm, cache, config)
        self.scheduler = Scheduler(table, self.intake, launcher, self.finishing,
                                   config.draft_tokens, self.eos, self.masked_logprobs,
                                   self.runner.model_pass.decode.compiled is not None,
                                   lambda: self.runner.model_pass.decode.chosen)
        self.update = Update(self.decisions, self.masked_logprobs, self.token_bytes, now,
                             tracer)

    # ------------------------------------------------------------------ public surface

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
        compiled = self.runner.model_pass.decode.compiled
        return None if compiled is None else compiled.steps

    def set_controller_factory(self, factory: ControllerFactory) -> None:
        """Every line admitted from now on gets its controller from `factory`."""
        self.intake.controller_factory = factory

    def in_flight(self) -> int:
        """Sequences holding a row now."""
        return self.scheduler.table.live()

    def idle(self) -> bool:
        """No row has work and no line waits for one: waiting for input costs nothing."""
        table = self.scheduler.table
        return not (table.busy() or table.ahead or self.scheduler.pending())

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (exact, even for part of a UTF-8 character)."""
        return bytes(self.intake.compiler.tokenizer.decode_bytes([token]))

    # ----------------------------------------------------------------------------- run

    @torch.inference_mode()
    def run(self, items: Iterable[Job | LineError | None], emit: Emit,
            should_admit: Callable[[], bool] = lambda: True) -> None:
        """Drive every item to exactly one `emit`ted result; returns when all are done,
        or, once `should_admit` turns False, when every line already started is done
        (lines read ahead but not started then have no result). A None item means
        "nothing ready yet" (see `scheduler.Source`): with such a source the run only
        ends on `should_admit`."""
        source: Source | None = iter(items)
        emit = self.tracer.wrap_emit(emit)  # trace hook
        self.finishing.emit = emit
        scheduler, table = self.scheduler, self.scheduler.table
        self.runner.open()
        try:
            while True:
                admitting = should_admit()
                if admitting and source is not None and table.has_room():
                    source = scheduler.read_ahead(source, emit)
                # Samples of a line already started are admitted even after admission of
                # new lines stopped (an interrupt): the line must still get its result.
                scheduler.admit(emit, new_lines=admitting)
                scheduler.drop_failed()
                if not table.busy():
                    if not scheduler.pending() and (
                            not admitting or (source is None and not table.ahead)):
                        return
                    continue
                scheduler.input_closed = source is None or not admitting
                self._step()
        finally:
            self.runner.close()

    def _step(self) -> None:
        clock = StepClock(self.now)
        plan = self.scheduler.plan()
        out = self.runner.execute(plan, clock)
        self.scheduler.shrink(out.fits)
        self._retire(plan, self.update.fail(plan, out))
        applied = self.update.apply(plan, out)
        self.step_times.append(clock.finish(out.times, applied.controller_ms))
        served = ([None if k in out.failed else g for k, g in enumerate(plan.gens)]
                  if out.failed else list(plan.gens))
        self.tracer.step(clock, out.times, served)  # trace hook
        for k in applied.forking:  # between steps now: the forks asked for in this one
            gen = plan.gens[k]
            assert gen is not None
            self.decisions.make_fork(gen, self.finishing.finish, self.scheduler.wait)
        self._retire(plan, applied.done)
        self.scheduler.drop_failed()

    def _retire(self, plan: StepPlan, positions: Iterable[int]) -> None:
        """Free the rows of the generations at `positions` that finished and make their
        results; a generation that still takes its closing pass keeps its row."""
        table = self.scheduler.table
        for k in positions:
            gen = plan.gens[k]
            if (gen is None or gen.finish is None or table.gens[plan.span[k]] is not gen
                    or self._closing_pass(gen)):
                continue
            if (gen.logprobs is not None and self.masked_logprobs
                    and gen.finish.reason != "error"):
                # Tokens fast-forwarded as the line ended (a grammar's last forced tokens,
                # a closing completion) were never fed: forced, so logprob 0 when masked.
                fill_fed(gen, None, self.token_bytes)
            table.release(plan.span[k])
            self.finishing.finish(gen)

    def _closing_pass(self, gen: Generation) -> bool:
        """Whether a finished generation keeps its row for one more pass: its last tokens
        were fast-forwarded and never fed, and the line wants their (raw) logprobs."""
        return (gen.logprobs is not None and not self.masked_logprobs
                and gen.finish is not None and gen.finish.reason != "error"
                and len(gen.logprobs) < len(gen.output) and bool(gen.pending)
                and gen.stats.forward_passes > 0 and not gen.closing)
