"""Reading a GGUF file: checking it is whole, and converting it to a safetensors model.

Imports torch; `conversion_cache` imports this module only when a conversion is due.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path
from typing import Any

import torch

from aici_cli.core.errors import ModelError
from aici_cli.models.gguf_quantized import write_blocks
from aici_cli.models.one_line import one_line
from aici_cli.models.progress import LoadProgress, current_progress

# Fewest bytes a GGUF file spends per weight: its smallest quantisations (IQ1_S) take
# about 1.56 bits. A config promising more weights than that fits in the file is wrong.
_MIN_GGUF_BYTES_PER_WEIGHT = 0.19

# The dtype of a conversion's dense copy.
STORED_DTYPE = torch.bfloat16


def gguf_problem(gguf: Path) -> str | None:
    """What makes `gguf` unreadable as a GGUF file, or None.

    Reads the header and the tensor directory (about 2 s for the default model, against
    ~20 s for a conversion), so a truncated file is refused before any conversion work.
    """
    from gguf import GGUFReader

    try:
        size = gguf.stat().st_size
        with gguf.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        return f"cannot read the file: {exc.strerror or exc}"
    if magic != b"GGUF":
        return "not a GGUF file (it does not start with the GGUF magic bytes)"
    try:
        reader = GGUFReader(str(gguf))
    except Exception as exc:  # the reader fails in numpy on short or garbled headers
        return (
            f"the file is truncated or corrupt ({size:,} bytes; its header cannot be read: "
            f"{one_line(exc)})"
        )
    needed = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if needed > size:
        return f"the file is truncated: its tensors need {needed:,} bytes, the file holds {size:,}"
    return None


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise `gguf` into a bfloat16 safetensors model plus tokenizer in `out_dir`,
    and keep its 4- and 8-bit matrices as they are beside it (`gguf_quantized`).

    `from_pretrained(gguf_file=...)` would need `accelerate`, which is not a dependency,
    so the model is built from the GGUF's config and filled with transformers' own
    dequantised tensors. Stored in bfloat16, the dtype runs compute in (CUDA, CPUs with
    native bf16): half the disk, load memory and load time of float32 (269 MB against
    538 MB for the default model). A float32 run widens them exactly.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file, local_files_only=True)
    _check_gguf_config(gguf, config)
    # Only now: a file refused above gets its one-line error without this notice.
    progress = current_progress()
    progress.note(f"converting {gguf.name} to safetensors in {out_dir.parent} (once)")
    model = AutoModelForCausalLM.from_config(config, dtype=STORED_DTYPE)
    with _tensor_steps(progress, f"converting {gguf.name}"):
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                      torch_dtype=STORED_DTYPE)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
        missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    else:
        missing = list(result.missing_keys)
    if missing:
        raise ModelError(f"cannot convert {gguf}: GGUF lacks tensors {missing[:3]}")
    model.save_pretrained(out_dir)
    _realign(out_dir / "model.safetensors")
    write_blocks(gguf, model, parsed["tensors"], out_dir)
    del parsed

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
    if not tokenizer.chat_template:
        template = _gguf_string_field(gguf, "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)


def _realign(file: Path) -> None:
    """Rewrite transformers' safetensors file with every tensor at a 64-byte boundary
    (`aligned`), so that a run maps its weights with no copy; ~0.3 s once per conversion."""
    from safetensors import safe_open

    from aici_cli.models.aligned import save_aligned

    # The tensors read are views of the file's map: written beside it, then renamed over.
    aligned_file = file.with_name(f".{file.name}.aligned")
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        save_aligned(tensors, aligned_file, metadata)
    del tensors
    os.replace(aligned_file, file)


@contextlib.contextmanager
def _tensor_steps(progress: LoadProgress, description: str) -> Iterator[None]:
    """Show transformers' loop over the GGUF's tensors (most of a conversion's time) as
    `progress` steps: transformers draws its own tqdm bar there, which no setting of its
    own turns off, so the module's `tqdm` is swapped for the length of the call."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:  # another transformers layout: nothing to swap
        yield
        return

    def steps(items: Iterable[Any], *args: Any, **kwargs: Any) -> Iterator[Any]:
        total = kwargs.get("total")
        if total is None:
            total = len(items) if isinstance(items, Sized) else 0
        return progress.steps(items, int(total), description)

    gguf_utils.tqdm = steps
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _check_gguf_config(gguf: Path, config: Any) -> None:
    """Refuse a config that promises more weights than the file can hold.

    A GGUF whose metadata lack the model's dimensions gets transformers' defaults for its
    architecture (7B parameters for llama): building that model would take ~28 GB before
    any tensor is read. Counting on the meta device allocates nothing.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    weights = sum(p.numel() for p in shell.parameters())
    size = gguf.stat().st_size
    if weights * _MIN_GGUF_BYTES_PER_WEIGHT > size:
        raise ModelError(
            f"cannot convert {gguf}: its metadata describe a model of {weights:,} weights, "
            f"more than its {size:,} bytes can hold (metadata missing or inconsistent)"
        )


def _gguf_string_field(gguf: Path, key: str) -> str | None:
    """A string metadata field of a GGUF file, or None when absent."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).get_field(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")
