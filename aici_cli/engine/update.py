"""The update: a `StepOutput` applied to the generations of its plan (the scheduler's
`update_from_output` hands them over, by position). Each sampled token (and the draft
tokens the model confirmed) goes to its generation's controller, which answers with
fast-forward tokens, a backtrack, a stop or a fork (decisions.py); a deferred directive
is applied in place of a token; scored rows take their scores; fast-forwarded tokens fed
in the pass get their logprobs. Touches no row or queue: it says which positions may be
done and which want a fork, and the scheduler retires and forks them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from aici_cli.control.base import Directive
from aici_cli.core.line_stats import StepTimes
from aici_cli.engine.clock import Now, ms
from aici_cli.engine.decisions import Decisions
from aici_cli.engine.generation import Generation
from aici_cli.engine.logits.logprobs import TokenBytes, entry, fill_fed
from aici_cli.engine.logits.sampler import log_softmax
from aici_cli.engine.plan import StepOutput, StepPlan
from aici_cli.engine.trace_hooks import EngineTracer

Gens = Sequence[Generation | None]  # by position in the step (None: not taking part)


@dataclass(frozen=True)
class Applied:
    """What the update leaves to the scheduler: the positions that may have finished, in
    the order their results go out; those whose controller wants a fork, in the order
    they asked; the controllers' ms of the step."""

    done: list[int]
    forking: list[int]
    controller_ms: float


class Update:
    def __init__(self, decisions: Decisions, masked_logprobs: bool, token_bytes: TokenBytes,
                 now: Now, tracer: Callable[[], EngineTracer]) -> None:
        self.decisions = decisions
        self.masked_logprobs = masked_logprobs
        self.token_bytes = token_bytes
        self.now = now
        self.tracer = tracer  # the engine's current tracer (trace hooks)

    def apply(self, gens: Gens, plan: StepPlan, out: StepOutput) -> Applied:
        """`gens`: the plan's generations, None where the row failed."""
        self._fill_fed_logprobs(gens, out)
        controller_ms = self._hand_over(gens, out)
        for k, directive in out.deferred.items():
            gen = gens[k]
            if gen is not None:
                self._commit_directive(gen, directive, out.times)
        self._score(gens, plan.scoring, out)  # scored choices: read once, then done
        for k in plan.readout:  # took their readout: their logprobs are filled
            gen = gens[k]
            if gen is not None:
                gen.took_part(out.times)
                gen.read_out = True
        real = [k for k, _ in out.sampled]
        done = [*real, *out.deferred, *sorted(plan.scoring), *sorted(plan.readout)]
        forking = [k for k in (*real, *out.deferred)
                   if (g := gens[k]) is not None and g.forking]
        return Applied(done, forking, controller_ms)

    def _fill_fed_logprobs(self, gens: Gens, out: StepOutput) -> None:
        """Logprobs of the fast-forwarded tokens this pass fed (before any new token)."""
        for k, gen in enumerate(gens):
            if gen is not None and gen.logprobs is not None and gen.scored is None:
                logits = None if self.masked_logprobs else out.passed.scored_logits(k)
                fill_fed(gen, logits, self.token_bytes)

    def _hand_over(self, gens: Gens, out: StepOutput) -> float:
        """Give each row its sampled token and the draft tokens the model confirmed;
        returns the controllers' ms."""
        b = len(gens)
        controller_ms = 0.0
        for k, token in out.sampled:
            gen = gens[k]
            assert gen is not None
            if k in out.allowed_mass:
                gen.stats.weigh(out.allowed_mass[k])
            if k in out.next_logprobs and not self.decisions.ends(gen, token):
                self._record_logprob(gen, out.next_logprobs[k], token)
            controller_ms += self._commit(gen, token, out.times)
            draft = out.drafts[k]
            if draft:
                at = out.passed.draft_at(k, b)
                take = self.decisions.take_token
                if gen.logprobs is not None:  # each draft token's from its checking position
                    checks = out.passed.every[b + at : b + at + len(draft) - 1]
                    take = functools.partial(self._take_draft_token, checks=iter(checks))
                controller_ms += accept_draft(gen, draft, token,
                                              out.predicted[at : at + len(draft) - 1], take)
        return controller_ms

    def _commit(self, gen: Generation, token: int, times: StepTimes) -> float:
        """The row took part in this pass and sampled `token`; returns the controller's
        ms."""
        gen.took_part(times)
        if gen.stats.ttft_ms == 0.0:
            gen.stats.ttft_ms = ms(gen.started, self.now())
            self.tracer().first_token(gen)  # trace hook
        ff_before = gen.stats.ff_tokens
        controller_ms = self.decisions.take_token(gen, token)
        gen.record_step(times, sampled=0 if self.decisions.ends(gen, token) else 1,
                        ff_tokens=gen.stats.ff_tokens - ff_before,
                        controller_ms=controller_ms)
        return controller_ms

    def _commit_directive(self, gen: Generation, directive: Directive,
                          times: StepTimes) -> None:
        """The controller answered this pass with a directive instead of a mask: apply it
        in place of a sampled token (the pass's logits for this row go unused)."""
        gen.took_part(times)
        ff_before = gen.stats.ff_tokens
        self.decisions.apply_deferred(gen, directive)
        gen.record_step(times, sampled=0, ff_tokens=gen.stats.ff_tokens - ff_before,
                        controller_ms=0.0)

    def _record_logprob(self, gen: Generation, logprobs: torch.Tensor, token: int) -> None:
        assert gen.logprobs is not None
        gen.logprobs += [None] * (len(gen.output) - len(gen.logprobs))
        gen.logprobs.append(entry(logprobs, token, gen.job.logprobs or 0, self.token_bytes))

    def _take_draft_token(self, gen: Generation, token: int,
                          checks: Iterator[torch.Tensor]) -> float:
        """`Decisions.take_token` for an accepted draft token, recording its logprob
        first: the accepted tokens come in draft order, draft token i + 1 checked by the
        logits after draft token i, the i-th of `checks`."""
        self._record_logprob(gen, log_softmax(next(checks)), token)
        return self.decisions.take_token(gen, token)

    @staticmethod
    def _score(gens: Gens, scoring: frozenset[int], out: StepOutput) -> None:
        for k in sorted(scoring):
            gen = gens[k]
            if gen is None:  # failed (out of memory even alone)
                continue
            assert gen.scored is not None
            gen.took_part(out.times)
            gen.scored.read(gen.prompt, out.passed.scored_logits(k))
            gen.finish_with("stop")


def accept_draft(gen: Generation, draft: Sequence[int], picked: int,
                 predicted: Sequence[int], take: Callable[[Generation, int], float]) -> float:
    """Take the draft's tokens after `picked` while each is what the model predicts after
    the one before (`predicted[j]`: its unmasked argmax after draft[j], under the line's
    penalties and biases), so the output is what greedy decoding gives; stop at anything
    else the generation does: finishing, fast-forward tokens, a backtrack, a fork. `take`
    appends a token as if it had been sampled and returns the controller's ms; returns
    their sum. The row's `DraftGate` learns what the draft brought."""
    taken = gen.stats.draft_tokens
    spent = _accept(gen, draft, picked, predicted, take)
    gen.draft.passed(gen.stats.draft_tokens - taken, len(gen.output))
    return spent


def _accept(gen: Generation, draft: Sequence[int], picked: int,
            predicted: Sequence[int], take: Callable[[Generation, int], float]) -> float:
    if draft[0] != picked or gen.finish is not None:
        return 0.0
    spent = 0.0
    previous = picked
    for token, expected in zip(draft[1:], predicted):
        # An allowed token that is the unmasked argmax is the masked argmax too.
        if (token != expected or gen.finish is not None or gen.forking
                or gen.pending != [previous]):
            break
        # Ask again from the controller's current state: a segment may have ended
        # (its guest decides what follows) since the draft was checked.
        if gen.controller is not None and gen.controller.valid_prefix([token]) < 1:
            break
        gen.fed_draft_token()  # `previous` was fed in this pass as a draft token
        spent += take(gen, token)
        gen.stats.draft_tokens += 1
        previous = token
    return spent
