"""Reading a GGUF file: checking it is whole, converting it (its config, tokenizer and
the tensors no run quantises), and the dense copy a run that quantises nothing reads.

Imports torch; `conversions` imports this module only when a conversion is due.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path
from typing import Any

import torch

from aici_cli.core.errors import ModelError, one_line
from aici_cli.models.gguf.entry_record import DENSE_FILE
from aici_cli.models.gguf.matrices import STORED_DTYPE, GgufMatrices
from aici_cli.models.progress import LoadProgress, current_progress

# Fewest bytes a GGUF file spends per weight: its smallest quantisations (IQ1_S) take
# about 1.56 bits. A config promising more weights than that fits in the file is wrong.
_MIN_GGUF_BYTES_PER_WEIGHT = 0.19


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
    """Convert `gguf` into `out_dir`: its config and tokenizer, and the tensors no run
    quantises, with where the GGUF holds each matrix (`tensors`). No matrix is
    dequantised here where the default mode quantises (a run builds what its mode reads
    on first use: `packed_layers`, `conversions.ensure_dense`); a GGUF without 4-
    or 8-bit blocks, which the default mode runs unquantised, gets its dense copy here.

    The config and tokenizer are transformers' own conversion of the file's metadata,
    each GGUF parsed once for all of them (`shared_reads`).
    """
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from aici_cli.models.gguf.tensors import write_base

    folder, file = str(gguf.parent), gguf.name
    with shared_reads():
        config = AutoConfig.from_pretrained(folder, gguf_file=file, local_files_only=True)
        model = _on_meta(config)
        _check_gguf_config(gguf, model)
        # Only now: a file refused above gets its one-line error without this notice.
        progress = current_progress()
        progress.note(f"converting {gguf.name} to safetensors in {out_dir.parent} (once)")
        _save_config(model, out_dir)
        parsed_config = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
        write_base(gguf, model, parsed_config, out_dir, progress)
        if not GgufMatrices(out_dir).block_kinds():
            # No 4- or 8-bit blocks: the default mode runs it unquantised (`resolve_mode`).
            write_dense(gguf, out_dir / DENSE_FILE)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file,
                                                  local_files_only=True)
        if not tokenizer.chat_template:
            template = _gguf_string_field(gguf, "tokenizer.chat_template")
            if template:
                tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)


def write_dense(gguf: Path, file: Path) -> None:
    """Write `file`: every weight of `gguf` in bfloat16, as transformers' loader
    dequantises it (what conversions stored before matrices stayed in the GGUF: a
    float32 run computes on exactly these values). For runs that quantise nothing;
    written beside `file` and renamed into place."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from aici_cli.models.kernels.aligned import save_aligned

    folder, name = str(gguf.parent), gguf.name
    with shared_reads():
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = _on_meta(config)
        with _tensor_steps(current_progress(), f"converting {gguf.name}"):
            parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                          torch_dtype=STORED_DTYPE)
    state = set(model.state_dict())
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = {k: v for k, v in parsed["tensors"].items() if k in state
               and not (tied and k == "lm_head.weight")}  # as save_pretrained drops it
    missing = sorted(state - set(tensors) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise ModelError(f"cannot convert {gguf}: GGUF lacks tensors {missing[:3]}")
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        save_aligned(tensors, tmp, {"format": "pt"})
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def _on_meta(config: Any) -> Any:
    """The model of `config` on the meta device (its names and module types, no memory),
    in the dtype a conversion stores."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=STORED_DTYPE)


def _save_config(model: Any, out_dir: Path) -> None:
    """config.json and generation_config.json, as `save_pretrained` writes them (its
    weights aside)."""
    model.config.dtype = str(STORED_DTYPE).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    if model.can_generate():
        model.generation_config.save_pretrained(out_dir)


@contextlib.contextmanager
def shared_reads() -> Iterator[None]:
    """Within: each GGUF file is parsed once, and each of gguf's tensor-name maps built
    once, for transformers' config, tokenizer and tensor mapping and this package's
    reads.

    transformers' config and its tokenizer each parse the whole file (~3.6 s for the
    default model, most of it its vocabulary), and its tensor mapping builds the same
    name map once per module of the model (~10 s): memoised here by replacing, for the
    length of the block, the names it imports when called. Where a later transformers
    imports them otherwise, nothing is shared and the conversion is only slower.
    Re-entrant."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if getattr(gguf.GGUFReader, "aici_shared", False):
        yield
        return
    originals = (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.load_gguf_checkpoint)
    reader_class: Any = originals[0]
    name_map, load = originals[1], originals[2]
    readers: dict[tuple[str, str], Any] = {}
    metadata: dict[str, Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    def checkpoint(path: Any, return_tensors: bool = False, model_to_load: Any = None,
                   torch_dtype: Any = None) -> Any:
        if return_tensors:
            return load(path, return_tensors, model_to_load, torch_dtype)
        key = str(Path(path).resolve())
        if key not in metadata:
            metadata[key] = load(path, False)
        return copy.deepcopy(metadata[key])  # callers edit what they get

    reader.aici_shared = True  # type: ignore[attr-defined]
    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    gguf_utils.load_gguf_checkpoint = checkpoint
    try:
        yield
    finally:
        gguf.GGUFReader = reader_class  # type: ignore[misc]
        gguf.get_tensor_name_map, gguf_utils.load_gguf_checkpoint = name_map, load


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


def _check_gguf_config(gguf: Path, model: Any) -> None:
    """Refuse a config that promises more weights than the file can hold; `model`: built
    from it on the meta device.

    A GGUF whose metadata lack the model's dimensions gets transformers' defaults for its
    architecture (7B parameters for llama): building that model would take ~28 GB before
    any tensor is read. Counting on the meta device allocates nothing.
    """
    weights = sum(p.numel() for p in model.parameters())
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
