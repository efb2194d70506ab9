"""The model runner: a `StepPlan` in, a `StepOutput` out. It runs the pass, fills and
applies the token masks, applies the lines' logit rules and samples; it touches no
scheduling state (rows, queues) and hands no token to a controller (update.py does).

Within a step (times in `StepClock` marks):
  1. the masks are filled in a worker thread, beside the forward pass: they depend only on
     tokens already known (llguidance and torch release the GIL);
  2. one packed forward pass over the plan's span (passes.py);
  3. the penalties, `logit_bias` and `min_tokens` hold of rows that set them, then the
     masks, in place (`penalties.py`, `masks.py`);
  4. one token for every row that samples (not scored, closing, failed or deferred).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from aici_cli.engine.cache import RowCache
from aici_cli.engine.clock import StepClock
from aici_cli.engine.generation import Generation
from aici_cli.engine.logprobs import log_softmax
from aici_cli.engine.masks import MaskVerdict, TokenMasks, apply_masks
from aici_cli.engine.passes import ModelPass
from aici_cli.engine.plan import StepOutput, StepPlan
from aici_cli.engine.sampling import sample
from aici_cli.engine.step_rules import checked_draft_picks, rules_before_masks
from aici_cli.models.load import LoadedModel
from aici_cli.vocabulary.config import EngineConfig
from aici_cli.vocabulary.errors import ControllerError


class ModelRunner:
    def __init__(self, lm: LoadedModel, cache: RowCache, config: EngineConfig) -> None:
        self.model_pass = ModelPass(lm, cache, config.deterministic, config.compile)
        self.masks = TokenMasks(config.batch_size, lm.vocab_size)
        self.masked_logprobs = config.logprobs_mode == "masked"
        self.pool: ThreadPoolExecutor | None = None  # the mask worker, for one run

    def open(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aici-mask")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def execute(self, plan: StepPlan, clock: StepClock) -> StepOutput:
        assert self.pool is not None, "open() first"
        gens = list(plan.gens)
        drafts = [list(d) for d in plan.drafts]  # a pass out of memory drops them
        masks = self.pool.submit(self.masks.fill, plan.span, gens)  # overlaps the pass
        clock.mark("forward")
        passed = self.model_pass.run(plan.first_row, gens, drafts, list(plan.offsets),
                                     plan.steps_ahead, plan.rows_bound)
        clock.mark("forwarded")
        verdict = _verdict(masks.result(), passed.out_of_memory)
        clock.mark("masks_ready")
        logits = passed.next_token_logits(len(gens))
        raw_logprobs = self._next_logprobs(logits, gens, masked=False)
        logits = rules_before_masks(logits, gens, verdict)
        greedy = apply_masks(logits, verdict)  # the failed rows now include empty masks
        next_logprobs = self._next_logprobs(logits, gens, masked=True) or raw_logprobs
        clock.mark("masked")
        real = [k for k, g in enumerate(gens) if g is not None and k not in verdict.deferred
                and k not in verdict.failed and k not in plan.scoring and k not in plan.closing]
        picked = _sample(logits, greedy.tolist(), real, gens)
        clock.mark("sampled")
        times = clock.times(plan.kind, rows=len(real), tokens=plan.fed)
        # Before any token is handed over: the outputs are those the pass saw.
        live = [None if k in verdict.failed else g for k, g in enumerate(gens)]
        predicted = (checked_draft_picks(passed, live, drafts, len(gens)) if any(drafts)
                     else [])
        return StepOutput(passed, times, verdict.failed, verdict.deferred,
                          list(zip(real, picked)), next_logprobs, drafts, predicted,
                          self.model_pass.fits)

    def _next_logprobs(self, logits: torch.Tensor, gens: list[Generation | None],
                       masked: bool) -> dict[int, torch.Tensor]:
        """Log-softmax of the next-token logits of the rows that want logprobs, taken
        before the masks apply (`masked` False) or after, as the run's mode says; {} at
        the other moment."""
        if masked != self.masked_logprobs:
            return {}
        return {k: log_softmax(logits[k]) for k, g in enumerate(gens)
                if g is not None and g.logprobs is not None and g.score_from is None}


def _verdict(verdict: MaskVerdict, out_of_memory: list[int]) -> MaskVerdict:
    """A row that ran out of memory even alone has no logits: it fails, whatever its
    controller answered."""
    for k in out_of_memory:
        verdict.deferred.pop(k, None)
        verdict.failed[k] = ControllerError(
            "out_of_memory", "out of memory even with this sequence alone in the pass")
    return verdict


def _sample(logits: torch.Tensor, greedy: list[int], real: list[int],
            gens: list[Generation | None]) -> list[int]:
    """One token for each row in `real` (greedy, or seeded temperature with min-p, top-k
    and top-p)."""
    chosen = [g for g in (gens[k] for k in real) if g is not None]
    return sample(logits, greedy, real, [g.job.temperature for g in chosen],
                  [g.job.top_p for g in chosen], [g.generator for g in chosen],
                  top_ks=[g.job.top_k for g in chosen], min_ps=[g.job.min_p for g in chosen])
