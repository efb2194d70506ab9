"""`lmfe`: generate() + lm-format-enforcer's `prefix_allowed_tokens_fn`.

lm-format-enforcer 0.11.3 (the newest) imports `PreTrainedTokenizerBase` from
`transformers.tokenization_utils`, which transformers 5 no longer exports there; `shim()`
re-exports it from `tokenization_utils_base` before the import (only the name moved).
One TokenEnforcer per row, dispatched on `batch_id`, so schemas mix in a batch.
"""

from __future__ import annotations

from typing import Any

from .common import Messages, PeerRun, Timer, generate_batch, static_batches

REQUIRES: tuple[str, ...] = ("lmformatenforcer", "transformers")
BATCHING = "static batches, one TokenEnforcer per row (prefix_allowed_tokens_fn)"

_tokenizer_data: dict[int, Any] = {}


def shim() -> None:
    """Make `from transformers.tokenization_utils import PreTrainedTokenizerBase` work."""
    try:
        from transformers.tokenization_utils import PreTrainedTokenizerBase  # noqa: F401
    except ImportError:
        import sys

        import transformers.tokenization_utils_base as base

        try:
            import transformers.tokenization_utils as legacy

            legacy.PreTrainedTokenizerBase = base.PreTrainedTokenizerBase  # type: ignore[attr-defined]
        except ImportError:
            sys.modules["transformers.tokenization_utils"] = base


def tokenizer_data(model: Any, tokenizer: Any) -> Any:
    """lm-format-enforcer's per-tokenizer tables, built once (decodes the whole vocabulary)."""
    key = id(tokenizer)
    if key not in _tokenizer_data:
        shim()
        from lmformatenforcer.integrations.transformers import (
            build_token_enforcer_tokenizer_data,
        )

        _tokenizer_data[key] = build_token_enforcer_tokenizer_data(
            tokenizer, vocab_size=model.config.vocab_size)
    return _tokenizer_data[key]


class PerRow:
    """`prefix_allowed_tokens_fn` giving row i the tokens its own enforcer allows."""

    def __init__(self, enforcers: list[Any | None], vocab_size: int) -> None:
        self.enforcers = enforcers
        self.everything = list(range(vocab_size))
        self.failures = 0

    def __call__(self, batch_id: int, sent: Any) -> list[int]:
        enforcer = self.enforcers[batch_id]
        if enforcer is None:
            return self.everything
        try:
            return list(enforcer.get_allowed_tokens(sent.tolist()).allowed_tokens)
        except Exception:  # an enforcer failing mid-row frees that row instead of the run
            self.enforcers[batch_id] = None
            self.failures += 1
            return self.everything


def run(model: Any, tokenizer: Any, prompts: list[Messages], schemas: list[dict[str, Any]],
        batch_size: int, max_tokens: int) -> PeerRun:
    """Greedy generation under each row's schema, mixed schemas per batch."""
    data = tokenizer_data(model, tokenizer)
    from lmformatenforcer import JsonSchemaParser, TokenEnforcer

    result = PeerRun.empty(len(prompts))
    with Timer() as t:
        for idx in static_batches(len(prompts), batch_size):
            enforcers: list[Any | None] = []
            for i in idx:
                try:
                    enforcers.append(TokenEnforcer(data, JsonSchemaParser(schemas[i])))
                except Exception:  # a schema the parser cannot take: row runs unconstrained
                    result.constraint_failures += 1
                    enforcers.append(None)
            fn = PerRow(enforcers, model.config.vocab_size)
            texts, counts, steps = generate_batch(
                model, tokenizer, [prompts[i] for i in idx], max_tokens,
                prefix_allowed_tokens_fn=fn)
            result.constraint_failures += fn.failures
            result.add(idx, texts, counts, steps)
    result.wall_s = t.seconds
    return result
