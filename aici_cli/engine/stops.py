"""When a generation stops on its own line's terms: a stop token id, a stop string, or
`max_tokens` (vLLM's semantics: a stop token or string and what follows it are cut off).
Checked after every change to the output; each check resumes where the last one ended."""

from __future__ import annotations

from typing import Any

from aici_cli.control.stop_strings import find_stop
from aici_cli.engine.generation import Finish, Generation


def check_stop(gen: Generation, tokenizer: Any) -> bool:
    """Finish `gen` on a stop token id, a stop string or max_tokens; True when the
    generation is finished (already, or now)."""
    if gen.finish is not None:
        return True
    job = gen.job
    if job.stop_token_ids and _stop_token(gen):
        return True
    if job.stop and len(gen.output) > job.min_tokens:
        decode = tokenizer.decode
        text = decode(gen.output, skip_special_tokens=True)
        if gen.stop_floor is None:  # no stop string may end within min_tokens' text
            gen.stop_floor = len(decode(gen.output[: job.min_tokens],
                                        skip_special_tokens=True)) if job.min_tokens else 0
        hit = find_stop(text, job.stop, gen.text_checked, gen.stop_floor)
        gen.text_checked = len(text)
        if hit is not None:
            gen.finish = Finish("stop", text_end=hit)
            return True
    if len(gen.output) >= job.max_tokens:
        gen.finish = Finish("length")
        return True
    return False


def _stop_token(gen: Generation) -> bool:
    """End at the first of the line's stop_token_ids in the output from min_tokens on,
    sampled or fast-forwarded alike: it and what follows it are cut off (as vLLM leaves a
    stop token out of the text). True when it ended."""
    ids = gen.job.stop_token_ids
    output = gen.output
    for at in range(max(gen.ids_checked, gen.job.min_tokens), len(output)):
        if output[at] in ids:
            gen.backtrack(len(output) - at)
            gen.finish = Finish("stop")
            return True
    gen.ids_checked = len(output)
    return False
