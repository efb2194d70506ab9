"""One generation in the engine (a line, one of its n samples, a scored choice's row, or a
branch of a fork): its tokens, its cache row's fill, its controller and its stats.

The state of each feature that only some generations use is a small object owned by the
module that changes it: a scored choice's (`scoring.ScoredChoice`), a forking line's
sequence (`branches.Branch`), the prompt-lookup draft gate (`draft.DraftGate`), the stop
scan (`stops.StopScan`), the logit rules (`logit_rules.LogitRules`).

`finish` is set in one place, `finish_with`.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from aici_cli.control.base import Controller, Directive
from aici_cli.core.errors import ControllerError
from aici_cli.core.job import Job
from aici_cli.core.line_stats import LineStats, StepTimes, shared_pass_times
from aici_cli.engine.branches import Branch
from aici_cli.engine.draft import DraftGate
from aici_cli.engine.logits.logit_rules import LogitRules
from aici_cli.engine.logits.sampler import RowStream
from aici_cli.engine.scoring import ScoredChoice
from aici_cli.engine.stops import StopScan


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length" | "error"
    error: tuple[str, str] | None = None  # (type, message)
    text_end: int | None = None  # cut the text here (a stop string was found)


@dataclass
class SampleGroup:
    """The `n` samples of one line: the line's result waits for all of them. (They share
    the prompt's keys through the prefix cache, see `rows.py`.)"""

    size: int
    scoring: bool = False  # the rows of a scored line's choices, not samples
    results: list[dict[str, Any] | None] = field(default_factory=list)
    # Every pass any of the rows took part in, once (by identity: the engine keeps each
    # StepTimes for the run), so the line's pass times count a shared pass once.
    passes: dict[int, StepTimes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.results = [None] * self.size

    def pass_times(self) -> dict[str, float]:
        return shared_pass_times(self.passes.values())

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.results)


@dataclass
class Generation:
    """Invariant: `length` tokens of `prompt + output` are in the cache row; the rest,
    `pending`, are appended but not yet fed to the model (fed by the next forward pass)."""

    job: Job
    prompt: list[int]
    controller: Controller | None
    stream: RowStream  # its random numbers (`logits/sampler.py`)
    started: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    length: int = 0
    stats: LineStats = field(default_factory=LineStats)
    steps: list[dict[str, Any]] | None = None  # --step-stats records
    group: SampleGroup | None = None  # set when the line asks for n > 1 samples
    sample: int = 0  # which of the group's samples
    # The results of the line's earlier attempts (a relaxed schema's retries, retry.py).
    earlier: list[dict[str, Any]] = field(default_factory=list)
    # With logprobs: one record per output token so far (None where none could be read).
    logprobs: list[dict[str, Any] | None] | None = None
    read_out: bool = False  # finished, and took its readout (a pass for its last logprobs)
    rules: LogitRules | None = None  # penalties, logit_bias, min_tokens (None: none)
    scored: ScoredChoice | None = None  # a scored choice's row: read once, never sampled
    branch: Branch | None = None  # its line's sequences, once its controller can fork
    draft: DraftGate = field(default_factory=DraftGate)
    stops: StopScan = field(default_factory=StopScan)
    _finish: Finish | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.pending = list(self.prompt)
        self.stats.prompt_tokens = len(self.prompt)

    @property
    def finish(self) -> Finish | None:
        """How the generation ended (None: it goes on)."""
        return self._finish

    def finish_with(self, reason: str, error: tuple[str, str] | None = None,
                    text_end: int | None = None) -> None:
        """The one place a generation's end is set; a later call replaces it (a
        controller that fails after it stopped ends with its error)."""
        self._finish = Finish(reason, error, text_end)

    @property
    def forking(self) -> bool:
        """Its controller asked for a fork that is not made yet (it takes no tokens)."""
        return self.branch is not None and self.branch.wanted > 0

    def apply(self, directive: Directive) -> bool:
        """Apply a controller's directive: backtrack, then fast-forward tokens, within
        max_tokens; a stop ends the generation with the directive's reason. Returns
        whether the output changed."""
        if directive.backtrack:
            self.backtrack(directive.backtrack)
        ff_tokens = list(directive.ff_tokens)
        if (directive.backtrack and ff_tokens and self.logprobs is not None
                and not self.pending and self.length > 0):
            # The first new token's logprob needs the logits after the last kept token,
            # which is in the cache: feed it again (same slot) so the pass reads them.
            self._feed_last_again()
        budget = self.job.max_tokens - len(self.output)
        if len(ff_tokens) > budget:
            ff_tokens = ff_tokens[:budget]
        self.output += ff_tokens
        self.pending += ff_tokens
        self.stats.ff_tokens += len(ff_tokens)
        if directive.stop:
            self.finish_with(directive.finish)
        elif not self.pending and self.length > 0:
            # Everything is in the cache (a backtrack with nothing fast-forwarded): feed
            # the last token again so the next pass has logits for this row.
            self._feed_last_again()
        return bool(directive.ff_tokens or directive.backtrack)

    def _feed_last_again(self) -> None:
        self.length -= 1
        self.pending = [(self.prompt + self.output)[self.length]]

    def append(self, token: int) -> None:
        """A sampled token: in the output, and fed by the next pass."""
        self.output.append(token)
        self.pending.append(token)

    def took_part(self, times: StepTimes) -> None:
        """This pass fed the pending tokens (they are in the cache now); count its time."""
        st = self.stats
        st.forward_passes += 1
        if self.group is not None:
            self.group.passes[id(times)] = times
        if self.branch is not None:
            self.branch.line.passes[id(times)] = times
        st.forward_ms += times.forward_ms
        st.mask_ms += times.mask_ms
        st.sample_ms += times.sample_ms
        self.length += len(self.pending)
        self.pending = []

    def fed_draft_token(self) -> None:
        """The one pending token was fed in this pass too, as a draft token (a draft's
        tokens are fed after the row's own): it is in the cache now."""
        assert len(self.pending) == 1
        self.length += 1
        self.pending = []

    def record_step(self, times: StepTimes, sampled: int, ff_tokens: int,
                    controller_ms: float) -> None:
        """A `--step-stats` record of the pass this generation took part in."""
        if self.steps is None:
            return
        self.steps.append({
            "step": len(self.steps),
            "kind": "prefill" if self.stats.forward_passes == 1 else "decode",
            "sampled": sampled,
            "forced": ff_tokens,  # the result format's name for fast-forward tokens
            "forward_ms": round(times.forward_ms, 3),
            "mask_ms": round(times.mask_ms, 3),
            "controller_ms": round(controller_ms, 3),
            "sample_ms": round(times.sample_ms, 3),
        })

    def backtrack(self, n: int) -> None:
        if n > len(self.output):
            raise ControllerError(
                "bad_backtrack",
                f"backtrack of {n} tokens reaches past the prompt ({len(self.output)} generated)",
            )
        keep = len(self.output) - n
        if self.rules is not None:
            self.rules.truncate(self.output, keep)
        del self.output[keep:]
        self.stops.rewind(keep)  # the rewritten tail must be searched again
        if self.logprobs is not None:
            del self.logprobs[len(self.output) :]
        from_pending = min(n, len(self.pending))
        del self.pending[len(self.pending) - from_pending :]
        self.length -= n - from_pending

    def cacheable(self) -> list[int]:
        """The tokens whose keys a cache row may already hold before this generation's
        first pass: its prompt, or for a branch of a fork, its prompt and output (the
        tokens before the fork are in the forking row)."""
        if self.branch is not None and self.branch.from_fork:
            return self.prompt + self.output
        return self.prompt

    def cache_limit(self) -> int:
        """Most of `cacheable()` the prefix cache may provide: all but the last token (fed
        for this row's own logits), or for a scored choice all before the choice's first
        token's predecessor (those logits are the score)."""
        if self.scored is not None:
            return self.scored.start - 1
        return len(self.cacheable()) - 1

    def split(self, controller: Controller, stream: RowStream,
              path: tuple[int, ...]) -> Generation:
        """A new branch of this generation at a fork: the same tokens so far (whose keys
        its row takes from this one's, `rows.py`), its own controller, sampler and stats.
        It starts with this generation's clock, first-token time, logprobs, logit-rule
        counts and stop scan; its stats count its own work from the fork on."""
        assert self.branch is not None
        branch = Generation(self.job, self.prompt, controller, stream, started=self.started,
                            group=self.group, sample=self.sample, earlier=self.earlier,
                            branch=self.branch.child(path))
        branch.output = list(self.output)
        branch.pending = self.prompt + branch.output
        branch.stats.ttft_ms = self.stats.ttft_ms
        branch.steps = [] if self.steps is not None else None
        branch.logprobs = list(self.logprobs) if self.logprobs is not None else None
        branch.rules = copy.deepcopy(self.rules)
        branch.stops = dataclasses.replace(self.stops)
        return branch

    def take_cached(self, n: int) -> None:
        """Before its first pass: the row's cache holds the keys of the first `n` prompt
        tokens already (a prefix-cache hit); feed only what follows them."""
        assert self.stats.forward_passes == 0 and n <= self.cache_limit()
        self.stats.cached_tokens = n
        self.length = n
        self.pending = (self.prompt + self.output)[n:]
