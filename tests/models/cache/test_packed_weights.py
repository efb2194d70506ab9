"""A conversion's quantised layers kept in their kernels' layout (`packed_layers`): the
first load keeps exactly what its layers were built from, a later load reads them instead
of packing again and gives the same logits bit for bit, in every dtype from one file, and
a kept file that is damaged or does not fit is computed and written again. A user's own
model directory is never written into."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_model import write_tiny_gguf

from aici_cli.models.cache.conversions import converted_gguf
from aici_cli.models.cache.packed_layers import (
    KEPT,
    LAYOUT_VERSION,
    int4_layout,
    packed_file,
    read_packed,
)
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels.aligned import without_padding
from aici_cli.models.load import LoadedModel, load_model
from aici_cli.models.quant import model_layers, quantize

PROMPTS = ["the quick brown fox jumps over", "a b c d e f g", "hello world, hello"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache, and PyTorch's kernels alone: where the project's int kernels run,
    the layers that tile are theirs and kept in their layout only
    (tests/models/kernels/test_vnni_kernels.py)."""
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(int_mm.ENV, "off")
    return tmp_path / "cache"


def _logits(lm: LoadedModel) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([lm.tokenizer(p)["input_ids"]])
            out.append(lm.model(input_ids=ids).logits[0].float())
    return torch.cat(out)


def _kept(entry: Path) -> Path:
    """The entry's one file of the int4/int8 kernels' layers."""
    files = [f for f in entry.glob("aici-packed-*.safetensors")
             if not f.name.startswith("aici-packed-vnni-")]
    assert len(files) == 1, files
    return files[0]


def _assert_kept_builds_the_layers(kept: dict[str, torch.Tensor], lm: LoadedModel) -> None:
    """Every quantised layer of `lm` is what its kept tensors build: the same packed
    codes, and its scales those kept rounded to the run's dtype."""
    names = set()
    for name, module in lm.model.named_modules():
        if isinstance(module, quantize.Int4Linear):
            assert torch.equal(kept[f"{name}.packed"], module.packed)
            want = quantize.scale_zero(kept[f"{name}.d"], kept[f"{name}.m"], lm.dtype)
            assert torch.equal(want, module.scale_zero)
            names |= {f"{name}.{k}" for k in KEPT["int4"]}
        elif isinstance(module, quantize.Int8Linear):
            assert torch.equal(kept[f"{name}.codes"], module.codes)
            assert torch.equal(kept[f"{name}.scale"].to(lm.dtype), module.scale)
            names |= {f"{name}.{k}" for k in KEPT["int8"]}
    assert names == set(kept)


def _no_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("packed again although the layers were kept")

    monkeypatch.setattr(model_layers, "int4_codes", refuse)
    monkeypatch.setattr(model_layers, "int8_parts", refuse)


@pytest.mark.parametrize(("quant", "mode", "dtype"), [
    ("Q4_1", "int4", "float32"), ("Q4_0", "int4", "bfloat16"), ("Q4_1", "int8", "bfloat16"),
])
def test_kept_layers_give_the_packed_layers_logits_bit_for_bit(
        tiny_model_dir: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
        quant: str, mode: str, dtype: str) -> None:
    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / f"tiny-{quant}.gguf", quant)
    entry = converted_gguf(gguf, "tiny")
    assert not list(entry.glob("aici-packed-*"))
    first = load_model(str(gguf), "cpu", dtype, mode)
    file = _kept(entry)
    assert file == packed_file(entry, mode, torch.device("cpu"))
    kept = without_padding(load_file(str(file)))
    assert len(kept) == (3 * 14 + 2 if mode == "int4" else 2 * 15)
    _assert_kept_builds_the_layers(kept, first)
    written = file.stat().st_mtime_ns

    _no_packing(monkeypatch)
    second = load_model(str(gguf), "cpu", dtype, mode)
    assert torch.equal(_logits(first), _logits(second))
    assert file.stat().st_mtime_ns == written  # read, not written again
    other = "float32" if dtype == "bfloat16" else "bfloat16"
    third = load_model(str(gguf), "cpu", other, mode)  # the same file serves every dtype
    _assert_kept_builds_the_layers(kept, third)
    assert _kept(entry) == file and file.stat().st_mtime_ns == written


VERSION = {"aici:layout": LAYOUT_VERSION}


@pytest.mark.heavy
@pytest.mark.parametrize("damage", ["truncated", "a layer missing", "another dtype",
                                    "another layout version"])
def test_a_kept_file_that_does_not_fit_is_computed_and_written_again(
        tiny_model_dir: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
        damage: str) -> None:
    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "Q4_1")
    entry = converted_gguf(gguf, "tiny")
    want = _logits(load_model(str(gguf), "cpu", "float32", "int4"))
    file = _kept(entry)
    # cloned: not the file's pages
    kept = {k: v.clone() for k, v in without_padding(load_file(str(file))).items()}
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:1000])
    elif damage == "a layer missing":
        save_file({k: v for k, v in kept.items() if ".layers.1.mlp.up_proj." not in k},
                  str(file), metadata=VERSION)
    elif damage == "another dtype":
        save_file({k: v.double() if v.is_floating_point() else v for k, v in kept.items()},
                  str(file), metadata=VERSION)
    else:
        save_file(kept, str(file), metadata={"aici:layout": "1"})
    got = _logits(load_model(str(gguf), "cpu", "float32", "int4"))
    assert torch.equal(want, got)
    again = read_packed(file, torch.device("cpu"))
    assert again.keys() == kept.keys()
    assert all(torch.equal(again[k], kept[k]) for k in kept)

    _no_packing(monkeypatch)  # whole again: the next load reads every layer
    assert torch.equal(want, _logits(load_model(str(gguf), "cpu", "float32", "int4")))


def test_a_users_model_directory_is_never_written_into(tiny_model_dir: Path,
                                                       cache: Path) -> None:
    before = sorted(p.name for p in tiny_model_dir.iterdir())
    assert packed_file(tiny_model_dir, "int4", torch.device("cpu")) is None
    load_model(str(tiny_model_dir), "cpu", "float32", "int4")
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == before


def test_the_kept_file_is_named_by_what_its_layout_depends_on(cache: Path) -> None:
    """int8 layers are a plain matrix and a scale per row on every machine: one file. An
    int4 file is named by its kernel layout, a digest of the packing on this machine."""
    entry = cache / "models" / "tiny-abc"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert packed_file(entry, "int8", cpu) == packed_file(entry, "int8", cuda) \
        == entry / "aici-packed-int8.safetensors"
    int4 = packed_file(entry, "int4", cpu)
    assert int4 == entry / f"aici-packed-int4-{int4_layout('cpu')}.safetensors"
    assert int4_layout("cpu").startswith("cpu-") and len(int4_layout("cpu")) == 4 + 12


def test_a_cache_that_cannot_be_written_costs_only_the_packing(
        tiny_model_dir: Path, tmp_path: Path, cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aici_cli.models.cache import packed_layers

    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "Q4_1")
    entry = converted_gguf(gguf, "tiny")
    want = _logits(load_model(str(gguf), "cpu", "float32", "int4"))
    for kept in entry.glob("aici-packed-*"):
        kept.unlink()

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(packed_layers.tempfile, "mkstemp", full)
    assert torch.equal(want, _logits(load_model(str(gguf), "cpu", "float32", "int4")))
    assert not list(entry.glob("*aici-packed-*"))
