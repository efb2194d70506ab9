"""The compiled step as an AOTInductor package (engine/forward/packaged_step.py): built
once by a `--compile on` run, then loaded by any later run, `--compile auto` included,
with the eager run's tokens (fp32), a growing cache and a tail of fewer rows; a package
that cannot be built or disagrees with the eager step is never used.

Each test keeps its packages in a cache of its own. Building one for the tiny model takes
~20-60 s on 2 cores, so one test builds and the others reuse or refuse it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from aici_cli.core.config import EngineConfig
from aici_cli.core.job import Job
from aici_cli.engine.engine import Engine
from aici_cli.engine.forward import compiled, decode_steps, packaged_step
from aici_cli.models.load import load_model

pytestmark = [pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                 reason="inductor needs a C++ compiler for CPU kernels"),
              pytest.mark.heavy]

PROMPTS = ["the quick brown fox", "hello world, hello again and", "a b c"]


def _run(model_dir: Path, mode: str, lengths: list[int], batch_size: int = 2,
         capacity: int = 16) -> tuple[dict[int, list[int]], Engine]:
    """Greedy tokens per line of a fresh model (graphs and packages are kept per model)."""
    lm = load_model(str(model_dir), device="cpu", dtype="float32")
    engine = Engine(lm, EngineConfig(batch_size=batch_size, compile=mode, draft_tokens=0,
                                     initial_capacity=capacity))
    jobs = [Job(index=i + 1, id=str(i), max_tokens=n, constraint=None,
                prompt=PROMPTS[i % len(PROMPTS)], messages=None, ignore_eos=True, logprobs=0)
            for i, n in enumerate(lengths)]
    results: list[dict[str, Any]] = []
    engine.run(jobs, results.append)
    return {r["index"]: [e["id"] for e in r["logprobs"]] for r in results}, engine


def _packages(cache: Path) -> list[Path]:
    return sorted((cache / packaged_step.FOLDER).glob("*.pt2"))


def test_a_package_is_built_once_then_every_run_starts_compiled(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    # Line 1 (row 0) outlasts lines 2 and 3 (row 1): its tail runs alone in the 2-row
    # package; 70 tokens and the prompt pass the capacity of 16 twice (a dynamic size).
    lengths = [70, 3, 20]
    eager, _ = _run(tiny_model_dir, "off", lengths)
    built, engine = _run(tiny_model_dir, "on", lengths)
    step = engine.runner.model_pass.decode.compiled
    assert step is not None and step.package_problem is None
    assert built == eager
    assert len(_packages(tmp_path)) == 1
    assert step.graphs.packaged and step.graphs._whole is None  # no torch.compile
    assert engine.runner.model_pass.cache.capacity >= 64
    decode_passes = sum(1 for s in engine.step_times if s.kind == "decode")
    assert step.steps == decode_passes >= 60

    # A later run with the default `auto` and far less than AUTO_MIN_STEPS ahead: the
    # package is ready, so every one-token step runs it; nothing new is built.
    short = [12, 5]
    eager_short, _ = _run(tiny_model_dir, "off", short)
    loaded, engine = _run(tiny_model_dir, "auto", short)
    step = engine.runner.model_pass.decode.compiled
    assert step is not None and step.graphs._whole is None
    assert step.steps == sum(1 for s in engine.step_times if s.kind == "decode") > 0
    assert loaded == eager_short
    assert len(_packages(tmp_path)) == 1

    # A cache far larger than the lines: the package attends over the step's span of
    # slots (the highest position fed, rounded up), not the capacity, with the same tokens.
    spans: list[tuple[int, int]] = []

    def span_slots(positions: list[int], capacity: int) -> int:
        span = real_span_slots(positions, capacity)
        spans.append((max(positions), span))
        return span

    real_span_slots = compiled.span_slots
    monkeypatch.setattr(compiled, "span_slots", span_slots)
    eager_wide, _ = _run(tiny_model_dir, "off", short, capacity=1024)
    wide, engine = _run(tiny_model_dir, "auto", short, capacity=1024)
    assert wide == eager_wide
    assert engine.runner.model_pass.cache.capacity == 1024
    assert spans and all(top < span <= top + compiled.SPAN_QUANTUM and span < 1024
                         for top, span in spans)
    assert len(_packages(tmp_path)) == 1


def test_a_step_span_covers_every_position_fed_within_the_capacity() -> None:
    for positions, capacity in (([0], 256), ([15], 256), ([16, 3], 256), ([250], 256),
                                ([255], 256), ([700, 1], 1024), ([], 16)):
        span = compiled.span_slots(positions, capacity)
        top = max(positions, default=0)
        assert top < span <= capacity and span >= 2
        assert span % compiled.SPAN_QUANTUM == 0 or span == capacity


def test_a_package_that_cannot_be_built_leaves_torch_compile(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))

    def fails(*args: Any) -> None:
        raise RuntimeError("export failed: data-dependent shape\nmore detail")

    monkeypatch.setattr(packaged_step, "_export_and_compile", fails)
    lengths = [6, 4]
    eager, _ = _run(tiny_model_dir, "off", lengths)
    fallback, engine = _run(tiny_model_dir, "on", lengths)
    step = engine.runner.model_pass.decode.compiled
    assert step is not None
    assert step.package_problem == "RuntimeError: export failed: data-dependent shape"
    assert step.graphs._whole is not None and not step.graphs.packaged  # torch.compile
    assert fallback == eager
    assert _packages(tmp_path) == []


def test_a_package_that_disagrees_with_the_eager_step_is_deleted(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(packaged_step, "_disagrees", lambda *args: "output off by 3")
    monkeypatch.setattr(decode_steps, "AUTO_MIN_STEPS", 10**9)
    lengths = [5]
    eager, _ = _run(tiny_model_dir, "off", lengths, batch_size=1)
    fallback, engine = _run(tiny_model_dir, "on", lengths, batch_size=1)
    step = engine.runner.model_pass.decode.compiled
    assert step is not None and step.package_problem is not None
    assert "disagrees with the eager one: output off by 3" in step.package_problem
    assert fallback == eager
    assert list((tmp_path / packaged_step.FOLDER).glob("*.pt2")) == []
    assert list((tmp_path / packaged_step.FOLDER).glob("*.constants.pt")) == []
    # Nothing is left for `auto` to pick up: a short run stays eager.
    _, later = _run(tiny_model_dir, "auto", lengths, batch_size=1)
    assert later.runner.model_pass.decode.compiled is not None
    assert later.runner.model_pass.decode.compiled.steps == 0


def test_the_package_key_names_what_the_code_depends_on(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows and the machine change the package; a model of the same shapes with other
    weights does not (its weights are handed to the package at load)."""
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    other = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    for p in other.model.parameters():
        p.data.mul_(0.5)
    one, two = (packaged_step.package_file(lm.model, rows, 4) for rows in (1, 2))
    assert one != two and one.parent == tmp_path / packaged_step.FOLDER
    assert packaged_step.package_file(other.model, 1, 4) == one
    assert packaged_step.package_file(lm.model, 1, 8) == one  # cache rows: dynamic from 2
    assert packaged_step.package_file(lm.model, 1, 1) != one
    monkeypatch.setattr(packaged_step, "fingerprint", lambda device: "Linux x86_64 other")
    assert packaged_step.package_file(lm.model, 1, 4) != one


def test_a_ready_package_that_does_not_load_leaves_auto_eager_not_tracing(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` takes a step for its ready package alone; where that package cannot be
    loaded (a damaged file, constants the model's layers lack), the run goes on eagerly
    with the eager tokens instead of seconds of torch.compile a short run never repays."""
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    lengths = [6, 4]
    eager, _ = _run(tiny_model_dir, "off", lengths)
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    path = packaged_step.package_file(lm.model, 2, 2)  # the bucket _run's batch takes
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a package")
    path.with_suffix(".constants.pt").write_bytes(b"nor constants")

    def no_trace(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.compile was called")

    monkeypatch.setattr(torch, "compile", no_trace)
    got, engine = _run(tiny_model_dir, "auto", lengths)
    decode = engine.runner.model_pass.decode
    assert decode.compiled is None and "did not load" in (decode.reason or "")
    assert got == eager
