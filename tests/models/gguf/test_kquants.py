"""GGUF K-quant matrices on PyTorch's int4 and int8 kernels (`aici_cli/models/gguf/kquant.py`).

Random bytes with finite float16 d and dmin are valid K-quant blocks, so the property
tests draw raw blocks and compare with `gguf.quants.dequantize`, the reference:

- Q4_K: codes * d + m in float32 equals gguf's values bit for bit (each scale and
  offset is an f16 times a 6-bit integer, exact in float32, and the sum is the one gguf
  computes). Through the kernel in float32 the only rounding left is the kernel's own
  zero (m + 8 d) and its multiply-add: within 4 float32 ulps of the group's magnitude.
- Q5_K (and Q5_0): every weight within half its sub-block's step (d sc; Q5_0: d) of
  gguf's, and within float32 rounding in groups whose codes span at most 16 values.

Then a tiny Llama written as a Q4_K_M GGUF runs through the CLI with `--quantize int4`
and with `--quantize none`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from arch_gguf import write_arch_gguf
from arch_models import build_arch_model
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from aici_cli.cli.main import main
from aici_cli.models.cache.conversions import converted_gguf
from aici_cli.models.gguf import kquant
from aici_cli.models.gguf.block_embedding import BlockEmbedding
from aici_cli.models.gguf.matrices import GgufMatrices
from aici_cli.models.kernels import int_mm
from aici_cli.models.load import LoadedModel, load_model
from aici_cli.models.quant import quantize


def _blocks(kind: str, draw_bytes: bytes, d: float, dmin: float) -> np.ndarray:
    """One row of two random `kind` super-blocks with the given d and dmin."""
    size = kquant.block_bytes(kind)
    raw = np.frombuffer(draw_bytes, dtype=np.uint8)[:2 * size].copy().reshape(2, size)
    raw[:, 0:2] = np.array([d], dtype=np.float16).view(np.uint8)
    raw[:, 2:4] = np.array([dmin], dtype=np.float16).view(np.uint8)
    return raw.reshape(1, -1)


def _reference(raw: np.ndarray, kind: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32)


def _expand(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    return codes.astype(np.float32) * np.repeat(d, 32, axis=1) + np.repeat(m, 32, axis=1)


_F16 = st.floats(min_value=-60000, max_value=60000, width=16, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=2 * 176, max_size=2 * 176), _F16, _F16)
def test_q4_k_is_one_int4_group_per_sub_block_exactly(data: bytes, d: float,
                                                       dmin: float) -> None:
    raw = _blocks("Q4_K", data, d, dmin)
    codes, scale, offset = kquant.int4_parts(raw, "Q4_K")
    assert codes.max() <= 15 and scale.dtype == offset.dtype == np.float32
    assert np.array_equal(_expand(codes, scale, offset), _reference(raw, "Q4_K"))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=2 * 176, max_size=2 * 176), _F16, _F16)
def test_q5_k_loses_at_most_half_a_step(data: bytes, d: float, dmin: float) -> None:
    from gguf.quants import Q4_K

    raw = _blocks("Q5_K", data, d, dmin)
    codes, scale, offset = kquant.int4_parts(raw, "Q5_K")
    assert codes.max() <= 15
    want = _reference(raw, "Q5_K")
    error = np.abs(_expand(codes, scale, offset) - want).reshape(2, 8, 32)
    sc, _ = Q4_K.get_scale_min(raw.reshape(2, -1)[:, 4:16])
    step = np.abs(np.float32(d) * sc.astype(np.float32))[..., None]  # [2, 8, 1]
    # Half a step, plus float32 rounding of the offset sum and of gguf's own q d - m.
    slack = 4 * np.finfo(np.float32).eps * (np.abs(want).reshape(2, 8, 32).max(-1,
                                                  keepdims=True) + step * 32)
    assert (error <= step / 2 + slack).all()
    # Groups whose 5-bit codes span at most 16 values (their values at most 15 steps)
    # keep them all.
    values = want.reshape(2, 8, 32)
    narrow = (values.max(-1) - values.min(-1)) <= 15 * step[..., 0] * (1 - 1e-6)
    assert (error.max(-1)[narrow] <= slack[..., 0][narrow]).all()


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=8 * 22, max_size=8 * 22), st.lists(_F16, min_size=8, max_size=8))
def test_q5_0_loses_at_most_half_a_step(data: bytes, ds: list[float]) -> None:
    raw = np.frombuffer(data, dtype=np.uint8).copy().reshape(8, 22)
    raw[:, 0:2] = np.array(ds, dtype=np.float16).view(np.uint8).reshape(8, 2)
    raw = raw.reshape(2, -1)  # two rows of four blocks
    codes, scale, offset = kquant.int4_parts(raw, "Q5_0")
    assert codes.max() <= 15 and codes.shape == (2, 128)
    want = _reference(raw, "Q5_0").reshape(8, 32)
    error = np.abs(_expand(codes, scale, offset).reshape(8, 32) - want)
    step = np.abs(np.array(ds, dtype=np.float32))[:, None]
    slack = 4 * np.finfo(np.float32).eps * step * 32
    assert (error <= step / 2 + slack).all()
    narrow = (want.max(-1) - want.min(-1)) <= 15 * step[:, 0] * (1 - 1e-6)
    assert (error.max(-1)[narrow] <= slack[:, 0][narrow]).all()


def test_auto_takes_int4_where_a_file_has_4_bit_matrices_else_int8() -> None:
    """A Q4_K_M file (Q4_K, some Q6_K) runs int4; one with 5-bit matrices (Q5_K_M, or
    a Q4_K_M with Q5_0 fallbacks as gemma-3-270m's) int8, whose error on 5-bit codes is
    ~7x lower than int4's (docs/models.md)."""
    def kinds(*types: str) -> set[str]:
        matrices = GgufMatrices.__new__(GgufMatrices)
        matrices._where = {f"m{i}": {"type": t} for i, t in enumerate(types)}
        return matrices.block_kinds()

    assert kinds("Q4_K", "Q6_K", "Q8_0") == {"q4", "q8"}
    assert kinds("Q5_K", "Q6_K") == kinds("Q5_0") == kinds("Q6_K") == {"q8"}
    assert kinds("Q4_K", "Q5_0", "Q6_K", "Q8_0") == {"q8"}
    assert kinds("F16", "Q3_K") == set()


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=4 * 144, max_size=4 * 144),
       st.floats(min_value=2.0 ** -13, max_value=1.0, width=16),
       st.floats(min_value=0, max_value=1.0, width=16))
def test_the_int4_kernel_computes_gguf_s_q4_k_values(data: bytes, d: float,
                                                     dmin: float) -> None:
    """In float32 the kernel rounds nothing but its zero (m + 8 d) and multiply-adds."""
    two = np.concatenate([_blocks("Q4_K", data[:2 * 144], d, dmin),
                          _blocks("Q4_K", data[2 * 144:], d, dmin)])  # [2 rows, 512]
    raw = np.tile(two, (16, 1))  # the CPU kernel packs rows 32 at a time
    codes, scale, offset = (torch.from_numpy(a) for a in kquant.int4_parts(raw, "Q4_K"))
    layer = quantize.Int4Linear(codes.to(torch.int32), scale, offset, None, torch.float32)
    got = layer(torch.eye(512)).t()  # [32, 512]: the weights the kernel uses
    want = torch.from_numpy(_reference(raw, "Q4_K"))
    magnitude = (scale.abs() * 15 + offset.abs()).repeat_interleave(32, dim=1)
    assert ((got - want).abs() <= 4 * torch.finfo(torch.float32).eps * magnitude).all()


@pytest.fixture(scope="module")
def k_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama wide enough for K-quants (256 inputs a super-block) written as a
    Q4_K_M GGUF: Q4_K matrices, Q6_K down and output projections."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("kquant")
    directory = build_arch_model("llama", tiny_model_dir, root / "llama")
    config = json.loads((directory / "config.json").read_text())
    config |= {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**config))
    model.save_pretrained(directory)
    return write_arch_gguf(directory, root / "tiny-Q4_K_M.gguf", "Q4_K_M")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _load(gguf: Path, mode: str) -> LoadedModel:
    return load_model(str(gguf), device="cpu", dtype="bfloat16", quantize=mode)


def test_a_q4_k_m_file_runs_int4_from_its_blocks(k_model: Path, cache: Path) -> None:
    """Q4_K layers hold the file's codes and scales, Q6_K ones are int8 within half an
    int8 step of the file's values, and the entry keeps nothing dense of them."""
    lm = _load(k_model, "auto")
    assert lm.quantize == "int4"
    entry = converted_gguf(k_model, "tiny")
    matrices = GgufMatrices(entry)
    layers = {n: m for n, m in lm.model.named_modules()
              if isinstance(m, (quantize.Int4Linear, quantize.Int8Linear))}
    kinds = {n: type(m).__name__ for n, m in layers.items()}
    assert kinds["model.layers.0.self_attn.o_proj"] == "Int4Linear"
    assert kinds["model.layers.0.mlp.down_proj"] == "Int8Linear"  # Q6_K
    o_proj = layers["model.layers.0.self_attn.o_proj"]
    parts = matrices.int4("model.layers.0.self_attn.o_proj.weight")
    assert parts is not None
    tiled = o_proj.tiled()
    if o_proj.packed.numel() == 0:  # on the int kernels alone: their layout of the same
        assert tiled is not None
        codes, d, m = int_mm.untile_int4(tiled)
        assert torch.equal(codes.long(), parts[0].long())
        assert torch.equal(d, parts[1].half()) and torch.equal(m, parts[2].half())
    else:
        assert torch.equal(o_proj.scale_zero, quantize.scale_zero(parts[1], parts[2],
                                                                  torch.bfloat16))
        assert torch.equal(o_proj.packed, quantize.pack_int4(parts[0]))
    down = layers["model.layers.0.mlp.down_proj"]
    assert isinstance(down, quantize.Int8Linear)
    exact = matrices.row_source("model.layers.0.mlp.down_proj.weight")(0, 256)
    scale = exact.abs().amax(dim=1, keepdim=True) / 127
    codes8 = down.rows(torch.arange(256)).float()
    assert ((codes8 * scale - exact).abs() <= scale / 2 * (1 + 1e-5)).all()
    # each layer kept in the layout of the kernel that runs it (models/quant/vnni_layouts.py)
    kept = [p.name for p in entry.glob("aici-packed-*.safetensors")]
    assert kept and all(n.startswith(("aici-packed-int4-", "aici-packed-vnni-")) for n in kept)
    assert (entry / "aici-base.safetensors").is_file()
    # The Q4_K embedding is kept as its sub-blocks, rows widened as looked up to the
    # bfloat16 of gguf's values (what a dense copy holds).
    embed = lm.model.get_input_embeddings()
    assert isinstance(embed, BlockEmbedding) and embed.d.dtype == torch.float32
    with safe_open(str(entry / "aici-base.safetensors"), framework="pt") as f:
        assert "model.embed_tokens.weight" not in f.keys()  # noqa: SIM118
    table = matrices.row_source("model.embed_tokens.weight")(0, embed.num_embeddings)
    ids = torch.arange(embed.num_embeddings)
    assert torch.equal(embed(ids).float(), table.to(torch.bfloat16).float())


def _logits(lm: LoadedModel, text: str) -> torch.Tensor:
    with torch.inference_mode():
        ids = torch.tensor([lm.tokenizer(text)["input_ids"]])
        return lm.model(input_ids=ids).logits[0].float()


def test_int4_runs_the_file_as_the_unquantised_run_does(k_model: Path, cache: Path,
                                                        tmp_path: Path) -> None:
    """Through the CLI, greedy, `--quantize int4` against `--quantize none` of one file:
    the same text; and logits within 3% of their spread (measured: 1.4%; the runs differ
    by the int4 kernel's bfloat16 scales and arithmetic, and by the Q6_K matrices' int8
    requantisation, ~1% RMS of their values)."""
    lines = "".join(json.dumps({"id": str(i), "prompt": p, "max_tokens": 8}) + "\n"
                    for i, p in enumerate(["the quick brown", "a b c"]))
    texts = {}
    for mode in ("int4", "none"):
        result = CliRunner().invoke(main, [
            "run", "-", "--model", str(k_model), "--device", "cpu", "--dtype", "bfloat16",
            "--quantize", mode, "--temperature", "0", "-q"], input=lines)
        assert result.exit_code == 0, result.output
        rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
        texts[mode] = {r["id"]: r["text"] for r in rows}
    assert texts["int4"] == texts["none"] and all(texts["none"].values())
    int4 = _logits(_load(k_model, "int4"), "the quick brown fox")
    dense = _logits(_load(k_model, "none"), "the quick brown fox")
    spread = dense.max() - dense.min()
    assert (int4 - dense).abs().max() <= 0.03 * spread
    shutil.rmtree(cache, ignore_errors=True)
