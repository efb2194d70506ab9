"""What passes between the three parts of a step: the scheduler's `StepPlan` (who feeds
what), the model runner's `StepOutput` (what the pass and the sampler made of it). The
update applies an output to the plan's generations (update.py).

Everything is by *position*: position k of a step is cache row `span[k]`, and `gens[k]`
is the generation feeding there (None: an idle row, or a new one waiting a pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aici_cli.control.base import Directive
from aici_cli.engine.generation import Generation
from aici_cli.engine.passes import PassOutput
from aici_cli.vocabulary.errors import ControllerError
from aici_cli.vocabulary.line_stats import StepTimes


@dataclass(frozen=True)
class StepPlan:
    """One step, decided before the pass. `drafts[k]`: the prompt-lookup draft row k feeds
    (empty: none); `offsets[k]`: offsets in its pending tokens whose logits it needs too
    (a scored choice's, or fast-forwarded tokens' for raw logprobs). `scoring` rows are
    read, not sampled; `closing` rows finished and take one more pass for the logprobs of
    their last fast-forwarded tokens. `steps_ahead` bounds the one-token steps still to
    come (whether compiling the decode step pays); `rows_bound` the rows (below)."""

    span: tuple[int, ...]  # the cache rows of the pass, consecutive
    gens: tuple[Generation | None, ...]
    drafts: tuple[list[int], ...]
    offsets: tuple[list[int], ...]
    scoring: frozenset[int]
    closing: frozenset[int]
    kind: str  # "prefill" (a row feeds its prompt) | "decode"
    fed: int  # positions fed to the model
    steps_ahead: int
    # The rows the run can still occupy: the highest busy row + 1 once no line can come
    # (the input is read to its end and nothing waits), else every row. The compiled
    # step's graph on CPU is sized by it (compiled.py): a one-line run computes one row.
    rows_bound: int = 0

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
    rows that may run at once from now on (lowered when a pass ran out of memory)."""

    passed: PassOutput
    times: StepTimes
    failed: dict[int, ControllerError]
    deferred: dict[int, Directive]
    sampled: list[tuple[int, int]]
    next_logprobs: dict[int, torch.Tensor]
    drafts: list[list[int]]  # the plan's drafts as fed (a pass out of memory drops them)
    predicted: list[int] = field(default_factory=list)
    fits: int | None = None
