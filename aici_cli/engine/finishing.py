"""A finished generation becomes its line's result, or waits for its siblings (the `n`
samples, a scored line's choices, a fork's branches), or becomes the line's next attempt
(a relaxed schema's output that does not validate, retry.py).

The result of one generation is a pure function of it and its controller's answers
(`result_line.generation_result`); here its controller is asked, then closed. A next
attempt is queued (`retries`), not started: the scheduler admits it before the next plan,
ahead of new lines.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from aici_cli.engine.generation import Generation
from aici_cli.engine.result_line import (
    combine_samples,
    finished_text,
    generation_result,
    with_answer,
)
from aici_cli.engine.retry import next_attempt, with_attempts
from aici_cli.engine.rows import Prepared
from aici_cli.engine.scoring import combine_scores, score_fields, token_choice_results

Emit = Callable[[dict[str, Any]], None]


class Finishing:
    def __init__(self, tokenizer: Any, schema_retries: int, now: Callable[[], float]) -> None:
        self.tokenizer = tokenizer
        self.schema_retries = schema_retries
        self.now = now
        self.emit: Emit = lambda result: None  # the current run's
        self.retries: deque[Prepared] = deque()  # next attempts, for the scheduler
        self.dropping = False  # a forked line failed: its other sequences are to be dropped

    def finish(self, gen: Generation) -> None:
        """Emit a finished generation's result, or, for a sample, the line's result once
        its last sample finishes, or queue the line's next attempt."""
        result = self._result(gen)
        branches = gen.branches
        if branches is not None:
            if branches.failed:
                return  # the line's result is out: this sequence was stopped
            branches.finished(gen.sample, gen.path, result)
            if branches.forked:
                if result["finish_reason"] == "error":  # a fault ends a forked line
                    branches.failed = self.dropping = True
                    self.emit(with_answer(gen.job, branches.result((gen.sample, gen.path))))
                elif branches.live == 0:
                    self.emit(with_answer(gen.job, branches.result()))
                return
        group = gen.group
        if group is not None:
            if gen.token_choices is not None:
                options = list(gen.job.constraint.value) if gen.job.constraint else []
                group.results[:] = token_choice_results(result, options, gen.token_scores)
            else:
                group.results[gen.sample] = result
            if not group.done:
                return
            combine = combine_scores if group.scoring else combine_samples
            result = combine([r for r in group.results if r is not None])
            result["stats"].update(group.pass_times())  # a shared pass counted once
        else:
            retry = next_attempt(gen.job, result, self.schema_retries)
            if retry is not None:
                self.retries.append(Prepared.of(retry, gen.prompt, [*gen.earlier, result]))
                return
            result = with_attempts(result, gen.earlier)
        self.emit(with_answer(gen.job, result))

    def _result(self, gen: Generation) -> dict[str, Any]:
        """The generation's own result line; its controller answers, then is closed."""
        text = finished_text(gen, self.tokenizer)
        controller = gen.controller
        fields = controller.report(text) if controller is not None else {}
        extra = controller.stats() if controller is not None else {}
        if controller is not None:
            controller.close()
        result = generation_result(gen, text, fields, extra, self.now())
        if (gen.score_from is not None and result["finish_reason"] != "error"
                and gen.token_choices is None):
            result["score"] = score_fields(gen.choice, gen.logprob,
                                           len(gen.prompt) - gen.score_from, gen.greedy)
        return result
