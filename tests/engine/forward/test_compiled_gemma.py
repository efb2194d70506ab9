"""The compiled one-token step (engine/forward/compiled.py) on Gemma 3 (text) as the
project's own module builds it: its four norms a layer, q/k norms, query scale, GELU and
embedding scale, and its two layer kinds, each with a RoPE base and a mask of its own.

The tiny model (tests/support/arch_models.py) has a sliding layer then a full layer; its
window is set to 5 slots here, which every line outgrows (prompt and up to 30 tokens), so
the sliding layer's mask hides slots the full layer's shows on most steps. Checked in
float32:

- the step's tables: each kind's RoPE base, the plain mask and the windowed one (the
  eager pass's sliding mask on the slots it covers);
- the step's code run uncompiled (no compiler: in the fast loop) gives the eager run's
  tokens and log-probabilities;
- `torch.compile`'s graph and the AOTInductor package (built, then loaded by a later
  `auto` run) give transformers' eager tokens (slow: each compiles);
- transformers' own Gemma 3 classes stay eager.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from arch_models import build_arch_model

from aici_cli.core.config import EngineConfig
from aici_cli.core.job import Job
from aici_cli.engine.engine import Engine
from aici_cli.engine.forward import compiled, packaged_step
from aici_cli.engine.forward.inputs import _single_group
from aici_cli.models import LoadedModel, load_model
from aici_cli.models.families.llama import LlamaCausalLM

WINDOW = 5
LENGTHS = [6, 30, 10]
needs_compiler = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                    reason="inductor needs a C++ compiler for CPU kernels")


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    model_dir = build_arch_model("gemma3", tiny_model_dir,
                                 tmp_path_factory.mktemp("gemma3") / "model")
    raw = json.loads((model_dir / "config.json").read_text())
    assert set(raw["layer_types"]) == {"sliding_attention", "full_attention"}
    (model_dir / "config.json").write_text(json.dumps(raw | {"sliding_window": WINDOW}))
    return model_dir


def _load(model_dir: Path, impl: str = "auto") -> LoadedModel:
    """A fresh model: compiled graphs and packages are kept per model."""
    return load_model(str(model_dir), device="cpu", dtype="float32", implementation=impl)


def _run(lm: LoadedModel, mode: str, lengths: list[int] = LENGTHS
         ) -> tuple[list[list[tuple[int, float]]], Engine]:
    """Greedy (token, logprob) per line through an engine of 2 rows (line 3 refills row 0,
    line 2 runs its tail alone)."""
    prompts = ["Alice and Bob", "The quick brown fox jumps over", "a b c"]
    jobs = [Job(index=i + 1, id=str(i), max_tokens=n, constraint=None,
                prompt=prompts[i % len(prompts)], messages=None, ignore_eos=True, logprobs=0)
            for i, n in enumerate(lengths)]
    engine = Engine(lm, EngineConfig(batch_size=2, compile=mode, draft_tokens=0,
                                     initial_capacity=16))
    results: list[dict[str, Any]] = []
    engine.run(jobs, results.append)
    return [[(e["id"], e["logprob"]) for e in r["logprobs"]]
            for r in sorted(results, key=lambda r: r["index"])], engine


def _ids(run: list[list[tuple[int, float]]]) -> list[list[int]]:
    return [[token for token, _ in line] for line in run]


def _compiled_steps(engine: Engine) -> compiled.CompiledDecode:
    """The run's compiled step, which ran every one-token step."""
    step = engine.runner.model_pass.decode.compiled
    assert step is not None, engine.runner.model_pass.decode.reason
    assert step.steps == sum(1 for s in engine.step_times if s.kind == "decode") >= 20
    return step


def test_the_own_gemma_3_compiles_and_transformers_gemma_3_does_not(gemma_dir: Path) -> None:
    own = _load(gemma_dir)
    assert isinstance(own.model, LlamaCausalLM) and compiled.unsupported(own.model) is None
    theirs = _load(gemma_dir, "transformers")
    assert "transformers' classes" in (compiled.unsupported(theirs.model) or "")


def test_each_layer_kind_gets_its_rope_base_and_mask(gemma_dir: Path) -> None:
    lm = _load(gemma_dir)
    pos = torch.tensor([0, 3, 4, 9])
    h = lm.model.model.embed_tokens(torch.tensor([1, 2, 3, 4]))
    capacity = 16
    (cos, sin, mask), sliding = compiled.step_tables(lm.model, h, pos, capacity)
    assert sliding is not None
    rope = lm.model.model.rotary_emb
    for kind, (c, s) in (("full_attention", (cos, sin)),
                         ("sliding_attention", sliding[:2])):
        want = rope(h[:, None], pos[:, None], kind)
        assert torch.equal(c, want[0]) and torch.equal(s, want[1]) and c.shape == (4, 1, 16)
    assert not torch.equal(cos, sliding[0])  # the two bases differ past position 0
    slots = torch.arange(capacity)[None, :]
    assert torch.equal(mask[:, 0, 0], slots <= pos[:, None])
    hidden = (slots <= pos[:, None] - WINDOW).any(-1)
    assert hidden.tolist() == [False, False, False, True]  # only position 9 outgrew it
    assert torch.equal(sliding[2][:, 0, 0],
                       (slots <= pos[:, None]) & (slots > pos[:, None] - WINDOW))
    # The eager pass's sliding mask for the same rows, over the slots it covers.
    eager = _single_group(pos.tolist(), [0, 1, 2, 3], [0, 1, 2, 3], 10, WINDOW,
                          torch.device("cpu"))
    assert eager.sliding_attn_mask is not None
    assert torch.equal(sliding[2][..., :10], eager.sliding_attn_mask)


def test_the_step_uncompiled_gives_the_eager_tokens_and_logprobs(
        gemma_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's own code (decode_layer.py) as plain PyTorch: what the compilers are
    handed computes the eager pass's logits (1e-4) and tokens."""
    monkeypatch.setattr(compiled, "compiler_problem", lambda device: None)
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kwargs: fn)
    monkeypatch.setattr(compiled.CompiledDecode, "_packaged", lambda *args: None)
    eager, _ = _run(_load(gemma_dir), "off")
    plain, engine = _run(_load(gemma_dir), "on")
    _compiled_steps(engine)
    assert _ids(plain) == _ids(eager)
    assert [len(line) for line in plain] == LENGTHS
    for mine, want in zip(plain, eager, strict=True):
        assert [lp for _, lp in mine] == pytest.approx([lp for _, lp in want], abs=1e-4)


@pytest.mark.heavy
@needs_compiler
def test_torch_compile_gives_transformers_eager_tokens(
        gemma_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled.CompiledDecode, "_packaged", lambda *args: None)
    want, _ = _run(_load(gemma_dir, "transformers"), "off")
    got, engine = _run(_load(gemma_dir), "on")
    step = _compiled_steps(engine)
    assert step.graphs._whole is not None and not step.graphs.packaged
    assert engine.runner.model_pass.cache.capacity >= 32  # the capacity grew: dynamic
    assert _ids(got) == _ids(want)


@pytest.mark.heavy
@needs_compiler
def test_the_packaged_step_is_built_then_loaded_with_transformers_eager_tokens(
        gemma_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    want, _ = _run(_load(gemma_dir, "transformers"), "off")
    built, engine = _run(_load(gemma_dir), "on")
    step = _compiled_steps(engine)
    assert step.package_problem is None
    assert step.graphs.packaged and step.graphs._whole is None  # no torch.compile
    assert _ids(built) == _ids(want)
    packages = sorted((tmp_path / packaged_step.FOLDER).glob("*.pt2"))
    assert len(packages) == 1
    # A later `auto` run on a fresh model loads it and runs every one-token step on it.
    short = [12, 8]
    want_short, _ = _run(_load(gemma_dir, "transformers"), "off", short)
    loaded, engine = _run(_load(gemma_dir), "auto", short)
    step = engine.runner.model_pass.decode.compiled
    assert step is not None and step.graphs._whole is None and step.graphs.packaged
    assert step.steps == sum(1 for s in engine.step_times if s.kind == "decode") > 0
    assert _ids(loaded) == _ids(want_short)
    assert sorted((tmp_path / packaged_step.FOLDER).glob("*.pt2")) == packages


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_step_gives_the_eager_tokens(gemma_dir: Path) -> None:
    """One graph per layer signature (both kinds share it), each layer given its kind's
    tables (CUDA graphs)."""
    def load(impl: str) -> LoadedModel:
        return load_model(str(gemma_dir), device="cuda", dtype="float32",
                          implementation=impl)

    want, _ = _run(load("transformers"), "off")
    got, engine = _run(load("auto"), "on")
    _compiled_steps(engine)
    assert _ids(got) == _ids(want)
