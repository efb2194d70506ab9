"""A conversion's quantised layers kept in their kernels' layout (`packed_weights`): the
first load keeps exactly the buffers it computed, a later load reads them instead of
packing again and gives the same logits bit for bit, and a kept file that is damaged or
does not fit is computed and written again. A user's own model directory is never
written into."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_model import write_tiny_gguf

from aici_cli.models import quantize
from aici_cli.models.aligned import without_padding
from aici_cli.models.conversion_cache import converted_gguf
from aici_cli.models.load import LoadedModel, load_model
from aici_cli.models.packed_weights import BUFFERS, packed_file, read_packed

PROMPTS = ["the quick brown fox jumps over", "a b c d e f g", "hello world, hello"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _logits(lm: LoadedModel) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([lm.tokenizer(p)["input_ids"]])
            out.append(lm.model(input_ids=ids).logits[0].float())
    return torch.cat(out)


def _kept(entry: Path) -> Path:
    files = list(entry.glob("aici-packed-*.safetensors"))
    assert len(files) == 1, files
    return files[0]


def _quantized_buffers(lm: LoadedModel) -> dict[str, torch.Tensor]:
    out = {}
    for name, module in lm.model.named_modules():
        kind = {quantize.Int4Linear: "int4", quantize.Int8Linear: "int8"}.get(type(module))
        if kind is not None:
            out |= {f"{name}.{b}": getattr(module, b) for b in BUFFERS[kind]}
    return out


def _no_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("packed again although the layers were kept")

    monkeypatch.setattr(quantize, "_int4", refuse)
    monkeypatch.setattr(quantize, "_int8", refuse)


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
    assert file == packed_file(entry, mode, first.dtype, torch.device("cpu"))
    kept, computed = without_padding(load_file(str(file))), _quantized_buffers(first)
    assert kept.keys() == computed.keys() and len(computed) == 2 * (2 * 7 + 1)
    assert all(torch.equal(kept[k], computed[k]) for k in kept)
    written = file.stat().st_mtime_ns

    _no_packing(monkeypatch)
    second = load_model(str(gguf), "cpu", dtype, mode)
    assert torch.equal(_logits(first), _logits(second))
    assert file.stat().st_mtime_ns == written  # read, not written again


@pytest.mark.parametrize("damage", ["truncated", "a layer missing", "another dtype"])
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
                  str(file))
    else:
        save_file({k: v.double() if v.is_floating_point() else v for k, v in kept.items()},
                  str(file))
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
    assert packed_file(tiny_model_dir, "int4", torch.float32, torch.device("cpu")) is None
    load_model(str(tiny_model_dir), "cpu", "float32", "int4")
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == before


def test_the_kept_file_is_named_by_what_its_layout_depends_on(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = cache / "models" / "tiny-abc"
    cpu = torch.device("cpu")
    names = {packed_file(entry, "int4", torch.float32, cpu),
             packed_file(entry, "int8", torch.float32, cpu),
             packed_file(entry, "int4", torch.bfloat16, cpu),
             packed_file(entry, "int4", torch.float32, torch.device("cuda"))}
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "ANOTHER-ISA")
    names.add(packed_file(entry, "int4", torch.float32, cpu))
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    names.add(packed_file(entry, "int4", torch.float32, cpu))
    assert len(names) == 6 and None not in names


def test_a_cache_that_cannot_be_written_costs_only_the_packing(
        tiny_model_dir: Path, tmp_path: Path, cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aici_cli.models import packed_weights

    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "Q4_1")
    entry = converted_gguf(gguf, "tiny")
    want = _logits(load_model(str(gguf), "cpu", "float32", "int4"))
    for kept in entry.glob("aici-packed-*"):
        kept.unlink()

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(packed_weights.tempfile, "mkstemp", full)
    assert torch.equal(want, _logits(load_model(str(gguf), "cpu", "float32", "int4")))
    assert not list(entry.glob("*aici-packed-*"))
