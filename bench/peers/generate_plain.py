"""`generate`: transformers `model.generate()` on static batches with no constraint.

The upper bound of a plain loop: what the same model and batching do when nothing masks
the logits, so every constrained peer's loss can be read against it.
"""

from __future__ import annotations

from typing import Any

from .common import Messages, PeerRun, Timer, generate_batch, static_batches

REQUIRES: tuple[str, ...] = ("transformers",)
BATCHING = "static batches of the input order"


def run(model: Any, tokenizer: Any, prompts: list[Messages], schemas: list[dict[str, Any]],
        batch_size: int, max_tokens: int) -> PeerRun:
    """Greedy generation of every prompt; `schemas` are ignored (unconstrained)."""
    result = PeerRun.empty(len(prompts))
    with Timer() as t:
        for idx in static_batches(len(prompts), batch_size):
            texts, counts, steps = generate_batch(model, tokenizer, [prompts[i] for i in idx],
                                                  max_tokens)
            result.add(idx, texts, counts, steps)
    result.wall_s = t.seconds
    return result
