"""The engine's intake for lines whose token ids are given rather than their text.

lm-evaluation-harness tokenizes a request itself (a context and its continuation apart,
trailing spaces moved to the continuation, left truncation): scoring exactly its tokens
is what makes this backend's loglikelihoods equal its `hf` backend's. A line carrying
`requests.PROMPT_IDS` (and, scored, `requests.SEQUENCES`) in `Job.extra` uses those; any
other line is tokenized as usual. The backend builds its `Engine` with it
(`Engine(..., intake=TokenIntake)`).
"""

from __future__ import annotations

from aici_cli.core.errors import GrammarError
from aici_cli.core.job import Job
from aici_cli.engine import Emit, LineIntake, Prepared
from aici_cli.evals.requests import PROMPT_IDS, SEQUENCES


class TokenIntake(LineIntake):
    def tokenize(self, job: Job) -> list[int]:
        ids = job.extra.get(PROMPT_IDS)
        if ids is None:
            return super().tokenize(job)
        limit = self.max_positions - job.max_tokens
        if len(ids) > limit:
            raise GrammarError("prompt_too_long",
                               f"prompt has {len(ids)} tokens; with max_tokens "
                               f"{job.max_tokens} the model's {self.max_positions} "
                               f"positions allow at most {max(limit, 0)}")
        return list(ids)

    def choice_sequences(self, line: Prepared, emit: Emit) -> list[tuple[list[int], int]] | None:
        sequences = line.job.extra.get(SEQUENCES)
        if sequences is None:
            return super().choice_sequences(line, emit)
        return [(list(ids), start) for ids, start in sequences]

