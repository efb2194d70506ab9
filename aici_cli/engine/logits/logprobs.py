"""Per-token logprobs: each output token's log-probability and its most likely rivals.

Every value comes out of a pass that ran anyway: a sampled token's from the logits it was
sampled from, a fast-forwarded token's from the position before it in the chunk that fed
it (the pass reads those positions too), a draft token's from the position that checked
it. Nothing is recomputed; only lines that ask pay for the log-softmax over the
vocabulary (about 0.1 ms a token at V=49k).

Modes: "raw" is the model's distribution, as OpenAI and vLLM report it; "masked" is the
distribution the constraint leaves, renormalized over the allowed tokens: there a token
the controller fast-forwards had no alternative and gets logprob 0, and drafts are off
for the line (their masks are never computed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from aici_cli.core.job import Job
from aici_cli.engine.logits.sampler import log_softmax

TokenBytes = Callable[[int], bytes]


class Fed(Protocol):
    """What the fed tokens' logprobs read of a generation (`engine.generation.Generation`
    is one): its line, prompt, output, the logprobs recorded so far, its cache length and
    the tokens this pass feeds."""

    job: Job
    prompt: list[int]
    output: list[int]
    logprobs: list[dict[str, Any] | None] | None
    length: int
    pending: list[int]


def entry(logprobs: torch.Tensor, token: int, k: int, token_bytes: TokenBytes) -> dict[str, Any]:
    """The record of `token` chosen from `logprobs` [V], with the `k` most likely tokens."""
    def one(t: int, lp: float) -> dict[str, Any]:
        raw = token_bytes(t)
        return {"token": raw.decode("utf-8", "replace"), "id": t, "bytes": list(raw),
                "logprob": lp}

    record = one(token, float(logprobs[token]))
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        record["top_logprobs"] = [one(int(t), float(v)) for v, t in
                                  zip(values.tolist(), ids.tolist()) if v != float("-inf")]
    else:
        record["top_logprobs"] = []
    return record


def forced_entry(token: int, token_bytes: TokenBytes) -> dict[str, Any]:
    """A fast-forwarded token under the constraint ("masked"): it had no alternative."""
    raw = token_bytes(token)
    rec = {"token": raw.decode("utf-8", "replace"), "id": token, "bytes": list(raw),
           "logprob": 0.0}
    return {**rec, "top_logprobs": [dict(rec)]}


def fed_offsets(gen: Fed) -> list[int]:
    """Offsets, in the row's pending tokens (but its last), of the positions that predict
    output tokens still without a logprob: fast-forwarded tokens fed in this pass."""
    assert gen.logprobs is not None
    p = len(gen.prompt)
    first, end = gen.length, gen.length + len(gen.pending) - 1
    return [q - first for j in range(len(gen.logprobs), len(gen.output))
            if first <= (q := p + j - 1) < end]


def fill_fed(gen: Fed, logits: torch.Tensor | None, token_bytes: TokenBytes) -> None:
    """Record the output tokens still without a logprob, up to the row's last pending
    token: from `logits` (the rows read at `fed_offsets`), or as forced tokens (masked
    mode, `logits` None). A token whose predecessor was not fed in this pass (a splice
    that reached back into the cache) gets None."""
    assert gen.logprobs is not None
    k = gen.job.logprobs or 0
    offsets = fed_offsets(gen) if logits is not None else []
    at = {gen.length + o + 1 - len(gen.prompt): i for i, o in enumerate(offsets)}
    while len(gen.logprobs) < len(gen.output):
        j = len(gen.logprobs)
        token = gen.output[j]
        if logits is None:
            gen.logprobs.append(forced_entry(token, token_bytes))
        elif j in at:
            gen.logprobs.append(entry(log_softmax(logits[at[j]]), token, k, token_bytes))
        else:
            gen.logprobs.append(None)
