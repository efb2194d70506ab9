"""An admitted line's generations: its `n` samples with their controllers, each after
its controller's `start` (which may fast-forward, stop or fork), or a scored line's
choices (one row each, or one row for one-token choices, scoring.py). Runs between
steps, when the scheduler admits the line."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

from aici_cli.control.line_scope import LineScope
from aici_cli.engine.branches import Branch, LineBranches
from aici_cli.engine.clock import Now, ms
from aici_cli.engine.decisions import Decisions, Place
from aici_cli.engine.generation import Generation, SampleGroup
from aici_cli.engine.intake import Emit, LineIntake
from aici_cli.engine.logits.logit_rules import LogitRules
from aici_cli.engine.logits.sampler import row_stream
from aici_cli.engine.rows import Prepared
from aici_cli.engine.scoring import ScoredChoice, shared_token_choices
from aici_cli.engine.trace_hooks import EngineTracer


class Launcher:
    def __init__(self, intake: LineIntake, decisions: Decisions, eos: Collection[int],
                 step_stats: bool, now: Now, origin: float,
                 tracer: Callable[[], EngineTracer]) -> None:
        self.intake = intake
        self.decisions = decisions
        self.eos = eos
        self.step_stats = step_stats
        self.now = now
        self.origin = origin  # lines' `started_ms` count from here
        self.tracer = tracer  # the engine's current tracer (trace hooks)

    def launch(self, line: Prepared, emit: Emit, finish: Place,
               wait: Place) -> list[Generation]:
        """The generations of `line` that need a row (in order). One that is done at once
        goes to `finish`; a fork's new branches go to `wait` as they are made (before
        their forking generation). A controller that cannot be built becomes the line's
        error result (and [])."""
        job = line.job
        if job.score:
            return self._launch_scored(line, emit, finish)
        with self.tracer().admission(job):  # trace hook
            controllers = self.intake.controllers(job, emit)
        if controllers is None:
            return []
        group = SampleGroup(job.n) if job.n > 1 else None
        branches = (LineBranches(LineScope(), job.n)
                    if any(c is not None for c in controllers) else None)
        waiting = []
        for i, controller in enumerate(controllers):
            gen = Generation(job, line.prompt, controller, row_stream(job.sampling.seed, i),
                             started=self.now(), group=group, sample=i, earlier=line.earlier,
                             branch=Branch(branches) if branches is not None else None)
            gen.stats.started_ms = ms(self.origin, gen.started)
            self.tracer().admitted(gen)  # trace hook
            gen.rules = LogitRules.of(job, line.prompt, self.eos)
            if self.step_stats:
                gen.steps = []
            if job.logprobs is not None:
                gen.logprobs = []
            if controller is not None:
                assert branches is not None
                controller.join_line(branches.scope)
                self.decisions.consult(gen, functools.partial(controller.start, line.prompt))
                self.decisions.make_fork(gen, finish, wait)
            if self.decisions.check_stop(gen):
                finish(gen)
            else:
                waiting.append(gen)
        return waiting

    def _launch_scored(self, line: Prepared, emit: Emit, finish: Place) -> list[Generation]:
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
            gen = Generation(job, ids, None, row_stream(job.sampling.seed, 0),
                             started=self.now(), group=group,
                             scored=ScoredChoice(start, options[0], tokens))
            return [gen]
        waiting = []
        for i, (option, (ids, start)) in enumerate(zip(options, sequences)):
            gen = Generation(job, ids, None, row_stream(job.sampling.seed, i),
                             started=self.now(), group=group, sample=i,
                             scored=ScoredChoice(start, option))
            gen.stats.started_ms = ms(self.origin, gen.started)
            self.tracer().admitted(gen)  # trace hook
            if start == len(ids):  # an empty choice: nothing to score
                gen.finish_with("stop")
                finish(gen)
            else:
                waiting.append(gen)
        return waiting
