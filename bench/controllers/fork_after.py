"""Samples any token for `arg` steps (an integer; default 0), forks into 2, then stops:
what replaying a branch to its fork point costs after that many guest calls."""

from __future__ import annotations

from collections.abc import Sequence

from aici_controller import ALL, Action, Context, TokenController, controller, fork, sample, stop


@controller
class ForkAfter(TokenController):
    def start(self, ctx: Context) -> None:
        self.steps = int(ctx.arg or 0)

    def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
        if ctx.branch is not None:
            return stop()
        if len(ctx.tokens) >= self.steps:
            return fork(2)
        return sample(ALL)
