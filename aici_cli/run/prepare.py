"""`aici-batch prepare`: build ahead what a model's runs on this machine otherwise build on
first use, so that the next run at the same options starts at full speed.

What a run makes once per model, mode and machine, and keeps in the cache:

- the conversion of a GGUF or a short name (models/gguf/convert.py, ~10-30 s);
- the quantised layers in their kernels' layout (models/cache/packed_layers.py);
- the kernel probe's verdict on the mode (models/kernels/probe.py), on the VNNI kernels
  where this CPU has them (models/kernels/int_mm.py: their library built too, and their
  layouts kept, models/quant/vnni_layouts.py), and on the dense kernels a quantised run's first
  wide pass asks about (models/quant/dense_copies.py);
- the compiled one-token step as AOTInductor packages (engine/forward/packaged_step.py,
  ~40-60 s each on 2 CPU cores). A run takes a ready package at once, `--compile auto`
  included, and then runs its one-token steps ~1.8x faster (docs/speed.md); without
  one, `auto` starts eagerly and a builder process makes the packages, beside the run
  where that pays within it, else after its last line (engine/forward/step_builds.py).
  Prepare waits for such a builder at work, then builds what is still missing.

The first three happen as the model loads (the dense verdict right after). The packages
are keyed by the step's row count: `--batch-size` (every row of the cache, a file of at
least that many lines) and each smaller bucket (1, 2, 4, ...: a one-line input, and the
tail of a file whose last lines finish one by one, which moves down to the smallest
packaged bucket that holds it, engine/forward/compiled.py `bucket`: at batch 8 the default
model's step costs ~6, 8.3, 10.2 and 14-16 ms at 1, 2, 4 and 8 rows forced to AVX2); and a
run at `--batch-size 1` has a cache of one row, whose step is a package of its own, built
too. Each is built by driving the engine at `--compile on` over a few tokens of that many
synthetic lines, the way a run builds it; a last one-line run at `auto` then checks that
a run starts compiled.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aici_cli.core.config import EngineConfig, RunConfig, load_quantize
from aici_cli.core.errors import ModelError
from aici_cli.core.job import Job
from aici_cli.engine import Engine, builders_turn, step_row_counts
from aici_cli.models.kernels import probe
from aici_cli.models.load import LoadedModel, load_model
from aici_cli.models.quant.dense_copies import WideRows, dense_verdict, measured_trial

# Tokens each synthetic line generates: the prompt's pass, then one-token steps, the
# first of which builds (or loads) the bucket's package.
_TOKENS = 4


@dataclass(frozen=True)
class Preparation:
    """What `prepare` made ready."""

    model: str
    quantize: str
    dtype: str
    device: str
    rows: tuple[int, ...]  # the row counts whose compiled step was built (or found)
    load_s: float  # loading the model: conversion, packing and the probe where first
    build_s: float  # driving the engine: the packages' builds where first
    compiled: bool  # a one-line `--compile auto` run ran its one-token steps compiled
    problem: str | None  # why not (compiled False), or why a package fell back


def prepare(config: RunConfig, say: Callable[[str], None] = lambda _: None) -> Preparation:
    """Load `config`'s model as a run would (converting, packing and probing it where
    that was not done yet), then build the compiled step for `--batch-size` rows and each
    smaller bucket (and for one row in a one-row cache), and check that a one-line run at
    `--compile auto` starts compiled, at `--batch-size` and at 1. `say` hears each stage.
    Raises `ModelError`/`UsageError` as a run reports them. Thread counts are the
    caller's (set before torch starts its pool)."""
    started = time.perf_counter()
    say("loading the model (converted, packed and probed where it is new here)")
    lm = load_model(config.model, config.device, config.dtype, load_quantize(config),
                    config.model_impl)
    if lm.device.type == "cpu" and lm.quantize == "int4" and probe.enabled():
        dense_verdict(lm.model.config, lm.dtype)  # what a run's first prompt pass asks
    wide = WideRows.for_model(lm.model)
    if wide is not None:  # the trial's measurement, taken here on a machine at rest
        measured_trial(wide.trial_layer())
    loaded = time.perf_counter()
    # No drafts: a pass with a draft runs eager, and the tiny prompts below repeat
    # themselves, so their rows would draft instead of taking the one-token step.
    engine_config = dataclasses.replace(config.engine, deterministic=False, draft_tokens=0)
    rows = step_row_counts(engine_config.batch_size)
    problem: str | None = None
    if lm.device.type != "cpu":
        rows, problem = (), ("the packaged step is for CPU runs; on a GPU `--compile on` "
                             "compiles with torch.compile")
    # (rows, cache rows): a cache of one row (`--batch-size 1`) is a package of its own.
    builds = [(n, engine_config.batch_size) for n in rows]
    if rows and engine_config.batch_size > 1:
        builds.append((1, 1))
    # A run's builder at work (engine/forward/step_builds.py) finishes first: what it
    # built is found below, and no two builds share the cores.
    with builders_turn(lambda: say("waiting for a run's builder of the compiled steps")):
        for n, cache_rows in builds:
            # Found in the cache where an earlier prepare or run's builder made it.
            say(f"the compiled one-token step for {n} row{'s' * (n > 1)}"
                f"{' in a one-row cache (--batch-size 1)' if cache_rows == 1 < len(builds) else ''}"
                ": built once per model, mode and machine, found where it was")
            engine = _drive(lm, dataclasses.replace(engine_config, compile="on",
                                                    batch_size=cache_rows), n)
            problem = engine.compiled_step_problem
            if problem is not None:
                break
    compiled = False
    if problem is None:
        for cache_rows in dict.fromkeys(c for _, c in builds):
            check = _drive(lm, dataclasses.replace(engine_config, compile="auto",
                                                   batch_size=cache_rows), 1)
            compiled = bool(check.compiled_steps)
            problem = check.compiled_step_problem
            if not compiled:
                break
    return Preparation(model=lm.name, quantize=lm.quantize,
                       dtype=str(lm.dtype).removeprefix("torch."), device=str(lm.device),
                       rows=rows, load_s=loaded - started,
                       build_s=time.perf_counter() - loaded, compiled=compiled,
                       problem=problem)


def _drive(lm: LoadedModel, config: EngineConfig, lines: int) -> Engine:
    """An engine of `config` over `lm` that ran `lines` plain lines of `_TOKENS` tokens,
    all read at once (so its compiled step takes the bucket of `lines` rows)."""
    engine = Engine(lm, config)
    jobs = [Job(index=i + 1, id=str(i + 1), prompt="Hello", messages=None,
                max_tokens=_TOKENS, ignore_eos=True) for i in range(lines)]
    results: list[dict[str, Any]] = []
    engine.run(jobs, results.append)
    failed = [r for r in results if r.get("finish_reason") == "error"]
    if failed:
        error = failed[0].get("error") or {}
        raise ModelError(f"the model ran, but a line of the preparation failed: "
                         f"{error.get('type')}: {error.get('message')}")
    return engine
