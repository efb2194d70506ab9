"""The model runner: a `StepPlan` in, a `StepOutput` out. It owns the KV cache and the
forward pass; it makes the plan's prefix copies, runs the pass, fills and applies the
token masks, applies the lines' logit rules and samples. It reads the plan's data only:
it touches no scheduling state (rows, queues), sees no generation and hands no token to
a controller (the scheduler's update does).

Within a step (times in `StepClock` marks, from the plan's start):
  1. the masks are filled in a worker thread, beside the forward pass: they depend only on
     tokens already known (llguidance and torch release the GIL); this is the one call
     into controllers, through `masks.MaskSource`;
  2. one packed forward pass over the plan's span (passes.py); where every sampling row is
     masked (and greedy, or the kernel exact), it stops at the final hidden states, and
     rows whose masks allow few tokens are projected at those alone (the masked projection,
     `logits/masked_projection.py`);
  3. the penalties, `logit_bias` and `min_tokens` hold of rows that set them, then the
     masks, in place (`logits/logit_rules.py`, `masks.py`);
  4. one token for every row that samples (not scored, taking its readout, failed or
     deferred).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from aici_cli.core.config import EngineConfig
from aici_cli.core.errors import ControllerError
from aici_cli.engine.clock import Now, StepClock
from aici_cli.engine.forward.cache import RowCache
from aici_cli.engine.forward.passes import ModelPass, PassOutput
from aici_cli.engine.logits.logit_rules import LogitRules, draft_picks, rules_before_masks
from aici_cli.engine.logits.masked_projection import MaskedProjection
from aici_cli.engine.logits.masks import (
    MaskVerdict,
    TokenMasks,
    allowed_mass,
    apply_masks,
    empty_masks,
)
from aici_cli.engine.logits.sampler import Draw, log_softmax, sample
from aici_cli.engine.plan import StepOutput, StepPlan
from aici_cli.models.load import LoadedModel


class ModelRunner:
    def __init__(self, lm: LoadedModel, cache: RowCache, config: EngineConfig,
                 now: Now) -> None:
        self.cache = cache
        self.model_pass = ModelPass(lm, cache, config.deterministic, config.compile,
                                    config.wide_prefill)
        self.masks = TokenMasks(config.batch_size, lm.vocab_size, torch.device(lm.device))
        self.masked_logprobs = config.logprobs_mode == "masked"
        self.projection = MaskedProjection.for_model(lm.model, lm.vocab_size,
                                                     torch.device(lm.device), config.deterministic)
        self.now = now
        self.pool: ThreadPoolExecutor | None = None  # the mask worker, for one run

    @property
    def compiles(self) -> bool:
        """Whether one-token steps may run compiled (`--compile` on or auto, supported)."""
        return self.model_pass.decode.compiled is not None

    def runs_compiled(self) -> bool:
        """Whether one-token steps run compiled now (for `auto`: once it chose to)."""
        return self.model_pass.decode.chosen

    def open(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aici-mask")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        self.masks.close()

    def execute_model(self, plan: StepPlan) -> StepOutput:
        assert self.pool is not None, "open() first"
        clock = StepClock(self.now, plan.started)
        for src, dst, n in plan.copies:  # before the pass: it reads those keys
            self.cache.copy_prefix(src, dst, n)
        b = len(plan.span)
        drafts = [list(d) for d in plan.drafts]  # a pass out of memory drops them
        masks = self.pool.submit(self.masks.fill, plan.span, plan.masks)  # beside the pass
        clock.mark("forward")
        hidden = self.projection is not None and self.projection.may_use(
            plan.draws, plan.masks, plan.rules, plan.logprobs, plan.offsets, drafts)
        step = (plan.first_row, plan.lengths, plan.chunks, drafts, plan.offsets,
                plan.steps_ahead, plan.rows_bound)
        passed = self.model_pass.run(*step, project=not hidden, prompt=plan.prompt or None)
        clock.mark("forwarded")
        verdict = _verdict(masks.result(), passed.out_of_memory)
        clock.mark("masks_ready")
        passed, whole = self._project(passed, verdict, plan.draws)  # counts in mask_ms
        logits = passed.next_token_logits(b)
        raw_logprobs = self._next_logprobs(logits, plan.logprobs, masked=False)
        allowed = verdict.allowed_on(logits.device, self.masks.vocab_size)
        logits = rules_before_masks(logits, plan.rules, plan.outputs,
                                    verdict.deferred.keys() | verdict.failed.keys(), allowed)
        # How much of the (ruled) distribution the constraint allows, where the pass
        # computed it whole (a masked projection has no mass outside the allowed ids).
        weighed = sorted(verdict.constrained) if whole and allowed is not None else []
        mass = (allowed_mass(logits[weighed], allowed[weighed])
                if weighed and allowed is not None else None)
        greedy, empty = apply_masks(logits, allowed)
        next_logprobs = self._next_logprobs(logits, plan.logprobs, masked=True) or raw_logprobs
        clock.mark("masked")
        real = [k for k, d in enumerate(plan.draws) if d is not None
                and k not in verdict.deferred and k not in verdict.failed]
        chosen = [d for d in (plan.draws[k] for k in real) if d is not None]
        picked = sample(logits, greedy, real, chosen)  # [len(real)], on the device
        # The step's one read back: the tokens, whether each mask allowed nothing, the
        # allowed mass of the weighed rows and the draft picks, in one copy.
        draft_argmax = passed.draft_argmax(b) if any(drafts) else None
        tokens, empty_read, masses, draft_read = read_back(picked, empty, mass, draft_argmax)
        if empty_read is not None:
            empty_masks(verdict, [bool(x) for x in empty_read])
        sampled = [(k, int(t)) for k, t in zip(real, tokens or []) if k not in verdict.failed]
        clock.mark("sampled")
        times = clock.times(plan.kind, rows=len(sampled), tokens=plan.fed)
        predicted = (checked_draft_picks(passed, [int(t) for t in draft_read], plan.rules,
                                         plan.outputs, drafts, b, verdict.failed)
                     if draft_read is not None else [])
        return StepOutput(passed, clock, times, verdict.failed, verdict.deferred,
                          sampled, next_logprobs, drafts, predicted,
                          self.model_pass.fits, dict(zip(weighed, masses or [])))

    def _project(self, passed: PassOutput, verdict: MaskVerdict,
                 draws: Sequence[Draw | None]) -> tuple[PassOutput, bool]:
        """A pass that stopped at hidden states, projected now the masks are known: at the
        allowed ids of the rows that sample, or whole (`MaskedProjection.project`); and
        whether its logits are whole (every token's value computed)."""
        if not passed.hidden or self.projection is None:
            return passed, True
        rows = [k for k, d in enumerate(draws) if d is not None
                and k not in verdict.deferred and k not in verdict.failed]
        used = self.projection.used
        logits = self.projection.project(passed.every, verdict.allowed, rows)
        return dataclasses.replace(passed, every=logits, hidden=False), \
            self.projection.used == used

    def _next_logprobs(self, logits: torch.Tensor, rows: Collection[int],
                       masked: bool) -> dict[int, torch.Tensor]:
        """Log-softmax of the next-token logits of the rows that want logprobs, taken
        before the masks apply (`masked` False) or after, as the run's mode says; {} at
        the other moment."""
        if masked != self.masked_logprobs:
            return {}
        return {k: log_softmax(logits[k]) for k in sorted(rows)}


def _verdict(verdict: MaskVerdict, out_of_memory: list[int]) -> MaskVerdict:
    """A row that ran out of memory even alone has no logits: it fails, whatever its
    controller answered."""
    for k in out_of_memory:
        verdict.deferred.pop(k, None)
        verdict.failed[k] = ControllerError(
            "out_of_memory", "out of memory even with this sequence alone in the pass")
    return verdict


def read_back(*parts: torch.Tensor | None) -> list[list[float] | None]:
    """Each of `parts` (1-D tensors on the device; None: absent) as a list, from one copy
    to the host: on an accelerator, the step's one wait for the device."""
    present = [p.double().flatten() for p in parts if p is not None]
    values = torch.cat(present).tolist() if present else []
    out: list[list[float] | None] = []
    at = 0
    for p in parts:
        if p is None:
            out.append(None)
            continue
        out.append(values[at : at + p.numel()])
        at += p.numel()
    return out


def checked_draft_picks(out: PassOutput, picks: list[int], rules: Sequence[LogitRules | None],
                        outputs: Sequence[int], drafts: Sequence[Sequence[int]], b: int,
                        failed: Collection[int]) -> list[int]:
    """The model's pick after every draft position (`picks`: `PassOutput.draft_argmax`,
    read back with the step's tokens), with the picks of rows that have rules (and did not
    fail) taken under them (`logit_rules.draft_picks`), so drafts check against the
    penalised argmax."""
    ruled = [k for k, r in enumerate(rules) if r is not None and drafts[k] and k not in failed]
    if not ruled:
        return picks
    spans = [(out.draft_at(k, b), len(drafts[k]) - 1) for k in ruled]
    # A copy: the raw rows still give the draft tokens' logprobs.
    logits = torch.cat([out.every[b + at : b + at + n] for at, n in spans]).float()
    chosen = [r for r in (rules[k] for k in ruled) if r is not None]
    new = draft_picks(logits, chosen, [drafts[k] for k in ruled], [outputs[k] for k in ruled])
    i = 0
    for at, n in spans:
        picks[at : at + n] = new[i : i + n]
        i += n
    return picks
