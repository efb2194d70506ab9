"""vote.py without the fork and the vote: one regex answer per sequence (run with `n` to
compare n samples with n branches). Arg: {"pattern": ..., "max_tokens": ...}."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from aici_controller import Context, controller, gen, set_output

PATTERN = r"[A-Za-z0-9][A-Za-z0-9 .,'-]{0,39}"


@controller
def answer_once(ctx: Context) -> Generator[Any, Any, None]:
    args = ctx.arg_json()
    answer = yield gen(regex=args.get("pattern", PATTERN),
                       max_tokens=int(args.get("max_tokens", 16)))
    set_output("answer", " ".join(answer.split()))
