"""A per-token controller: every sampled token is free of lowercase letters.

The token set is computed once on the host (a regex over the vocabulary; the guest holds
only a handle), so each step costs one small wasm call. Stops after `max_tokens` output
tokens (arg JSON, default 16) or when EOS is sampled. Whether EOS itself is allowed
depends on its text on the host (a special token that decodes to "" has no lowercase).
"""

from __future__ import annotations

from collections.abc import Sequence

from aici_controller import (
    Action,
    Context,
    TokenController,
    controller,
    not_matching,
    sample,
    set_output,
    stop,
)

# (?s): a token's text may contain a newline, which `.` would not match.
NO_LOWERCASE = not_matching(r"(?s).*[a-z].*")


@controller
class NoLowercase(TokenController):
    def start(self, ctx: Context) -> None:
        self.limit = int(ctx.arg_json().get("max_tokens", 16))
        if self.limit < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.limit}")

    def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
        if ctx.at_eos or len(ctx.tokens) >= self.limit:
            set_output("tokens", len(ctx.tokens))
            return stop()
        return sample(NO_LOWERCASE)
