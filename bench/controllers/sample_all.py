"""The most trivial per-token controller: every step samples from all tokens.

Used by bench/controller_costs.py to time one guest call.
"""

from __future__ import annotations

from collections.abc import Sequence

from aici_controller import ALL, Action, Context, TokenController, controller, sample


@controller
class SampleAll(TokenController):
    def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
        return sample(ALL)
