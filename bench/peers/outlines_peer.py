"""`outlines`: generate() + outlines' JSON-schema logits processor (outlines-core backend).

outlines' processor holds one compiled index and applies it to every row of the batch, so
its own transformers path cannot mix schemas in a batch. This runner therefore does what a
user of that path must: rows grouped by schema, batches of identical schema only. With
distinct schemas that means batches of one; `outlines_rows` is the same-batch-size variant.
"""

from __future__ import annotations

import json
from typing import Any

from .common import Messages, PeerRun, Timer, generate_batch, static_batches

REQUIRES: tuple[str, ...] = ("outlines", "outlines_core", "transformers")
BATCHING = "rows grouped by schema (outlines applies one schema to a whole batch)"

_backends: dict[int, Any] = {}


def backend(model: Any, tokenizer: Any) -> Any:
    """The outlines-core backend for this tokenizer, built once (it indexes the vocabulary).

    Built once per process like aici-batch's tokenizer tables, so it belongs to setup (the
    orchestrator's warm-up), not to the measured run.
    """
    key = id(tokenizer)
    if key not in _backends:
        import outlines
        from outlines.backends import OutlinesCoreBackend

        _backends[key] = OutlinesCoreBackend(outlines.from_transformers(model, tokenizer))
    return _backends[key]


def processor(model: Any, tokenizer: Any, schema: dict[str, Any]) -> Any | None:
    """A fresh processor for one generate() call (it is stateful), None if it cannot compile."""
    try:
        return backend(model, tokenizer).get_json_schema_logits_processor(json.dumps(schema))
    except Exception:  # outlines-core rejects some schemas; the row then runs unconstrained
        return None


def run(model: Any, tokenizer: Any, prompts: list[Messages], schemas: list[dict[str, Any]],
        batch_size: int, max_tokens: int) -> PeerRun:
    """Greedy generation under each row's schema, batches holding one schema each."""
    from transformers import LogitsProcessorList

    backend(model, tokenizer)
    groups: dict[str, list[int]] = {}
    for i, schema in enumerate(schemas):
        groups.setdefault(json.dumps(schema, sort_keys=True), []).append(i)
    result = PeerRun.empty(len(prompts))
    with Timer() as t:
        for members in groups.values():
            for chunk in static_batches(len(members), batch_size):
                idx = [members[c] for c in chunk]
                proc = processor(model, tokenizer, schemas[idx[0]])
                if proc is None:
                    result.constraint_failures += len(idx)
                kwargs = {"logits_processor": LogitsProcessorList([proc])} if proc else {}
                texts, counts, steps = generate_batch(
                    model, tokenizer, [prompts[i] for i in idx], max_tokens, **kwargs)
                result.add(idx, texts, counts, steps)
    result.wall_s = t.seconds
    return result
