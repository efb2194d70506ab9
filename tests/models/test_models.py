"""Model resolution, GGUF caching, loading and prompt rendering (aici_cli.models)."""

from __future__ import annotations

import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch
from reference import greedy_tokens

from aici_cli.core.errors import ModelError, NoChatTemplateError
from aici_cli.models import device
from aici_cli.models.cache import conversions
from aici_cli.models.cache.conversions import cache_dir
from aici_cli.models.device import pick_device, pick_dtype
from aici_cli.models.gguf import convert as gguf_convert
from aici_cli.models.load import load_model
from aici_cli.models.sources import packaged as sources
from aici_cli.models.sources.packaged import DEFAULT_MODEL
from aici_cli.models.sources.resolve import resolve_model
from aici_cli.models.tokenizer.chat import render_prompt

ACCEPTED = ("expected a Hugging Face model directory, a .gguf file, a hub id cached locally "
            "(org/name), or a short name ('aici-batch models' lists them)")

# A well-formed GGUF file holding nothing: magic, version 3, no tensors, no metadata. For
# tests that stub the conversion itself.
EMPTY_GGUF = b"GGUF" + (3).to_bytes(4, "little") + bytes(16)


@pytest.fixture
def tiny_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model, for tests that damage or edit its files."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "tiny"))


# --- loading the tiny model ------------------------------------------------------------------


def test_tiny_model_dir_resolves_to_itself(tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir


def test_tiny_model_loads_on_cpu_in_float32(tiny_model_dir: Path) -> None:
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")

    assert lm.device == torch.device("cpu")
    assert lm.dtype == torch.float32
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32}
    assert not lm.model.training
    assert lm.name == tiny_model_dir.name
    assert lm.vocab_size == lm.model.config.vocab_size == len(lm.tokenizer)
    eos = lm.tokenizer.convert_tokens_to_ids("</s>")
    assert lm.eos_token_ids == frozenset({eos})
    assert lm.tokenizer.pad_token == "</s>"  # the tiny tokenizer has none of its own
    logits = lm.model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, lm.vocab_size)


def test_eos_ids_merge_generation_config_list_and_tokenizer(tiny_copy: Path) -> None:
    gen_path = tiny_copy / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [5, 7]
    gen_path.write_text(json.dumps(gen))

    lm = load_model(str(tiny_copy), device="cpu", dtype="float32")

    assert lm.eos_token_ids == frozenset({5, 7, lm.tokenizer.eos_token_id})


def test_chat_template_renders_with_generation_prompt(tiny_model_dir: Path) -> None:
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": 'Say {"a": 1}'},
    ]

    text = render_prompt(lm.tokenizer, messages)

    assert text == '<s><|system|>\nBe brief.</s>\n<|user|>\nSay {"a": 1}</s>\n<|assistant|>\n'
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert lm.tokenizer.decode(ids) == text  # byte-level BPE round-trips any text


def test_render_prompt_without_template_is_a_typed_model_error(tiny_model_dir: Path) -> None:
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    lm.tokenizer.chat_template = None

    with pytest.raises(NoChatTemplateError) as info:
        render_prompt(lm.tokenizer, [{"role": "user", "content": "hi"}])
    assert isinstance(info.value, ModelError)  # the engine's per-line error, typed:
    assert info.value.type == "no_chat_template"
    assert str(info.value) == (
        f"model '{tiny_model_dir.name}' has no chat template, so 'messages' cannot be "
        "rendered; give this line a 'prompt' (raw text) instead"
    )


def test_template_that_rejects_messages_is_a_model_error(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"

    with pytest.raises(ModelError, match="chat template failed: .*roles must alternate"):
        render_prompt(tokenizer, [{"role": "user", "content": "hi"}])


# --- bad specs and damaged models ------------------------------------------------------------


def test_unknown_spec_says_what_is_accepted(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError) as info:
        resolve_model("foo")
    assert str(info.value) == (
        f"model 'foo' not found: not a known model name, and no file or directory "
        f"{tmp_path / 'foo'} exists; {ACCEPTED}"
    )


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="directory without config.json"):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf_is_rejected(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelError, match="not a .gguf file"):
        resolve_model(str(weights))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing"])
def test_damaged_weights_are_a_one_line_model_error(tiny_copy: Path, damage: str) -> None:
    weights = tiny_copy / "model.safetensors"
    if damage == "garbage":
        weights.write_bytes(b"this is not a safetensors file" * 10)
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        weights.unlink()

    with pytest.raises(ModelError) as info:
        load_model(str(tiny_copy), device="cpu", dtype="float32")
    message = str(info.value)
    assert message.startswith(f"cannot load model from {tiny_copy}: ")
    assert "\n" not in message


# --- device and dtype choice -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_explicit_dtype_is_honoured_on_cpu(spec: str, expected: torch.dtype) -> None:
    assert pick_dtype(spec, torch.device("cpu")) == expected


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, native_bf16: bool) -> None:
    monkeypatch.setattr(device, "cpu_features",
                        lambda: types.SimpleNamespace(native_bf16=native_bf16))
    expected = torch.bfloat16 if native_bf16 else torch.float32
    assert pick_dtype("auto", torch.device("cpu")) == expected


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_dtype_on_cuda_prefers_bfloat16(monkeypatch, bf16: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    expected = torch.bfloat16 if bf16 else torch.float16
    assert pick_dtype("auto", torch.device("cuda")) == expected


def test_unknown_dtype_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="unknown dtype 'fp8'"):
        pick_dtype("fp8", torch.device("cpu"))


def test_pick_device(monkeypatch) -> None:
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(ModelError, match="CUDA is not available"):
        pick_device("cuda")
    with pytest.raises(ModelError, match="unknown device 'tpu'"):
        pick_device("tpu")


# --- cache location and GGUF conversion bookkeeping -----------------------------------------


def test_cache_dir_precedence(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AICI_BATCH_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "aici-batch"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "aici-batch"
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"


def test_gguf_is_converted_once_into_a_keyed_cache_dir(
    stub_conversion: list[Path], tmp_path: Path
) -> None:
    gguf = tmp_path / "My Model.Q4.gguf"
    gguf.write_bytes(EMPTY_GGUF)

    first = resolve_model(str(gguf))
    second = resolve_model(str(gguf))

    assert first == second
    assert first.parent == tmp_path / "cache" / "models"
    assert first.name.startswith("my-model.q4-") and len(first.name) == len("my-model.q4-") + 12
    assert stub_conversion == [gguf.resolve()]
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temp left

    # The entry is keyed by content: a touched file keeps it, a changed one gets its own.
    os.utime(gguf, ns=(0, 0))
    assert resolve_model(str(gguf)) == first
    assert len(stub_conversion) == 1
    gguf.write_bytes(EMPTY_GGUF + b"\0")
    assert resolve_model(str(gguf)) != first
    assert len(stub_conversion) == 2


def test_failed_conversion_leaves_no_partial_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))

    def convert(gguf: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise ValueError("GGUF model with architecture foo is not supported yet.")

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(EMPTY_GGUF)

    with pytest.raises(ModelError, match="cannot convert .*x.gguf: ValueError: GGUF model"):
        resolve_model(str(gguf))
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_concurrent_conversion_keeps_the_winners_copy(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))

    def convert(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text('{"mine": true}')
        # Another run renames its finished copy into place while this one works.
        winner = conversions.cache_target(gguf, "x")
        winner.mkdir()
        (winner / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(EMPTY_GGUF)

    target = resolve_model(str(gguf))
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


# --- the real default model ------------------------------------------------------------------


@pytest.mark.real_model
def test_default_model_converts_once_and_loads() -> None:
    try:
        gguf = sources.default_gguf_path()
    except ModelError as exc:
        pytest.skip(str(exc))

    path = resolve_model(None)  # converts on the first run on this machine, ~25 s
    assert path.name.startswith(f"{DEFAULT_MODEL}-")
    assert resolve_model(None) == path
    assert resolve_model(DEFAULT_MODEL) == path
    assert resolve_model(str(gguf)) == path  # the same file by path shares the cache entry

    lm = load_model(None, device="cpu")
    assert lm.name == DEFAULT_MODEL
    assert lm.vocab_size == 49152
    assert lm.tokenizer.chat_template
    assert lm.eos_token_ids == frozenset({lm.tokenizer.convert_tokens_to_ids("<|im_end|>")})

    # Conversion sanity: a wrong tensor mapping still loads but answers gibberish.
    prompt = render_prompt(
        lm.tokenizer, [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = lm.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert "Paris" in lm.tokenizer.decode(greedy_tokens(lm.model, ids, 12))
