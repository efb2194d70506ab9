"""When a generation stops on its own line's terms: a stop token id, a stop string, or
`max_tokens` (vLLM's semantics: a stop token or string and what follows it are cut off).
Checked after every change to the output; each check resumes where the last one ended
(`StopScan`, a generation's). The decision applies the verdict
(`decisions.Decisions.check_stop`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aici_cli.control.stop_strings import find_stop
from aici_cli.core.job import Job


@dataclass(frozen=True)
class Stop:
    """Why a generation ends: its finish reason, the output tokens to keep (a stop token
    id and what follows it are cut: None keeps them all), where to cut its text."""

    reason: str
    keep: int | None = None
    text_end: int | None = None


@dataclass
class StopScan:
    """How far a generation's output was searched: characters of its text for stop
    strings, tokens for stop token ids, and the characters of its first `min_tokens`
    tokens (a stop string may not end within them; None: not known yet)."""

    text_checked: int = 0
    ids_checked: int = 0
    floor: int | None = None

    def rewind(self, keep: int) -> None:
        """The output is cut to its first `keep` tokens: the rewritten tail must be
        searched again."""
        self.ids_checked = min(self.ids_checked, keep)
        self.floor = None
        self.text_checked = 0

    def check(self, job: Job, output: Sequence[int], tokenizer: Any) -> Stop | None:
        """The stop `output` reached under `job`'s terms, or None."""
        if job.stop_token_ids:
            at = self._stop_token(job, output)
            if at is not None:
                return Stop("stop", keep=at)
        min_tokens = job.sampling.min_tokens
        if job.stop and len(output) > min_tokens:
            decode = tokenizer.decode
            text = decode(output, skip_special_tokens=True)
            if self.floor is None:  # no stop string may end within min_tokens' text
                self.floor = len(decode(output[: min_tokens],
                                        skip_special_tokens=True)) if min_tokens else 0
            hit = find_stop(text, job.stop, self.text_checked, self.floor)
            self.text_checked = len(text)
            if hit is not None:
                return Stop("stop", text_end=hit)
        if len(output) >= job.max_tokens:
            return Stop("length")
        return None

    def _stop_token(self, job: Job, output: Sequence[int]) -> int | None:
        """Where the first of the line's stop_token_ids is in the output from min_tokens
        on, sampled or fast-forwarded alike (it and what follows it are cut off, as vLLM
        leaves a stop token out of the text), or None."""
        ids = job.stop_token_ids
        for at in range(max(self.ids_checked, job.sampling.min_tokens), len(output)):
            if output[at] in ids:
                return at
        self.ids_checked = len(output)
        return None
