"""A finished generation becomes its line's result, or waits for its siblings (the `n`
samples, a scored line's choices, a fork's branches), or becomes the line's next attempt
(a relaxed schema's output that does not validate, retry.py).

The scheduler hands over the generations that finished, in the order they finished
(`Scheduler.admit`, `Scheduler.update_from_output`); what becomes of a forking line's
sequence was decided when it ended (`branches.Ending`). The result of one generation is
a pure function of it and its controller's answers (`result_line.generation_result`);
here its controller is asked, then closed. A next attempt goes back to the scheduler,
which launches it before the next plan, ahead of new lines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from aici_cli.engine.branches import Ending
from aici_cli.engine.generation import Generation
from aici_cli.engine.intake import Emit
from aici_cli.engine.result_line import (
    combine_samples,
    finished_text,
    generation_result,
    with_answer,
)
from aici_cli.engine.retry import next_attempt, with_attempts
from aici_cli.engine.rows import Prepared
from aici_cli.engine.scoring import combine_scores, token_choice_results


class Finishing:
    def __init__(self, tokenizer: Any, schema_retries: int, now: Callable[[], float]) -> None:
        self.tokenizer = tokenizer
        self.schema_retries = schema_retries
        self.now = now

    def finish(self, gens: Iterable[Generation], emit: Emit) -> list[Prepared]:
        """`emit` each finished generation's result, or, for a sample, the line's result
        once its last sample finishes; returns the lines' next attempts, in order."""
        retries = []
        for gen in gens:
            retry = self._finish(gen, emit)
            if retry is not None:
                retries.append(retry)
        return retries

    def _finish(self, gen: Generation, emit: Emit) -> Prepared | None:
        result = self._result(gen)
        branch = gen.branch
        if branch is not None:
            ending, line, key = branch.ending, branch.line, (gen.sample, branch.path)
            assert ending is not None, "the scheduler decides a sequence's ending"
            if ending is Ending.DROPPED:
                return None  # the line's result is out: this sequence was stopped
            line.record(key, result)
            if ending is Ending.FAILS:
                emit(with_answer(gen.job, line.result(key)))
            elif ending is Ending.LAST:
                emit(with_answer(gen.job, line.result()))
            if ending is not Ending.ALONE:
                return None
        group = gen.group
        if group is not None:
            if gen.scored is not None and gen.scored.token_choices is not None:
                options = list(gen.job.constraint.value) if gen.job.constraint else []
                group.results[:] = token_choice_results(result, options, gen.scored.token_scores)
            else:
                group.results[gen.sample] = result
            if not group.done:
                return None
            combine = combine_scores if group.scoring else combine_samples
            result = combine([r for r in group.results if r is not None])
            result["stats"].update(group.pass_times())  # a shared pass counted once
        else:
            retry = next_attempt(gen.job, result, self.schema_retries)
            if retry is not None:
                return Prepared.of(retry, gen.prompt, [*gen.earlier, result])
            result = with_attempts(result, gen.earlier)
        emit(with_answer(gen.job, result))
        return None

    def _result(self, gen: Generation) -> dict[str, Any]:
        """The generation's own result line; its controller answers, then is closed."""
        text = finished_text(gen, self.tokenizer)
        controller = gen.controller
        fields = controller.report(text) if controller is not None else {}
        extra = controller.stats() if controller is not None else {}
        if controller is not None:
            controller.close()
        result = generation_result(gen, text, fields, extra, self.now())
        scored = gen.scored
        if (scored is not None and result["finish_reason"] != "error"
                and scored.token_choices is None):
            result["score"] = scored.fields(len(gen.prompt))
        return result
