"""The default model at the CPU defaults where this machine's `--dtype auto` is float32
(int4 on the project's int kernels, drafts, prefix cache, fast-forward): dev-half Glaive
schemas and plain prompts give the same tokens and raw logprobs at batch 1 and batch 8
(engine/forward/attention.py: every attention call of a float32 pass is one computation
per token). Not under `--deterministic`: these are the default passes.

Marked `real_model` (~1 minute on 2 CPU cores).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from aici_cli.core.config import EngineConfig
from aici_cli.engine import Engine
from aici_cli.models import load_model

pytestmark = pytest.mark.real_model

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))


def run(lm: Any, jobs: list[Any], batch_size: int) -> dict[str, list[tuple[int, float]]]:
    engine = Engine(lm, EngineConfig(batch_size=batch_size))
    results: list[dict[str, Any]] = []
    engine.run(jobs, results.append)
    out = {}
    for r in results:
        assert r["finish_reason"] != "error", r.get("error")
        out[r["id"]] = [(e["id"], e["logprob"]) for e in r["logprobs"]]
    return out


def test_lines_are_the_same_at_batch_1_and_8() -> None:
    from batch_invariance import workload
    from determinism import DATA

    if not DATA.is_dir():
        pytest.skip(f"no schemas at {DATA}")
    lm = load_model(None, "cpu", "auto", "auto")
    if lm.dtype != torch.float32 or lm.quantize == "none":
        pytest.skip(f"--dtype auto is {lm.dtype} + {lm.quantize} here: the float32 int "
                    "kernels' path is the one made row-independent")
    jobs = workload(4, 24)
    alone, batched = run(lm, jobs, 1), run(lm, jobs, 8)
    assert all(alone.values())
    assert [k for k in alone if alone[k] != batched[k]] == []
