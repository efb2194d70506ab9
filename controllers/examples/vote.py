"""A majority vote across branches: fork, let each branch answer, report the winner.

The sequence forks into `branches` branches that share the prompt's keys; each writes a
short answer (a host-enforced regex segment), appends it to the line's storage, and the
branch that finds every answer there sets the line's outputs. Sample with a temperature
above 0 (`--temperature 0.8`): greedy branches would all write the same answer.

Arg (JSON, optional): {"branches": 5, "pattern": "<regex of an answer>", "max_tokens": 16}.
Outputs: each branch's "answer"; the line's "answer" (the most common one; a tie goes to
the answer stored first) and "votes" ({answer: count}).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from aici_controller import Context, controller, fork, gen, set_line_output, set_output, storage

PATTERN = r"[A-Za-z0-9][A-Za-z0-9 .,'-]{0,39}"


@controller
def vote(ctx: Context) -> Generator[Any, Any, None]:
    args = ctx.arg_json()
    branches = int(args.get("branches", 5))
    yield fork(branches)  # resumes once in each branch, with its index
    answer = yield gen(regex=args.get("pattern", PATTERN),
                       max_tokens=int(args.get("max_tokens", 16)))
    answer = " ".join(answer.split())  # one line: the stored answers are newline-separated
    set_output("answer", answer)
    storage.append("answers", answer + "\n")
    answers = (storage.get("answers") or b"").decode().splitlines()
    if len(answers) == branches:  # the last branch to answer: count
        votes: dict[str, int] = {}
        for a in answers:
            votes[a] = votes.get(a, 0) + 1
        # (Not Counter.most_common: it imports heapq when called, and a component cannot
        # import at run time.) max keeps the first of equals: the answer stored first.
        set_line_output("answer", max(votes, key=votes.__getitem__))
        set_line_output("votes", votes)
