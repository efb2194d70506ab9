"""`outlines-rows`: outlines' processors, one per row, in the same static batches as the rest.

Not something outlines offers: a thin wrapper hands each row's logits slice to that row's
own outlines-core processor. It isolates outlines' per-token cost from the batch-of-one
penalty that `outlines` (rows grouped by schema) pays when every schema is distinct.
"""

from __future__ import annotations

from typing import Any

from .common import Messages, PeerRun, Timer, generate_batch, static_batches
from .outlines_peer import backend, processor

REQUIRES: tuple[str, ...] = ("outlines", "outlines_core", "transformers")
BATCHING = "static batches, one outlines processor per row (wrapper written here)"


class PerRow:
    """A logits processor that applies processor i to row i (None leaves the row free).

    outlines' torch kernel masks the slice in place, so the row views write through.
    """

    def __init__(self, procs: list[Any | None]) -> None:
        self.procs = procs

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        for i, proc in enumerate(self.procs):
            if proc is not None:
                scores[i : i + 1] = proc(input_ids[i : i + 1], scores[i : i + 1])
        return scores


def run(model: Any, tokenizer: Any, prompts: list[Messages], schemas: list[dict[str, Any]],
        batch_size: int, max_tokens: int) -> PeerRun:
    """Greedy generation under each row's schema, mixed schemas per batch."""
    from transformers import LogitsProcessorList

    backend(model, tokenizer)
    result = PeerRun.empty(len(prompts))
    with Timer() as t:
        for idx in static_batches(len(prompts), batch_size):
            procs = [processor(model, tokenizer, schemas[i]) for i in idx]
            result.constraint_failures += sum(p is None for p in procs)
            texts, counts, steps = generate_batch(
                model, tokenizer, [prompts[i] for i in idx], max_tokens,
                logits_processor=LogitsProcessorList([PerRow(procs)]))
            result.add(idx, texts, counts, steps)
    result.wall_s = t.seconds
    return result
