"""The README's fork example: three branches, each answering in its own way.

The sequence forks into 3 branches that share every token so far (their keys are not
computed again); each writes a short answer under a host-enforced regex and sets its
own `answer` output, which the line's result lists per branch in `choices`. Sample with
a temperature above 0 (`--temperature 0.8`): greedy branches would all write the same.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from aici_controller import Context, controller, fork, gen, set_output


@controller
def three_ways(ctx: Context) -> Generator[Any, Any, None]:
    yield fork(3)  # resumes once in each branch: 0, 1, 2
    answer = yield gen(regex=r"[A-Za-z ]{1,30}", max_tokens=12)
    set_output("answer", answer)  # this branch's choice in the result
