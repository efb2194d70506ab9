"""The compiled one-token decode step (`--compile`, engine/forward/compiled.py).

Compiling costs tens of seconds on 2 CPU cores with a cold inductor cache, so the test
that compiles runs one small workload that still covers what matters: idle rows in a
bucket, rows of different lengths, a row refilled by a new line, and fp32 tokens equal to
the eager run's. Skipped where inductor cannot build CPU kernels (no C++ compiler).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aici_cli.core.config import EngineConfig
from aici_cli.core.job import Job
from aici_cli.engine.engine import Engine
from aici_cli.engine.forward import compiled, decode_steps
from aici_cli.engine.forward.compiled import CompiledDecode, unsupported
from aici_cli.engine.forward.decode_steps import DecodeSteps
from aici_cli.models.load import LoadedModel, load_model


@pytest.fixture(scope="module")
def lm32(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def _jobs(max_tokens: list[int]) -> list[Job]:
    prompts = ["the quick brown fox", "hello world, hello again and", "a b c"]
    return [Job(index=i + 1, id=str(i), max_tokens=n, constraint=None,
                prompt=prompts[i % len(prompts)], messages=None, ignore_eos=True, logprobs=0)
            for i, n in enumerate(max_tokens)]


def _run(lm: LoadedModel, compile_mode: str, max_tokens: list[int]) -> tuple[Any, Engine]:
    engine = Engine(lm, EngineConfig(batch_size=2, compile=compile_mode, draft_tokens=0))
    results: list[dict[str, Any]] = []
    engine.run(_jobs(max_tokens), results.append)
    by_index = {r["index"]: [e["id"] for e in r["logprobs"]] for r in results}
    return by_index, engine


@pytest.mark.subprocess
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler for CPU kernels")
def test_compiled_decode_gives_the_eager_tokens_in_fp32(lm32: LoadedModel) -> None:
    # Row 0 finishes first and is refilled by line 3; when line 3 is done too, line 2
    # runs alone in row 1 with row 0 idle in its bucket of 2.
    lengths = [4, 30, 8]
    eager, eager_engine = _run(lm32, "off", lengths)
    fast, fast_engine = _run(lm32, "on", lengths)
    assert eager_engine.runner.model_pass.decode.compiled is None
    step = fast_engine.runner.model_pass.decode.compiled
    assert step is not None
    assert set(step.compile_s) == {2}  # the span ends at row 2 every time: one bucket
    # Every pass where no line starts feeds one token per row here: all ran compiled.
    decode_passes = sum(1 for s in fast_engine.step_times if s.kind == "decode")
    assert step.steps == decode_passes >= 20
    assert fast == eager
    assert [len(fast[i]) for i in (1, 2, 3)] == lengths
    # A second engine on the model runs its graphs: nothing is compiled again.
    again, again_engine = _run(lm32, "on", lengths)
    assert again == eager
    second = again_engine.runner.model_pass.decode.compiled
    assert second is not None and second.graphs is step.graphs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_decode_on_cuda_gives_the_eager_tokens_in_fp32(tiny_model_dir: Path) -> None:
    lm = load_model(str(tiny_model_dir), device="cuda", dtype="float32")
    lengths = [4, 30, 8]
    eager, _ = _run(lm, "off", lengths)
    fast, engine = _run(lm, "on", lengths)  # reduce-overhead: CUDA graphs
    decode = engine.runner.model_pass.decode
    assert decode.compiled is not None, decode.reason  # why it gave up, where it did
    assert engine.runner.model_pass.decode.compiled.steps >= 20
    assert fast == eager


def test_buckets_cover_the_span_with_idle_rows() -> None:
    step = CompiledDecode.__new__(CompiledDecode)
    step.device = torch.device("cuda")  # bucket() only reads the device type
    step.rows = 8
    assert [step.bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    step.rows = 6  # a batch size between buckets: its own last bucket
    assert [step.bucket(n) for n in (3, 5, 6)] == [4, 6, 6]
    step.device = torch.device("cpu")  # one graph of every row: no bucket to compile
    step._cpu_rows = None
    assert [step.bucket(n) for n in (1, 3, 6)] == [6, 6, 6]
    # Where no line can come, the graph holds the busy rows only...
    assert [step.bucket(1, 1), step.bucket(1, 3), step.bucket(2, 5)] == [1, 4, 6]
    step._cpu_rows = 2  # ...and a run keeps its first graph while the span fits in it
    assert [step.bucket(1, 6), step.bucket(2), step.bucket(3, 3)] == [2, 2, 6]


def test_auto_compiles_only_when_enough_work_is_ahead(lm32: LoadedModel, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "compiler_problem", lambda device: None)
    # No packaged step here (with one ready, `auto` takes it at once: test_packaged_step.py).
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    from aici_cli.engine.forward.cache import RowCache

    cache = RowCache(num_layers=2, rows=2, capacity=16)
    steps = DecodeSteps("auto", lm32.model, cache, 2, lm32.device, deterministic=False)
    assert steps.compiled is not None and steps.compiled.build_packages  # once chosen
    assert steps.pick(decode_steps.AUTO_MIN_STEPS - 1) is None  # a short run stays eager
    assert steps.pick(decode_steps.AUTO_MIN_STEPS) is steps.compiled
    assert steps.pick(0) is steps.compiled  # once chosen, every later step
    never = DecodeSteps("on", lm32.model, cache, 2, lm32.device, deterministic=True)
    assert never.mode == "off" and never.pick(10**9) is None  # --deterministic runs eager


def test_models_the_step_does_not_build_stay_eager(lm32: LoadedModel) -> None:
    """Gemma 3 compiles only as the project's own module builds it (tests/
    test_compiled_gemma.py); transformers' Gemma 3 class, and Gemma 2, stay eager."""
    assert unsupported(lm32.model) is None
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with torch.device("meta"):
        gemma3 = AutoModelForCausalLM.from_config(Gemma3TextConfig(**shape))
        gemma2 = AutoModelForCausalLM.from_config(Gemma2Config(**shape))
    assert "transformers' classes" in (unsupported(gemma3) or "")
    assert "not Llama-shaped" in (unsupported(gemma2) or "")


def test_a_failed_compile_leaves_the_run_eager_and_unchanged(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A model of its own: compiled graphs are kept per model, and lm32's may exist.
    lm32 = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    monkeypatch.setattr(compiled, "compiler_problem", lambda device: None)

    def broken(fn: Any, **kwargs: Any) -> Any:
        def call(*args: Any) -> Any:
            raise RuntimeError("C++ compile error: cannot find -lgomp\nmore detail")
        return call

    monkeypatch.setattr(compiled.torch, "compile", broken)
    # This test is about torch.compile failing: no packaged step (packaged_step.py) runs.
    monkeypatch.setattr(compiled.CompiledDecode, "_packaged", lambda *args: None)
    lengths = [4, 12, 6]
    eager, _ = _run(lm32, "off", lengths)
    fallback, engine = _run(lm32, "on", lengths)
    assert fallback == eager
    assert engine.runner.model_pass.decode.compiled is None
    assert engine.runner.model_pass.decode.reason == (
        "compiling failed: RuntimeError: C++ compile error: cannot find -lgomp")


@pytest.mark.subprocess
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler for CPU kernels")
def test_one_cpu_graph_serves_every_row_count_and_a_growing_cache(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the compiled step is compiled once: rows finishing (a tail of fewer live
    rows) and the cache capacity doubling (lines longer than the initial capacity) do
    not recompile it, and the tokens stay the eager ones (fp32). (torch.compile's graph:
    the packaged step's own test is in test_packaged_step.py.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compiled.CompiledDecode, "_packaged", lambda *args: None)

    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")  # graphs of its own
    # Line 1 (row 0) outlasts lines 2 and 3 (row 1): its tail runs alone in row 0. 70
    # tokens and the prompt pass the capacity of 16 twice.
    lengths = [70, 3, 20]

    def run(mode: str) -> tuple[Any, Engine]:
        engine = Engine(lm, EngineConfig(batch_size=2, compile=mode, draft_tokens=0,
                                         initial_capacity=16))
        results: list[dict[str, Any]] = []
        engine.run(_jobs(lengths), results.append)
        return {r["index"]: [e["id"] for e in r["logprobs"]] for r in results}, engine

    eager, _ = run("off")
    graphs = counters["stats"]["unique_graphs"]
    fast, engine = run("on")
    assert fast == eager
    assert engine.runner.model_pass.cache.capacity >= 64
    assert counters["stats"]["unique_graphs"] - graphs == 1


@pytest.mark.subprocess
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler for CPU kernels")
def test_a_one_line_run_compiles_one_row_not_the_batch(tiny_model_dir: Path) -> None:
    """A single stream at the default batch size: once the input is read to its end the
    CPU graph is of the rows still busy (one), not of every row (idle rows cost a
    batch's matmuls each step); its tokens are the eager ones (fp32)."""
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")  # graphs of its own

    def run(mode: str) -> tuple[Any, Engine]:
        engine = Engine(lm, EngineConfig(batch_size=4, compile=mode, draft_tokens=0))
        results: list[dict[str, Any]] = []
        engine.run(_jobs([24]), results.append)
        return [e["id"] for e in results[0]["logprobs"]], engine

    eager, _ = run("off")
    fast, engine = run("on")
    step = engine.runner.model_pass.decode.compiled
    assert step is not None and step.steps >= 20
    assert set(step.compile_s) == {1}
    assert fast == eager


@pytest.mark.subprocess
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler for CPU kernels")
def test_a_files_last_line_moves_to_the_one_row_graph_with_the_eager_tokens(
        tiny_model_dir: Path) -> None:
    """A file whose longest line sits in the last row: once the other lines ended and
    none can come, that line moves to row 0 (its keys copied) and its steps run the
    one-row packaged step (a one-line run built it) instead of the batch's graph, with
    the eager tokens (fp32)."""
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")  # graphs of its own
    lengths = [3, 3, 3, 30]  # line 4 takes row 3 of 4

    def run(mode: str, max_tokens: list[int]) -> tuple[Any, Engine]:
        engine = Engine(lm, EngineConfig(batch_size=4, compile=mode, draft_tokens=0))
        results: list[dict[str, Any]] = []
        engine.run(_jobs(max_tokens), results.append)
        return {r["index"]: [e["id"] for e in r["logprobs"]] for r in results}, engine

    run("on", [4])  # builds the one-row package
    eager, _ = run("off", lengths)
    fast, engine = run("on", lengths)
    step = engine.runner.model_pass.decode.compiled
    assert step is not None
    assert set(step.compile_s) == {4, 1}  # the batch's graph, then the tail's
    assert fast == eager


@given(rows=st.integers(1, 1024), span_end=st.integers(1, 1024),
       bound=st.integers(0, 1024), kept=st.none() | st.sampled_from(compiled.BUCKETS),
       ready=st.sets(st.sampled_from(compiled.BUCKETS)))
def test_a_cpu_graph_always_holds_the_span_and_never_exceeds_the_cache(
        rows: int, span_end: int, bound: int, kept: int | None, ready: set[int]) -> None:
    """Whatever the bound, the graph a run kept (a bucket, or every row) and the buckets
    with a packaged step ready: the graph's rows hold the step's span, fit the cache, and
    are a bucket or the cache's rows; without a bound it is every row; a kept graph that
    holds the span stays, unless the smallest bucket that holds the bound is smaller and
    has its package ready (a run's tail: it takes that one)."""
    span_end, bound = min(span_end, rows), min(bound, rows)
    step = CompiledDecode.__new__(CompiledDecode)
    step.device, step.rows = torch.device("cpu"), rows
    step._cpu_rows = min(kept, rows) if kept is not None else None
    step._graphs = None
    step._package_ready = {b: b in ready for b in (*compiled.BUCKETS, rows)}
    step.recheck_s = 0.0  # no builder at work: a missing package is not looked for again
    got = step.bucket(span_end, bound)
    assert span_end <= got <= rows
    assert got in compiled.BUCKETS or got == rows
    if step._cpu_rows is None and bound == 0:
        assert got == rows
    if step._cpu_rows is not None and span_end <= step._cpu_rows:
        tail = next((b for b in compiled.BUCKETS if max(span_end, bound) <= b <= rows), rows)
        smaller = bound > 0 and tail < step._cpu_rows and tail in ready
        assert got == (tail if smaller else step._cpu_rows)
