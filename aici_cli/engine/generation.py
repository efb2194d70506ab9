"""One generation in the engine (a line, or one of its n samples): its tokens, its cache
row's fill, its controller and its stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from aici_cli.control.base import Controller, Directive
from aici_cli.errors import ControllerError
from aici_cli.jobs import Job
from aici_cli.stats import LineStats


@dataclass
class Finish:
    reason: str  # "stop" | "length" | "error"
    error: tuple[str, str] | None = None  # (type, message)
    text_end: int | None = None  # cut the text here (a stop string was found)


@dataclass
class SampleGroup:
    """The `n` samples of one line. One of them prefills the prompt; the others copy its
    keys from that row, and the line's result waits for all of them."""

    size: int
    prompt_len: int
    results: list[dict[str, Any] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.results = [None] * self.size

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
    generator: torch.Generator
    started: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    length: int = 0
    stats: LineStats = field(default_factory=LineStats)
    steps: list[dict[str, Any]] | None = None
    finish: Finish | None = None
    group: SampleGroup | None = None  # set when the line asks for n > 1 samples
    sample: int = 0  # which of the group's samples
    text_checked: int = 0  # chars of decoded output already searched for stop strings

    def __post_init__(self) -> None:
        self.pending = list(self.prompt)
        self.stats.prompt_tokens = len(self.prompt)

    def apply(self, directive: Directive) -> bool:
        """Apply a controller's directive: backtrack, then fast-forward tokens, within
        max_tokens. Returns whether the output changed."""
        if directive.backtrack:
            self.backtrack(directive.backtrack)
        ff_tokens = list(directive.ff_tokens)
        budget = self.job.max_tokens - len(self.output)
        if len(ff_tokens) > budget:
            ff_tokens = ff_tokens[:budget]
        self.output += ff_tokens
        self.pending += ff_tokens
        self.stats.ff_tokens += len(ff_tokens)
        if directive.stop:
            self.finish = Finish("stop")
        elif not self.pending and self.length > 0:
            # Everything is in the cache (a backtrack with nothing fast-forwarded): feed
            # the last token again so the next pass has logits for this row.
            self.length -= 1
            self.pending = [(self.prompt + self.output)[self.length]]
        return bool(directive.ff_tokens or directive.backtrack)

    def append(self, token: int) -> None:
        """A sampled token: in the output, and fed by the next pass."""
        self.output.append(token)
        self.pending.append(token)

    def fed(self) -> None:
        """This pass fed the pending tokens: they are in the cache now."""
        self.length += len(self.pending)
        self.pending = []

    def backtrack(self, n: int) -> None:
        if n > len(self.output):
            raise ControllerError(
                "bad_backtrack",
                f"backtrack of {n} tokens reaches past the prompt ({len(self.output)} generated)",
            )
        del self.output[len(self.output) - n :]
        self.text_checked = 0  # the rewritten tail must be searched for stop strings again
        from_pending = min(n, len(self.pending))
        del self.pending[len(self.pending) - from_pending :]
        self.length -= n - from_pending

    def adopt_prompt(self) -> None:
        """The prompt's keys were copied into this row: feed only what follows it, or
        the prompt's last token again when nothing does, for this row's own logits."""
        p = len(self.prompt)
        assert self.length == 0 and self.pending[:p] == self.prompt
        if len(self.pending) > p:
            self.length, self.pending = p, self.pending[p:]
        else:
            self.length, self.pending = p - 1, [self.prompt[-1]]
