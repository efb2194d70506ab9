"""Every weight a kernel reads starts at a 64-byte boundary (`models/kernels/aligned.py`).

PyTorch's AVX-512 `_weight_int8pack_mm` reads its weight with aligned vector loads and
kills the process (SIGSEGV) on one that starts off a 16-byte boundary, which a tensor
mapped from a safetensors file usually does. These tests hold on any machine: they look
at the addresses handed to the kernels, not at whether this CPU happens to fault."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tiny_model import write_tiny_gguf
from torch.utils._python_dispatch import TorchDispatchMode

from aici_cli.models.cache.conversions import converted_gguf
from aici_cli.models.cache.packed_layers import LAYOUT_VERSION
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels.aligned import (
    ALIGN,
    PAD_PREFIX,
    align_model,
    aligned,
    is_aligned,
    save_aligned,
    without_padding,
)
from aici_cli.models.kernels.cpu_features import cpu_features
from aici_cli.models.load import LoadedModel, load_model
from aici_cli.models.quant.quantize import Int8Linear, quantize_int8

# The kernels that read a weight matrix: dense linear layers (as aten decomposes
# F.linear) and the weight-only int4/int8 kernels.
KERNELS = {"mm", "addmm", "bmm", "linear", "_weight_int8pack_mm",
           "_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu",
           "int4_vnni_mm", "int8_vnni_mm"}  # models/kernels/int_mm.py: bf16, AVX512-VNNI

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]


def _offsets(file: Path) -> dict[str, int]:
    """Each tensor's byte offset in `file`, from its header (padding left out)."""
    (length,) = struct.unpack("<Q", file.read_bytes()[:8])
    header = json.loads(file.read_bytes()[8:8 + length])
    header.pop("__metadata__", None)
    return {name: 8 + length + entry["data_offsets"][0] for name, entry in header.items()
            if not name.startswith(PAD_PREFIX)}


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.sampled_from(DTYPES),
                                 st.lists(st.integers(0, 7), max_size=3)),
                       min_size=1, max_size=6),
       numpy=st.booleans())
def test_saved_files_put_every_tensor_at_64_bytes_and_read_back_equal(
        tmp_path_factory: pytest.TempPathFactory, shapes: list[tuple[torch.dtype, list[int]]],
        numpy: bool) -> None:
    file = tmp_path_factory.mktemp("st") / "x.safetensors"
    tensors = {f"t{i}": (torch.rand(shape) * 100).to(dtype) for i, (dtype, shape)
               in enumerate(shapes)}
    if numpy:  # as gguf_quantized writes its blocks (bf16 has no numpy dtype)
        tensors = {k: v for k, v in tensors.items() if v.dtype != torch.bfloat16}
        save_aligned({k: v.numpy() for k, v in tensors.items()}, file)
    else:
        save_aligned(tensors, file, {"format": "pt"})
    assert all(offset % ALIGN == 0 for offset in _offsets(file).values())
    read = without_padding(load_file(str(file)))  # the library's own reader accepts it
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(read[name], tensor) and read[name].dtype == tensor.dtype
        assert is_aligned(read[name])


def test_align_model_copies_misaligned_weights_keeps_ties_and_leaves_lookups() -> None:
    buf = torch.zeros(8 * 16 * 8 + 2 * ALIGN, dtype=torch.uint8)
    start = 40 + (-buf.data_ptr()) % ALIGN
    view = buf[start:start + 8 * 16 * 8].view(torch.float64).view(16, 8)
    assert not is_aligned(view)
    lookup_only = torch.nn.Embedding(16, 8)
    lookup_only.weight = torch.nn.Parameter(view, requires_grad=False)
    tied = torch.nn.Parameter(view, requires_grad=False)
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = tied
    table = torch.nn.Embedding(16, 8)
    table.weight = tied
    holder = torch.nn.ModuleDict({"lookup": lookup_only, "head": head, "table": table})
    holder.register_buffer("codes", view.view(torch.int8))
    assert align_model(holder) == 2  # the tied weight and the buffer, not the lookup
    assert head.weight is tied and table.weight is tied and is_aligned(tied)
    assert torch.equal(tied, view) and is_aligned(holder.codes)
    assert lookup_only.weight.data_ptr() == view.data_ptr()


class KernelArgs(TorchDispatchMode):
    """Records, for every kernel call, the data pointers of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in KERNELS:
            ptrs = [a.data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()]
            self.calls.append((name, ptrs))
        return func(*args, **(kwargs or {}))


def _weights(lm: LoadedModel) -> set[int]:
    model = lm.model
    return {t.data_ptr() for t in [*model.parameters(), *model.buffers()] if t.numel()}


def _kernel_weights(lm: LoadedModel) -> Iterator[tuple[str, int]]:
    """(kernel, address) of every model weight a forward pass hands a kernel."""
    ids = torch.tensor([lm.tokenizer("the quick brown fox")["input_ids"]] * 3)
    recorder = KernelArgs()
    with torch.inference_mode(), recorder:
        lm.model(input_ids=ids[:, :-1])
        lm.model(input_ids=ids[:1])
    weights = _weights(lm)
    seen = False
    for name, ptrs in recorder.calls:
        for ptr in ptrs:
            if ptr in weights:
                seen = True
                yield name, ptr
    assert seen, "no kernel call read a weight: the recorder missed them"


def _assert_aligned(lm: LoadedModel, mode: str) -> None:
    kernels = set()
    for name, ptr in _kernel_weights(lm):
        kernels.add(name)
        assert ptr % ALIGN == 0, f"{name} read a weight at {ptr % ALIGN} past 64 bytes"
    if mode != "none":  # the output projection, in both modes
        assert kernels & {"_weight_int8pack_mm", "int8_vnni_mm"}


MODES = ["none", "int8", "int4"]


@pytest.mark.heavy
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_a_users_safetensors_model_hands_kernels_aligned_weights(
        tiny_model_dir: Path, mode: str, impl: str) -> None:
    # transformers' own writer put this model's tensors at 8-byte boundaries of the file
    offsets = _offsets(tiny_model_dir / "model.safetensors").values()
    assert any(offset % ALIGN for offset in offsets)
    for dtype in ("float32", "bfloat16"):
        _assert_aligned(load_model(str(tiny_model_dir), "cpu", dtype, mode, impl), mode)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", MODES)
def test_a_converted_gguf_and_its_kept_layers_are_aligned_in_their_files_and_in_memory(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        mode: str) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "Q4_1")
    entry = converted_gguf(gguf, "tiny")
    for dtype in ("float32", "bfloat16"):
        _assert_aligned(load_model(str(gguf), "cpu", dtype, mode), mode)  # packs, keeps
        _assert_aligned(load_model(str(gguf), "cpu", dtype, mode), mode)  # reads the kept
    # what every run reads, the mode's own file (one for both dtypes) and, where the bf16
    # runs used the VNNI kernels, their layouts (models/quant/vnni_layouts.py)
    files = list(entry.glob("*.safetensors"))
    assert len(files) == (3 if mode != "none" and int_mm.unusable() is None else 2)
    for file in files:
        assert all(offset % ALIGN == 0 for offset in _offsets(file).values()), file.name


def test_an_older_kept_file_at_any_offset_still_gives_aligned_layers(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "Q4_1")
    converted_gguf(gguf, "tiny")
    first = load_model(str(gguf), "cpu", "bfloat16", "int4")
    (kept,) = [f for f in converted_gguf(gguf, "tiny").glob("aici-packed-*.safetensors")
               if not f.name.startswith("aici-packed-vnni-")]
    buffers = without_padding(load_file(str(kept)))
    # safetensors' own writer: 8-byte boundaries only
    save_file(buffers, str(kept), metadata={"aici:layout": LAYOUT_VERSION})
    assert any(offset % ALIGN for offset in _offsets(kept).values())
    second = load_model(str(gguf), "cpu", "bfloat16", "int4")
    _assert_aligned(second, "int4")
    ids = torch.tensor([first.tokenizer("a b c d")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(first.model(input_ids=ids).logits, second.model(input_ids=ids).logits)


@pytest.mark.real_model
@pytest.mark.parametrize("mode", MODES)
def test_the_default_model_hands_kernels_aligned_weights(mode: str) -> None:
    for dtype in ("float32", "bfloat16"):
        _assert_aligned(load_model(None, "cpu", dtype, mode), mode)


def test_padding_names_are_no_model_names() -> None:
    assert PAD_PREFIX.startswith("__") and "." in PAD_PREFIX


# The fault itself (the reproduction), in a child: where it faults, it kills the
# process. An int8 layer built over the same misaligned codes must run, and compute them.
_FAULT = """
import sys, torch
from aici_cli.models.quant.quantize import Int8Linear
N, K, M = 49152, 576, 8
buf = torch.zeros(N * K + 128, dtype=torch.int8)
off = 40 + (-buf.data_ptr()) % 64
codes = buf[off:off + N * K].view(N, K)
g = torch.Generator().manual_seed(0)
codes.copy_(torch.randint(-127, 127, (N, K), dtype=torch.int8, generator=g))
x, scale = torch.randn(M, K, dtype=torch.bfloat16), torch.rand(N, dtype=torch.bfloat16)
assert codes.data_ptr() % 64 == 40
if sys.argv[1] == "layer":
    y = Int8Linear.from_buffers(codes, scale, None)(x)
    ref = (x.float() @ codes.float().t()) * scale.float()
    print(float(((y.float() - ref).abs() / (ref.abs() + 1)).max()))
else:
    torch.ops.aten._weight_int8pack_mm(x, codes, scale)
    print("ran")
"""


def _avx512() -> bool:
    return cpu_features().capability == "AVX512"


@pytest.mark.subprocess
@pytest.mark.skipif(not _avx512(), reason="the fault is in the AVX-512 kernel path")
def test_the_avx512_int8_kernel_over_misaligned_codes_runs_as_a_layer() -> None:
    script = textwrap.dedent(_FAULT)
    layer = subprocess.run([sys.executable, "-c", script, "layer"], capture_output=True,
                           text=True, timeout=120)
    assert layer.returncode == 0, layer.stderr[-2000:]
    assert float(layer.stdout.strip()) < 0.02  # bf16 rounding of the outputs
    # The kernel called directly on the same codes: faults on torch 2.13's AVX-512 path
    # (-11); a torch that fixes it prints "ran". Either way the layer above is safe.
    raw = subprocess.run([sys.executable, "-c", script, "raw"], capture_output=True,
                         text=True, timeout=120)
    assert raw.returncode in (0, -11), raw.stderr[-2000:]


def test_quantize_int8_layer_realigns_its_codes() -> None:
    codes, scale = quantize_int8(torch.randn(64, 32))
    buf = torch.zeros(codes.numel() + 128, dtype=torch.int8)
    off = 40 + (-buf.data_ptr()) % ALIGN
    view = buf[off:off + codes.numel()].view(64, 32)
    view.copy_(codes)
    layer = Int8Linear.from_buffers(view, scale, None)
    assert is_aligned(layer.codes) and torch.equal(layer.codes, codes)
    assert aligned(layer.codes) is layer.codes  # an aligned tensor is not copied
    assert np.array_equal(layer.codes.numpy(), codes.numpy())
