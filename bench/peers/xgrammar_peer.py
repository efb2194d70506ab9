"""`xgrammar`: generate() + xgrammar's HF logits processor (`xgrammar.contrib.hf`).

xgrammar's processor takes one compiled grammar per row, so it runs in the same static
batches as `generate`. Schemas compile with xgrammar's defaults (strict mode: undeclared
keys disallowed, like aici-batch's default). xgrammar is installed without its `triton`
dependency (GPU kernels only; a large wheel): see requirements.txt.
"""

from __future__ import annotations

import json
from typing import Any

from .common import Messages, PeerRun, Timer, generate_batch, static_batches

REQUIRES: tuple[str, ...] = ("xgrammar", "transformers")
BATCHING = "static batches, one compiled grammar per row"

_compilers: dict[int, Any] = {}


def compiler(model: Any, tokenizer: Any) -> Any:
    """The grammar compiler for this tokenizer, built once (vocabulary preprocessing).

    One compiler thread per torch thread, so it gets the same CPU share as everyone else.
    """
    key = id(tokenizer)
    if key not in _compilers:
        import torch
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
        _compilers[key] = xgr.GrammarCompiler(info, max_threads=torch.get_num_threads())
    return _compilers[key]


def run(model: Any, tokenizer: Any, prompts: list[Messages], schemas: list[dict[str, Any]],
        batch_size: int, max_tokens: int) -> PeerRun:
    """Greedy generation under each row's schema, mixed schemas per batch."""
    from transformers import LogitsProcessorList
    from xgrammar.contrib.hf import LogitsProcessor

    comp = compiler(model, tokenizer)
    result = PeerRun.empty(len(prompts))
    with Timer() as t:
        for idx in static_batches(len(prompts), batch_size):
            grammars = []
            for i in idx:
                try:
                    grammars.append(comp.compile_json_schema(json.dumps(schemas[i])))
                except Exception:  # rare: xgrammar ignores most of what it cannot enforce
                    result.constraint_failures += 1
                    grammars.append(comp.compile_builtin_json_grammar())
            # A fresh processor per generate() call: its matchers cannot be reset.
            proc = LogitsProcessor(grammars)
            texts, counts, steps = generate_batch(
                model, tokenizer, [prompts[i] for i in idx], max_tokens,
                logits_processor=LogitsProcessorList([proc]))
            result.add(idx, texts, counts, steps)
    result.wall_s = t.seconds
    return result
