"""What passes between the three parts of a step: the scheduler's `StepPlan` (who feeds
what), the model runner's `StepOutput` (what the pass and the sampler made of it). The
scheduler applies an output to the generations it planned (`Scheduler.update_from_output`).

Everything is by *position*: position k of a step is cache row `span[k]`. The plan is
data: token ids, lengths, positions to read, how to sample; the runner never sees a
generation. Two kinds of live object ride along, each behind a narrow interface: a row's
mask source (its controller's `masks.MaskSource` side, called on the mask worker) and its
random stream (`sampler.Draw.stream`, advanced by the sampler); its logit rules
(`logit_rules.LogitRules`) are read only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aici_cli.control.base import Directive
from aici_cli.core.errors import ControllerError
from aici_cli.core.line_stats import StepTimes
from aici_cli.engine.clock import StepClock
from aici_cli.engine.forward.passes import PassOutput
from aici_cli.engine.logits.logit_rules import LogitRules
from aici_cli.engine.logits.masks import MaskSource
from aici_cli.engine.logits.sampler import Draw


@dataclass(frozen=True)
class StepPlan:
    """One step, decided before the pass.

    Per position k: `lengths[k]` tokens are in row `span[k]`'s cache; it feeds `chunks[k]`
    (empty: it sits the pass out) and its prompt-lookup draft `drafts[k]` (empty: none);
    `offsets[k]` are offsets in its chunk whose logits it needs too (a scored choice's, or
    fast-forwarded tokens' for raw logprobs); `draws[k]` is how it samples (None: it does
    not: it sits out, is a scored choice, or takes its readout); `masks[k]` fills its
    mask (None: unconstrained, or not sampled); `rules[k]` its logit rules (synced with its
    output, `outputs[k]` tokens long). `copies` are prefix copies `(src, dst, n)` to make,
    in order, before the pass (`rows.RowTable.take_part`). `logprobs`: rows that read the
    next token's log-softmax; `scoring` rows are read, not sampled; `readout` rows finished
    and take their readout: one more pass, only to read the logprobs of their last
    fast-forwarded tokens.
    `steps_ahead` bounds the one-token steps still to come (whether compiling the decode
    step pays); `rows_bound` the rows (below). `started`: the step's clock start.
    `prompt[k]`: how many of `chunks[k]`'s first tokens are its line's prompt."""

    span: tuple[int, ...]  # the cache rows of the pass, consecutive
    lengths: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    copies: tuple[tuple[int, int, int], ...]
    drafts: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    draws: tuple[Draw | None, ...]
    masks: tuple[MaskSource | None, ...]
    rules: tuple[LogitRules | None, ...]
    outputs: tuple[int, ...]
    logprobs: frozenset[int]
    scoring: frozenset[int]
    readout: frozenset[int]
    kind: str  # "prefill" (a row feeds its prompt) | "decode"
    fed: int  # positions fed to the model
    steps_ahead: int
    # The rows the run can still occupy: the highest busy row + 1 once no line can come
    # (the input is read to its end and nothing waits), else every row. The compiled
    # step's graph on CPU is sized by it (compiled.py): a one-line run computes one row.
    rows_bound: int = 0
    started: float = 0.0
    # Per position: how many of its chunk's first tokens are its line's prompt (they run
    # on dense copies where a 16-bit run makes them: models/quant/prompt_tokens.py).
    prompt: tuple[int, ...] = ()

    @property
    def first_row(self) -> int:
        return self.span[0]


@dataclass
class StepOutput:
    """What the runner made of a plan, by position. `failed`: rows that cannot go on (a
    mask that failed or allows nothing, out of memory even alone): their error is their
    finish. `deferred`: rows whose controller answered with a directive instead of a mask
    (applied in place of a token). `sampled`: the token of every other row that was
    sampled, in position order. `next_logprobs`: log-softmax of the next-token logits of
    the rows that want logprobs (raw or masked, as the run's mode says). `predicted[j]`:
    the model's pick after the j-th draft position (see `PassOutput.draft_at`). `fits`:
    rows that may run at once from now on (lowered when a pass ran out of memory).
    `clock`: the step's marks so far; `times` its timings (the update adds the
    controllers' and the step's own)."""

    passed: PassOutput
    clock: StepClock
    times: StepTimes
    failed: dict[int, ControllerError]
    deferred: dict[int, Directive]
    sampled: list[tuple[int, int]]
    next_logprobs: dict[int, torch.Tensor]
    drafts: list[list[int]]  # the plan's drafts as fed (a pass out of memory drops them)
    predicted: list[int] = field(default_factory=list)
    fits: int | None = None
    # The probability the (ruled) distribution gave the tokens its mask allows, by
    # position, for the constrained rows whose logits the pass computed whole.
    allowed_mass: dict[int, float] = field(default_factory=dict)
