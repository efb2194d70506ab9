"""Weight-only quantisation (`--quantize`): GGUF blocks read exactly, the int4/int8 layers
compute what their codes say, and a quantised model's logits stay near the bf16 ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_tolerance import TOLERANCE
from tiny_model import write_tiny_gguf

from aici_cli.models.cache.conversions import converted_gguf
from aici_cli.models.gguf import blocks as gguf_blocks
from aici_cli.models.gguf.entry_record import BASE_FILE
from aici_cli.models.gguf.matrices import MATRICES_KEY
from aici_cli.models.kernels.aligned import PAD_PREFIX
from aici_cli.models.load import load_model
from aici_cli.models.quant.quantize import (
    Int4Linear,
    Int8Linear,
    available_blocks,
    quantize_int4,
    quantize_int8,
    resolve_mode,
)

PROMPTS = ["the quick brown fox jumps over", "a b c d e f g", "hello world, hello"]


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]), rows=st.integers(1, 6),
       blocks=st.integers(1, 4), seed=st.integers(0, 2**16), spread=st.floats(1e-3, 1e3))
def test_gguf_blocks_dequantize_exactly_as_gguf_does(kind: str, rows: int, blocks: int,
                                                     seed: int, spread: float) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(seed).normal(0, spread, (rows, blocks * 32)).astype(np.float32)
    raw = quantize(w, qtype)
    read = gguf_blocks.read_blocks(raw, kind)
    assert np.array_equal(gguf_blocks.dequantize(read), dequantize(raw, qtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_and_int8_layers_compute_their_dequantized_weights(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    x = torch.randn(5, 128)
    codes, d, m = quantize_int4(w)
    # Scales and zeros rounded to the activation dtype are part of the layer: use them.
    layer4 = Int4Linear(codes, d, m, None, dtype)
    sz = layer4.scale_zero.float()  # [K/32, N, 2]
    scale, zero = sz[..., 0].t(), sz[..., 1].t()
    deq4 = ((codes.float().view(96, 4, 32) - 8) * scale[..., None]
            + zero[..., None]).view(96, 128)
    assert (deq4 - w).abs().max() <= d.max() * 0.5 + 0.05  # codes round to the nearest step
    q8, s8 = quantize_int8(w)
    layer8 = Int8Linear(q8, s8, None, dtype)
    deq8 = q8.float() * layer8.scale.float()[:, None]
    tol = 1e-4 if dtype == torch.float32 else 0.15
    for layer, deq in ((layer4, deq4), (layer8, deq8)):
        got = layer(x.to(dtype)).float()
        want = x.to(dtype).float() @ deq.t()
        assert (got - want).abs().max().item() < tol


def _logits(lm: object, prompts: list[str]) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = lm.tokenizer(p, return_tensors="pt").input_ids.to(lm.device)  # type: ignore[attr-defined]
            out.append(lm.model(input_ids=ids).logits[0].float())  # type: ignore[attr-defined]
    return torch.cat(out)


def _kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    return float(torch.nn.functional.kl_div(other.log_softmax(-1), ref.log_softmax(-1),
                                            log_target=True, reduction="batchmean"))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_logits_stay_within_tolerance_of_bf16(tiny_model_dir: Path,
                                                        mode: str) -> None:
    ref = _logits(load_model(str(tiny_model_dir), "cpu", "bfloat16", "none"), PROMPTS)
    lm = load_model(str(tiny_model_dir), "cpu", "bfloat16", mode)
    assert lm.quantize == mode
    layers = [type(m) for m in lm.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert len(layers) == 2 * 7 + 1  # 7 per decoder layer, and the output projection
    assert lm.model.get_output_embeddings().__class__ is Int8Linear
    got = _logits(lm, PROMPTS)
    kl_max, diff_max = TOLERANCE[mode]
    assert _kl(ref, got) < kl_max
    assert (ref - got).abs().max().item() < diff_max
    assert not torch.equal(ref, got)  # the weights really changed form


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_logits_on_cuda_stay_within_tolerance_of_bf16(tiny_model_dir: Path,
                                                                mode: str) -> None:
    ref = _logits(load_model(str(tiny_model_dir), "cuda", "bfloat16", "none"), PROMPTS)
    got = _logits(load_model(str(tiny_model_dir), "cuda", "bfloat16", mode), PROMPTS)
    kl_max, diff_max = TOLERANCE[mode]
    assert _kl(ref, got) < kl_max
    assert (ref - got).abs().max().item() < diff_max


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1"])
def test_a_4_bit_gguf_loads_its_own_blocks_as_int4(tiny_model_dir: Path, tmp_path: Path,
                                                   cache: Path, quant: str) -> None:
    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / f"tiny-{quant}.gguf", quant)
    entry = converted_gguf(gguf, "tiny")
    # The matrices stay in the GGUF, where the conversion says they lie; the embedding is
    # kept as its own Q8_0 blocks; only the norms are stored dense, in the dtype runs use.
    from safetensors import safe_open

    with safe_open(str(entry / BASE_FILE), framework="pt") as f:
        where = json.loads(f.metadata()[MATRICES_KEY])
        names = [k for k in f.keys() if not k.startswith(PAD_PREFIX)]  # noqa: SIM118
        stored = {k: f.get_tensor(k) for k in names}
    assert sorted(w["type"] for w in where.values()) == sorted(["Q8_0"] + [quant] * 14)
    assert where["model.embed_tokens.weight"]["type"] == "Q8_0"
    norms = {k: v for k, v in stored.items() if ":" not in k}
    assert norms and all(k.endswith("norm.weight") for k in norms)
    assert {v.dtype for v in norms.values()} == {torch.bfloat16}
    assert sorted(k for k in stored if ":" in k and not k.endswith(":rows")) == \
        ["model.embed_tokens.weight:q8", "model.embed_tokens.weight:q8_d"]
    # llama.cpp's q/k row interleaving, undone as transformers undoes it
    assert sorted(k.split(".")[-2] for k in stored if k.endswith(":rows")) == \
        ["k_proj", "k_proj", "q_proj", "q_proj"]
    assert available_blocks(entry) == {"q4", "q8"}
    assert resolve_mode("auto", entry, torch.bfloat16) == "int4"
    assert resolve_mode("auto", entry, torch.float32) == "none"

    # In float32 the dense copy is the blocks' values rounded to bf16, and the int4
    # layers compute the blocks' values themselves: the two agree to bf16's rounding.
    dense = load_model(str(gguf), "cpu", "float32", "none")
    four = load_model(str(gguf), "cpu", "float32", "int4")
    q_proj = four.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Int4Linear)
    x = torch.randn(3, 64)
    want = dense.model.model.layers[0].self_attn.q_proj(x)
    assert (q_proj(x) - want).abs().max().item() < 0.02
    ref, got = _logits(dense, PROMPTS), _logits(four, PROMPTS)
    assert _kl(ref, got) < 1e-4  # only the output projection is requantised (int8)


def _aici_batch() -> list[str]:
    return [sys.executable, "-m", "aici_cli"]


@pytest.mark.subprocess
def test_run_takes_quantize_and_refuses_it_with_deterministic(tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    env = {**os.environ, "AICI_BATCH_CACHE": str(tmp_path / "cache")}
    base = [*_aici_batch(), "run", str(lines), "--model", str(tiny_model_dir),
            "--max-tokens", "8", "--device", "cpu", "-q"]
    stats = tmp_path / "stats.json"
    done = subprocess.run([*base, "--quantize", "int4", "--stats-out", str(stats)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == len(PROMPTS)
    assert json.loads(stats.read_text())["quantize"] == "int4"
    refused = subprocess.run([*base, "--quantize", "int4", "--deterministic"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        "Error: --deterministic runs unquantised weights: drop --quantize int4"]


def test_a_quantized_run_looks_up_the_ggufs_embedding_blocks_as_a_bf16_table(
        tiny_model_dir: Path, tmp_path: Path, cache: Path) -> None:
    """Quantised, the embedding is only looked up: the conversion keeps the GGUF's Q8_0
    blocks and a lookup dequantises the rows it reads, rounded to bf16 then widened, to
    the same logits bit for bit as the bf16 table an unquantised run reads."""
    from aici_cli.models.gguf.block_embedding import BlockEmbedding

    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "Q4_1")
    table = load_model(str(gguf), "cpu", "bfloat16", "none").model.get_input_embeddings()
    for dtype in ("float32", "bfloat16"):
        lm = load_model(str(gguf), "cpu", dtype, "int4")
        embed = lm.model.get_input_embeddings()
        assert isinstance(embed, BlockEmbedding) and embed.codes.dtype == torch.int8
        ids = torch.arange(embed.num_embeddings)
        assert torch.equal(embed(ids), table.weight.to(lm.dtype))
        blocks = _logits(lm, PROMPTS)
        lm.model.model.embed_tokens = torch.nn.Embedding.from_pretrained(
            table.weight.detach().to(lm.dtype), freeze=True)
        assert torch.equal(blocks, _logits(lm, PROMPTS))


def test_a_float32_quantized_run_looks_up_the_files_narrower_embedding(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A model directory's embedding stored narrower than the run (bf16 in a float32
    run) is kept as stored and widens the rows it reads, to the same logits bit for bit
    as a float32 copy of the table."""
    from safetensors.torch import load_file, save_file

    from aici_cli.models.mapped_load import WideningEmbedding

    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "bf16"))
    weights = model_dir / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    lm = load_model(str(model_dir), "cpu", "float32", "int4")
    embed = lm.model.get_input_embeddings()
    assert isinstance(embed, WideningEmbedding) and embed.weight.dtype == torch.bfloat16
    narrow = _logits(lm, PROMPTS)
    wide = torch.nn.Embedding.from_pretrained(embed.weight.detach().float(), freeze=True)
    lm.model.model.embed_tokens = wide
    assert torch.equal(narrow, _logits(lm, PROMPTS))
    bf16 = load_model(str(model_dir), "cpu", "bfloat16", "int4")  # the run's own dtype: as is
    assert type(bf16.model.get_input_embeddings()) is torch.nn.Embedding
