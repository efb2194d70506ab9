"""Whether this machine keeps `--deterministic`'s promise, checked on first use.

The deterministic mode (engine/forward/deterministic.py) rests on kernel behaviour that
differs between CPUs, BLAS builds, thread counts and GPUs: that a GEMM rounds a row alike
whatever the number of rows beside it (from TILE_ROWS up), that a norm reduces each token
alone, and that nothing else in the model's forward pass depends on the shape of the whole pass.
So before the first deterministic run on a machine, for the model's real shapes and dtype:

1. every distinct linear layer (its own weights) computes rows alike in GEMMs of 1 to
   REFERENCE_ROWS rows, at any offset;
2. every norm layer computes a token alike whatever the tokens beside it;
3. end to end, a few short lines give the same tokens and bit-identical logprobs alone
   (batch 1, no prefix cache, no drafts) as together (several rows, the prefix cache on,
   copied and in-place hits, drafts).

The verdict is cached in `$AICI_BATCH_CACHE/invariance/` under a key of everything it
depends on (torch version, device and CPU model, dtype, threads, model shapes, this
check's version), so later runs pay nothing. A failed check makes `--deterministic`
refuse with the reason (`ModelError`, exit 2): it never silently differs. Delete the
cache folder to check again.

Cost, first run only: the default model in bf16 on 2 CPU cores, about 10-20 s (the
49,152-row logits projection at ~900 rows, and two short engine runs in the mode).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from aici_cli.core.cache_paths import cache_dir
from aici_cli.core.errors import ModelError
from aici_cli.engine.forward.deterministic import TILE_ROWS, deterministic_linear
from aici_cli.models.kernels.cpu_features import cpu_features
from aici_cli.models.load import LoadedModel

CHECK_VERSION = 2
# The largest GEMM a row is compared in, and the row counts compared with it.
REFERENCE_ROWS = 300
ROW_COUNTS = (1, 2, 3, 5, 8, TILE_ROWS - 1, TILE_ROWS, TILE_ROWS + 1, 33, 100)
OFFSET = 7  # rows also start mid-GEMM

# The end-to-end lines: a shared prefix (prefix-cache hits), different lengths.
PREFIX = "You answer in one short sentence. Question: "
QUESTIONS = ("What is the capital of France?", "Why is the sky blue?",
             "Name a prime number.", "What do bees make?")


def ensure_deterministic(lm: LoadedModel, run_lines: Callable[..., dict[str, Any]]) -> None:
    """Raise ModelError when this machine's kernels break batch invariance for `lm`;
    `run_lines(**engine_config)` runs the end-to-end lines and returns their signatures.
    Cached per machine and model shape (see the module docstring)."""
    key = _key(lm)
    path = cache_dir() / "invariance" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            _raise_unless_ok(cached)
            return
    except (OSError, ValueError):
        pass
    problem = kernel_problem(lm) or engine_problem(run_lines)
    verdict = {"key": key, "ok": problem is None, "reason": problem}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdict, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache: check again next time
    _raise_unless_ok(verdict)


def _raise_unless_ok(verdict: dict[str, Any]) -> None:
    if not verdict.get("ok"):
        raise ModelError(f"--deterministic cannot be guaranteed on this machine: "
                         f"{verdict.get('reason')} (checked once per machine; see "
                         f"docs/reliability.md)")


def kernel_problem(lm: LoadedModel) -> str | None:
    """The first kernel that rounds a row by its neighbours (points 1 and 2), or None."""
    torch.manual_seed(0)
    seen: set[tuple[Any, ...]] = set()
    with torch.inference_mode():
        for name, module in lm.model.named_modules():
            if isinstance(module, torch.nn.Linear):
                shape = (*module.weight.shape, module.bias is not None)
                if shape not in seen:
                    seen.add(shape)
                    problem = _linear_problem(module, lm)
                    if problem is not None:
                        return f"{name} ({shape[0]}x{shape[1]}): {problem}"
            elif type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
                weight = getattr(module, "weight", None)
                width = weight.shape[0] if weight is not None else None
                if width is not None and ("norm", width) not in seen:
                    seen.add(("norm", width))
                    problem = _rows_problem(module, width, lm, three_d=True)
                    if problem is not None:
                        return f"{name}: {problem}"
    return None


def _linear_problem(module: torch.nn.Linear, lm: LoadedModel) -> str | None:
    def linear(x: torch.Tensor) -> torch.Tensor:
        return deterministic_linear(x, module.weight, module.bias)

    return _rows_problem(linear, module.in_features, lm)


def _rows_problem(f: Callable[[torch.Tensor], torch.Tensor], width: int, lm: LoadedModel,
                  three_d: bool = False) -> str | None:
    """Whether f's rows of a [REFERENCE_ROWS, width] input come out the same computed in
    fewer rows, at offset 0 and OFFSET."""
    x = torch.randn(REFERENCE_ROWS, width, dtype=lm.dtype, device=lm.device)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return f(rows[None])[0] if three_d else f(rows)

    reference = run(x)
    for m in ROW_COUNTS:
        for start in (0, OFFSET):
            if not torch.equal(run(x[start : start + m]), reference[start : start + m]):
                return (f"a {str(lm.dtype).removeprefix('torch.')} row computed with {m} "
                        f"rows beside it (from row {start}) rounds differently than among "
                        f"{REFERENCE_ROWS}")
    return None


def engine_lines() -> list[Any]:
    """The end-to-end check's lines: greedy, raw logprobs, a shared prefix."""
    from aici_cli.core.job import Job

    return [Job(index=i + 1, id=str(i), prompt=PREFIX + q, messages=None, max_tokens=6,
                logprobs=0)
            for i, q in enumerate(QUESTIONS)]


def engine_problem(run_lines: Callable[..., dict[str, Any]]) -> str | None:
    """Point 3: the lines alone against together, with the prefix cache and drafts."""
    alone = run_lines(batch_size=1, prefix_cache=False, draft_tokens=0)
    for config in (dict(batch_size=len(QUESTIONS), prefix_cache=True, draft_tokens=4),
                   dict(batch_size=2, prefix_cache=True, draft_tokens=4, lookahead=1)):
        together = run_lines(**config)
        for key, tokens in alone.items():
            if together.get(key) != tokens:
                return (f"a line's tokens or logprobs differ between batch 1 and batch "
                        f"{config['batch_size']} with the prefix cache")
    return None


def signatures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each line's (token id, raw logprob) pairs, or its error."""
    return {r["id"]: r.get("error") or [(e["id"], e["logprob"]) for e in r["logprobs"]]
            for r in results}


def _key(lm: LoadedModel) -> str:
    """Everything the verdict depends on, as one string."""
    cfg = lm.model.config
    shapes = sorted({(*m.weight.shape, m.bias is not None) for m in lm.model.modules()
                     if isinstance(m, torch.nn.Linear)})
    if lm.device.type == "cuda":
        idx = lm.device.index or 0
        device = f"cuda:{torch.cuda.get_device_name(idx)}:{torch.cuda.get_device_capability(idx)}"
    else:
        device = f"cpu:{cpu_features().fingerprint}"
    return json.dumps({
        "check": CHECK_VERSION, "torch": torch.__version__, "device": device,
        "dtype": str(lm.dtype), "threads": torch.get_num_threads(),
        "model": [type(lm.model).__name__, getattr(cfg, "hidden_size", None),
                  getattr(cfg, "num_hidden_layers", None),
                  getattr(cfg, "num_attention_heads", None),
                  getattr(cfg, "num_key_value_heads", None), shapes],
    }, default=str)


def check_run(make_engine: Callable[[Any], Any], config: Any, **changes: Any) -> dict[str, Any]:
    """The end-to-end lines' signatures from `make_engine(config')`, config' being
    `config` (an EngineConfig) with `changes`, in the mode, raw logprobs, not checking
    again."""
    engine = make_engine(dataclasses.replace(
        config, deterministic=True, check_invariance=False, logprobs_mode="raw",
        step_stats=False, **changes))
    results: list[dict[str, Any]] = []
    engine.run(engine_lines(), results.append)
    return signatures(results)
