"""A yes/no answer with a one-line reason, as two host-enforced segments.

Arg (JSON, optional): {"question": "..."}; the question is logged, the prompt carries it.
Outputs: "answer" ("yes" or "no") and "reason" (one line, at most 120 characters).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from aici_controller import Context, controller, fixed, gen, log, set_output


@controller
def yes_no(ctx: Context) -> Generator[Any, Any, None]:
    question = ctx.arg_json().get("question", "")
    if question:
        log(f"question: {question}")
    yield fixed(" Answer: ")
    answer = yield gen(choices=["yes", "no"])
    set_output("answer", answer)
    yield fixed("\nReason: ")
    reason = yield gen(regex=r"[^\n]{1,120}\n", max_tokens=60)
    set_output("reason", reason.strip())
    # Returning ends the sequence (the host gets `stop`).
