"""What a conversion-cache entry of a quantised GGUF holds: after a default run, the
tensors no run quantises once and the layers in their kernels' layout, nothing dense of
the matrices it quantises and no second copy of their blocks; other modes build their
own files on first use, and `aici-batch models --prune` removes those again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from tiny_model import write_tiny_gguf

from aici_cli.cli.main import main
from aici_cli.core.errors import ModelError
from aici_cli.models.cache.conversions import converted_gguf
from aici_cli.models.cache.packed_layers import int4_layout
from aici_cli.models.gguf.entry_record import BASE_FILE, DENSE_FILE, SOURCE_FILE
from aici_cli.models.gguf.matrices import MATRICES_KEY
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels.aligned import PAD_PREFIX
from aici_cli.models.kernels.int_mm import LAYOUT
from aici_cli.models.load import LoadedModel, load_model
from aici_cli.models.quant import model_layers, quantize

PROMPTS = ["the quick brown fox jumps over", "a b c d e f g"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache; and `--dtype auto` as on a CPU with native bfloat16, so that the
    default mode is the default model's (bf16, int4) on any machine."""
    from aici_cli.models import load

    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    picked = load.pick_dtype
    monkeypatch.setattr(load, "pick_dtype", lambda spec, device: torch.bfloat16
                        if spec == "auto" else picked(spec, device))
    return tmp_path / "cache"


@pytest.fixture
def gguf(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny Llama as the default model's file is: Q4_1 linears, a Q8_0 embedding
    (tied to the output projection)."""
    return write_tiny_gguf(tiny_model_dir, tmp_path / "tiny-Q4_1.gguf", "Q4_1")


def _names(file: Path) -> dict[str, torch.dtype]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()  # noqa: SIM118
                if not k.startswith(PAD_PREFIX)}


def _default(spec: str | Path, **choices: str) -> LoadedModel:
    """A load as `aici-batch run` makes it with its defaults (every choice at auto), or
    with `choices` changed."""
    return load_model(str(spec), **({"device": "auto", "dtype": "auto", "quantize": "auto"}
                                    | choices))


def _logits(lm: LoadedModel) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([lm.model(input_ids=torch.tensor([lm.tokenizer(p)["input_ids"]]))
                          .logits[0].float() for p in PROMPTS])


def test_a_default_run_keeps_each_layer_once_in_its_kernels_layout_and_nothing_dense(
        gguf: Path, cache: Path) -> None:
    lm = _default(gguf)  # every choice at auto: int4 on this CPU
    assert lm.quantize == "int4"
    entry = converted_gguf(gguf, "tiny")
    weights = sorted(p.name for p in entry.glob("*.safetensors"))
    layers = {n: m for n, m in lm.model.named_modules()
              if isinstance(m, (quantize.Int4Linear, quantize.Int8Linear))}
    # Where the int kernels run (models/quant/vnni_layouts.py), a layer that tiles runs on
    # them alone and is kept in their layout only; the others in PyTorch's kernels'.
    on_tiles = {n for n, m in layers.items() if m.vnni and not _plain(m).numel()}
    assert bool(on_tiles) == (int_mm.unusable() is None)
    tiled_file = f"aici-packed-vnni-{LAYOUT}.safetensors"
    packed_file = f"aici-packed-int4-{int4_layout('cpu')}.safetensors"
    expected = [BASE_FILE] + ([packed_file] if set(layers) - on_tiles else []) \
        + ([tiled_file] if on_tiles else [])
    assert weights == expected
    base = _names(entry / BASE_FILE)
    # No dense copy of a quantised matrix, and of the GGUF's blocks only the embedding's
    # (which runs look up: stored once, as the file has it).
    assert not {f"{n}.weight" for n in layers} & set(base)
    assert {k for k in base if k.endswith((":q4", ":q8"))} == {"model.embed_tokens.weight:q8"}
    assert "model.embed_tokens.weight" not in base
    if packed_file in weights:
        packed = _names(entry / packed_file)
        assert not any(":" in k for k in packed)  # the kernels' tensors, no GGUF blocks
        assert {k.rsplit(".", 1)[0] for k in packed} == set(layers) - on_tiles
    if on_tiles:
        tiled = {k.rsplit(".", 1)[0] for k in _names(entry / tiled_file)}
        # q/k/v and gate/up kept as one matrix each (their stack, `fused_linear`)
        assert {part for key in tiled for part in _parts(key)} == on_tiles
    record = json.loads((entry / SOURCE_FILE).read_text())
    assert record["default_files"] == weights[1:]
    # What the runs read of the matrices is at most what the GGUF holds, and half again.
    stored = sum((entry / name).stat().st_size for name in weights)
    assert stored <= 1.5 * gguf.stat().st_size


def _plain(layer: quantize.Int4Linear | quantize.Int8Linear) -> torch.Tensor:
    """The codes of a layer's PyTorch kernel (empty on a layer of the int kernels alone)."""
    return layer.packed if isinstance(layer, quantize.Int4Linear) else layer.codes


def _parts(key: str) -> list[str]:
    """The layers a kept stack's key names (`model.layers.0.mlp.gate_proj+up_proj`)."""
    owner, _, names = key.rpartition(".")
    return [f"{owner}.{n}" for n in names.split("+")]


@pytest.mark.heavy
def test_other_modes_build_their_files_on_first_use_and_prune_removes_them(
        gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default = _logits(_default(gguf))
    entry = converted_gguf(gguf, "tiny")
    kept = entry / f"aici-packed-int4-{int4_layout('cpu')}.safetensors"
    fp32 = _logits(_default(gguf, dtype="float32", quantize="none"))  # the exact path
    assert (entry / DENSE_FILE).is_file()
    int8 = _logits(_default(gguf, quantize="int8"))
    assert (entry / "aici-packed-int8.safetensors").is_file()

    dry = CliRunner().invoke(main, ["models", "--prune", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    lines = dry.stdout.splitlines()
    assert lines[-1].startswith("would free 2 files, ")
    assert {line.split()[2] for line in lines[:-1]} == {
        f"{entry.name}/{DENSE_FILE}", f"{entry.name}/aici-packed-int8.safetensors"}
    assert "(the unquantised copy (--quantize none, --dtype float32), which no run in the " \
        "default mode reads)" in dry.stdout
    done = json.loads(CliRunner().invoke(main, ["models", "--prune", "--json"]).stdout)
    assert done["entries"] == [] and len(done["files"]) == 2
    vnni = [] if int_mm.unusable() is not None \
        else [f"aici-packed-vnni-{LAYOUT}.safetensors"]
    assert sorted(p.name for p in entry.glob("*.safetensors")) == sorted([BASE_FILE, kept.name,
                                                                          *vnni])
    assert "nothing to prune" in CliRunner().invoke(main, ["models", "--prune"]).stdout

    # The default mode reads what it kept; a pruned mode builds its file again, the same.
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("built again although the layers were kept")

    with monkeypatch.context() as patched:
        patched.setattr(model_layers, "int4_codes", refuse)
        patched.setattr(model_layers, "int8_parts", refuse)
        assert torch.equal(default, _logits(_default(gguf)))
    assert torch.equal(fp32, _logits(_default(gguf, dtype="float32", quantize="none")))
    assert torch.equal(int8, _logits(_default(gguf, quantize="int8")))


def test_the_unquantised_copy_is_transformers_conversion_of_the_file(
        gguf: Path, cache: Path) -> None:
    """A float32 run computes on what transformers' own GGUF loader gives, rounded to
    bfloat16, as it did when every conversion stored that copy."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _default(gguf, dtype="float32", quantize="none")
    entry = converted_gguf(gguf, "tiny")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                torch_dtype=torch.bfloat16)["tensors"]
    with safe_open(str(entry / DENSE_FILE), framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(PAD_PREFIX)}  # noqa: SIM118
    assert got.keys() == want.keys() - {"lm_head.weight"}  # tied
    assert all(torch.equal(got[k], want[k]) for k in got)
    with safe_open(str(entry / BASE_FILE), framework="pt") as f:
        where = json.loads(f.metadata()[MATRICES_KEY])
        assert all(torch.equal(f.get_tensor(k), want[k]) for k in f.keys()  # noqa: SIM118
                   if ":" not in k and not k.startswith(PAD_PREFIX))
    assert set(where) == {k for k in want if k.endswith("_proj.weight")} \
        | {"model.embed_tokens.weight"}


def test_a_mode_needs_the_gguf_only_to_build_its_layers(
        gguf: Path, cache: Path, tmp_path: Path) -> None:
    first = _logits(_default(gguf))
    entry = converted_gguf(gguf, "tiny")
    gguf.rename(tmp_path / "moved.gguf")  # the converted copy named by its directory
    assert torch.equal(first, _logits(_default(entry)))
    with pytest.raises(ModelError, match="none of the GGUF files it was converted from "
                                         "still holds its content"):
        _default(entry, quantize="int8")


_LAYOUT = """
import torch
from aici_cli.models.cache.packed_layers import _cpu_layout, int4_layout, pack_int4_cpu
from aici_cli.models.kernels.cpu_features import cpu_features
g = torch.Generator().manual_seed(0)
for n, k in ((576, 576), (49152, 576), (1536, 64), (80, 32), (16, 64)):
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    op = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(pack_int4_cpu(codes.to(torch.uint8)), op), (n, k)
print(cpu_features().capability, int4_layout("cpu"), _cpu_layout() is not None)
"""


@pytest.mark.subprocess
def test_int4_files_differ_exactly_where_the_cpu_kernels_pack_differently() -> None:
    """ATen packs int4 per CPU capability (AVX-512: 64 rows a block; AVX2 and the
    default build: 32, paired differently): each capability this CPU can run gets its
    own layout name, and a capability always the same one; and the packing computed from
    one-byte codes gives the op's bytes under each."""
    seen: dict[str, set[str]] = {}
    for capability in ("default", "avx2", "avx512", "default"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run([sys.executable, "-c", _LAYOUT], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        actual, layout, computed = done.stdout.split()
        seen.setdefault(actual, set()).add(layout)
        if actual in ("DEFAULT", "AVX2", "AVX512"):  # x86: a known layout, not the op
            assert computed == "True"
    assert all(len(layouts) == 1 for layouts in seen.values())
    assert len({next(iter(v)) for v in seen.values()}) == len(seen)


def test_a_layout_name_follows_the_kernels_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = int4_layout.__wrapped__("cpu")
    assert real == int4_layout("cpu")
    original = torch.ops.aten._convert_weight_to_int4pack_for_cpu

    def reversed_rows(codes: torch.Tensor, tiles: int) -> torch.Tensor:
        return original(codes.flip(0), tiles)

    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", reversed_rows)
    assert int4_layout.__wrapped__("cpu") not in (real, None)


def test_a_users_model_directory_gets_no_mode_files(tiny_model_dir: Path, tmp_path: Path,
                                                   cache: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    before = sorted(p.name for p in model_dir.iterdir())
    for quantize_mode in ("int4", "int8", "none"):
        load_model(str(model_dir), "cpu", "auto", quantize_mode)
    assert sorted(p.name for p in model_dir.iterdir()) == before
