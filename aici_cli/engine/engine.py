"""The decode loop: rows refilled continuously, one batched forward pass per step, in
three parts (vLLM v1's shape):

    scheduler.schedule()  ->  StepPlan  ->  runner.execute_model()  ->  StepOutput
        ->  scheduler.update_from_output()  ->  finished generations  ->  finishing

The scheduler (scheduler.py) owns the rows, the queues, the next attempts and the drops,
and decides who feeds what; its plan is data (plan.py). The model runner (model_runner.py)
owns the KV cache and runs the pass, the masks and the sampler. The scheduler applies the
output: tokens to controllers (update.py), forks (decisions.py), rows released. The
engine makes the results of what finished (finishing.py) and gives the lines' next
attempts back to the scheduler. Between steps, the scheduler reads lines ahead and admits
them; a step never starts a line or a branch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable

import torch

from aici_cli.control.grammar import GrammarCompiler
from aici_cli.core.config import EngineConfig
from aici_cli.core.job import BadLine, Job
from aici_cli.core.line_stats import StepTimes
from aici_cli.engine.clock import Now
from aici_cli.engine.decisions import Decisions
from aici_cli.engine.deterministic_check import check_run, ensure_deterministic
from aici_cli.engine.finishing import Finishing
from aici_cli.engine.forward.attention import install
from aici_cli.engine.forward.cache import row_cache
from aici_cli.engine.generation import Generation
from aici_cli.engine.intake import ControllerFactory, Emit, LineIntake
from aici_cli.engine.launch import Launcher
from aici_cli.engine.model_runner import ModelRunner
from aici_cli.engine.rows import RowTable
from aici_cli.engine.scheduler import Scheduler, Source
from aici_cli.engine.trace_hooks import NO_TRACE, EngineTracer
from aici_cli.engine.update import Update
from aici_cli.models.load import LoadedModel


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
            ensure_deterministic(lm, functools.partial(
                check_run, functools.partial(Engine, lm), config))
        self.lm = lm
        self.config = config
        self.now = now
        self.eos = lm.eos_token_ids
        model_cfg = lm.model.config
        max_positions = int(getattr(model_cfg, "max_position_embeddings", 1 << 15))
        install(lm.model)
        self.tracer: EngineTracer = NO_TRACE  # trace hooks (trace_hooks.py): no-ops by default
        tracer = lambda: self.tracer  # noqa: E731 (a tracer attached later is seen)
        self.intake = intake(lm, config, max_positions, controller_factory)
        cache = row_cache(lm.model, num_layers=int(model_cfg.num_hidden_layers),
                          rows=config.batch_size,
                          capacity=min(config.initial_capacity, max_positions))
        masked_logprobs = config.logprobs_mode == "masked"
        decisions = Decisions(lm.tokenizer, self.eos, config.max_branches, now)
        self.finishing = Finishing(lm.tokenizer, config.schema_retries, now)
        self.runner = ModelRunner(lm, cache, config, now)
        self.scheduler = Scheduler(
            RowTable(config.batch_size, config.prefix_cache,
                     prompt_kernels=self.runner.model_pass.wide is not None),
            self.intake,
            Launcher(self.intake, decisions, self.eos, config.step_stats, now, now(), tracer),
            Update(decisions, masked_logprobs, self.token_bytes, now, tracer),
            decisions,
            lookahead=config.lookahead if config.prefix_cache else 1,
            draft_tokens=config.draft_tokens, eos=self.eos, masked_logprobs=masked_logprobs,
            token_bytes=self.token_bytes, now=now, tracer=tracer,
            decode_compiled=self.runner.runs_compiled if self.runner.compiles else None)

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

    @property
    def eager_steps(self) -> dict[str, int]:
        """One-token steps that ran eagerly, by why (decode_steps.py: `EAGER_REASONS`,
        `--compile off`, or what kept the compiled step from this model or machine)."""
        return dict(self.runner.model_pass.decode.eager_by)

    @property
    def compiled_step_problem(self) -> str | None:
        """Why one-token steps run eagerly or without their packaged step, where they do
        (`--compile` off, an unsupported model, no C++ compiler, a package that could not
        be built); None where nothing stood in the way."""
        decode = self.runner.model_pass.decode
        if decode.compiled is None:
            return decode.reason or "--compile off"
        return decode.compiled.package_problem

    @property
    def step_times(self) -> list[StepTimes]:
        """Every step's times, in order."""
        return self.scheduler.step_times

    def set_controller_factory(self, factory: ControllerFactory) -> None:
        """Every line admitted from now on gets its controller from `factory`."""
        self.intake.controller_factory = factory

    def in_flight(self) -> int:
        """Sequences holding a row now."""
        return self.scheduler.table.live()

    def idle(self) -> bool:
        """No row has work and no line waits for one: waiting for input costs nothing."""
        return self.scheduler.idle()

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (exact, even for part of a UTF-8 character)."""
        return bytes(self.intake.compiler.tokenizer.decode_bytes([token]))

    # ----------------------------------------------------------------------------- run

    @torch.inference_mode()
    def run(self, items: Iterable[Job | BadLine | None], emit: Emit,
            should_admit: Callable[[], bool] = lambda: True) -> None:
        """Drive every item to exactly one `emit`ted result; returns when all are done,
        or, once `should_admit` turns False, when every line already started is done
        (lines read ahead but not started then have no result). A None item means
        "nothing ready yet" (see `scheduler.Source`): with such a source the run only
        ends on `should_admit`."""
        source: Source | None = iter(items)
        emit = self.tracer.wrap_emit(emit)  # trace hook
        scheduler = self.scheduler
        self.runner.open()
        try:
            while True:
                admitting = should_admit()
                if admitting and source is not None and scheduler.has_room():
                    source = scheduler.read_ahead(source, emit)
                # Samples of a line already started are admitted even after admission of
                # new lines stopped (an interrupt): the line must still get its result.
                self._finish(scheduler.admit(emit, new_lines=admitting), emit)
                if not scheduler.busy():
                    if not scheduler.pending() and (
                            not admitting or (source is None and not scheduler.ahead)):
                        # Every line written: `auto`'s missing steps built now, for the
                        # next run (decode_steps.py), in a process that outlives this one.
                        self.runner.model_pass.decode.run_ended()
                        return
                    continue
                self._step(emit, input_closed=source is None or not admitting)
        finally:
            self.runner.close()

    def _step(self, emit: Emit, input_closed: bool) -> None:
        plan = self.scheduler.schedule(input_closed)
        output = self.runner.execute_model(plan)
        self._finish(self.scheduler.update_from_output(plan, output), emit)

    def _finish(self, finished: list[Generation], emit: Emit) -> None:
        """The results of the generations that finished; their lines' next attempts go
        back to the scheduler."""
        if finished:
            self.scheduler.requeue(self.finishing.finish(finished, emit))
