"""Loading a resolved model and its tokenizer onto a device, ready for the engine.

Every transformers call passes `local_files_only=True`. Damaged files fail with one line
that names the file and what is wrong with it: a failed load is followed by a look at the
files (`model_files`) to say which one is at fault, since transformers' own errors seldom do.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aici_cli.core.errors import ModelError, one_line
from aici_cli.models.cache.conversions import cache_hint, ensure_dense
from aici_cli.models.cache.entry_files import is_mode_file, note_default_files
from aici_cli.models.cache.machine import check_machine
from aici_cli.models.cache.packed_layers import packed_file, vnni_file
from aici_cli.models.device import DTYPES, pick_device, pick_dtype
from aici_cli.models.families.llama import unsupported
from aici_cli.models.families.transformers_build import attention_implementation, fill_buffers
from aici_cli.models.gguf.entry_record import BASE_FILE, DENSE_FILE
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels import probe as kernel_probe
from aici_cli.models.kernels.aligned import align_model
from aici_cli.models.kernels.probe import KernelChoice, choose_kernels
from aici_cli.models.progress import current_progress
from aici_cli.models.quant.quantize import resolve_mode
from aici_cli.models.quiet import quiet_transformers
from aici_cli.models.sources.model_files import (
    missing_tensors_problem,
    model_files_problem,
    tokenizer_files_problem,
)
from aici_cli.models.sources.resolve import resolve_with_name
from aici_cli.models.tokenizer.chat import MODEL_NAME_ATTR
from aici_cli.models.tokenizer.fast_tokenizer import read_hub_tokenizer


@dataclass
class LoadedModel:
    """A model ready for the engine.

    `vocab_size` is the width of the logits (`model.config.vocab_size`), which can exceed
    `len(tokenizer)`: masks and samplers must be sized by it, not by the tokenizer.
    """

    model: Any  # `llama.LlamaCausalLM` or transformers' model, in eval mode, on `device`
    tokenizer: Any  # `HubTokenizer` or transformers' fast tokenizer; pad_token always set
    name: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    eos_token_ids: frozenset[int]
    quantize: str = "none"  # the weights' form: none, int8 or int4 (models/quant/quantize.py)
    kernels: KernelChoice | None = None  # the mode the kernel probe passed, and why
    path: Path | None = None  # the directory it was loaded from (a builder loads it again)


def load_model(spec: str | None, device: str = "auto", dtype: str = "auto",
               quantize: str = "none", implementation: str = "auto",
               tokenizer: str = "auto") -> LoadedModel:
    """Resolve `spec`, then load model and tokenizer onto the chosen device and dtype,
    with the linear layers quantised as `quantize` says (`quantize.resolve_mode`: none,
    int8, int4, or auto). `implementation`: "auto" builds a model of the families
    `decoder_shape` names (Llama, Mistral, Qwen 2/3, Gemma 3) as `models/families/llama.py`
    (transformers' own logits, without importing its model classes), any other through
    transformers; "transformers" always through transformers (for
    comparisons with its `generate`). `tokenizer`: "auto" reads a plain fast tokenizer
    without transformers (`fast_tokenizer`), "transformers" always loads transformers'
    class (for callers that use more of its interface, lm-eval). A Llama model with a
    plain tokenizer loads without importing transformers at all.

    ~1 s for the cached default model on CPU (plus the one-time conversion on first use).
    Any failure to read the files becomes a one-line ModelError naming the file at fault
    where it can be told.
    """
    # Validate the cheap choices first: a bad --device must not wait for a GGUF conversion.
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    resolve_mode(quantize, Path(), torch.float32)  # refuses an unknown mode before any work
    if torch_device.type == "cpu" and quantize != "none":
        # The int kernels' library, where a quantised CPU run may take them, built while
        # the model resolves (its first run converts a GGUF file, mostly on one core).
        int_mm.start_build()
    path, name = resolve_with_name(spec)
    mode = resolve_mode(quantize, path, torch_dtype, torch_device)
    kernels = _probed(path, torch_device, dtype, quantize, torch_dtype, mode)
    torch_dtype, mode = DTYPES[kernels.dtype], kernels.quantize
    if mode == "none":
        ensure_dense(path)  # a conversion's unquantised copy, made on its first such run
    own = implementation != "transformers" and _own_llama(path)
    model = _load_weights(path, torch_dtype, mode, torch_device, own)
    if device == dtype == quantize == implementation == "auto":
        _note_default_files(path, mode, torch_device)
    hub = implementation != "transformers" and tokenizer != "transformers"
    tok = _load_tokenizer(path, model.config if own else None, hub)
    model.eval()
    try:
        model.to(torch_device)
    except Exception as exc:  # e.g. CUDA out of memory
        raise ModelError(f"cannot move model to {torch_device}: {one_line(exc)}") from exc
    align_model(model)  # a kernel's aligned load of a mapped weight must not fault
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    # For messages that name the model as the user named it, not by its cache directory.
    setattr(tok, MODEL_NAME_ATTR, name)

    eos_ids = _as_id_set(getattr(model.generation_config, "eos_token_id", None))
    eos_ids |= _as_id_set(tok.eos_token_id)
    if not eos_ids:
        raise ModelError(f"model at {path} defines no end-of-sequence token")
    return LoadedModel(model=model, tokenizer=tok, name=name, device=torch_device,
                       dtype=torch_dtype,
                       vocab_size=int(model.config.get_text_config().vocab_size),
                       eos_token_ids=frozenset(eos_ids), quantize=mode, kernels=kernels,
                       path=path)


def _probed(path: Path, device: torch.device, dtype_spec: str, quantize_spec: str,
            dtype: torch.dtype, mode: str) -> KernelChoice:
    """The mode the kernel probe passes (`probe`): the chosen one, else the next
    where a choice was `auto` (said in one line), else a ModelError."""
    # The verdicts (and the kernels, the compiled steps) of a cache another CPU made are
    # not this machine's: removed before the probe reads them (models/cache/machine.py).
    restored = check_machine()
    if restored is not None:
        current_progress().note(restored)

    def auto_quantize(dt: str) -> str:
        return resolve_mode(quantize_spec, path, DTYPES[dt], device)

    ahead = _probe_int_kernels_ahead(path, device, dtype, mode)
    choice = choose_kernels(path, device.type, dtype_spec, quantize_spec,
                            str(dtype).removeprefix("torch."), mode, auto_quantize)
    if ahead is not None:
        ahead.join()
    if choice.note is not None:
        current_progress().note(choice.note)
    return choice


def _probe_int_kernels_ahead(path: Path, device: torch.device, dtype: torch.dtype,
                             mode: str) -> threading.Thread | None:
    """The int kernels' probe at this dtype (`int_mm.wanted` asks it when the layers are
    built, and finds its verdict in the probe's cache) started on a thread, so that its
    child runs beside `choose_kernels`' rather than after it; None where a load would
    not ask it. The thread prints nothing: a failure is the later probe's to say."""
    if mode == "none" or device.type != "cpu" or not kernel_probe.enabled() \
            or dtype not in (torch.bfloat16, torch.float32) or int_mm.unusable() is not None:
        return None
    shapes, name = kernel_probe.Shapes.of(path), str(dtype).removeprefix("torch.")

    def probe() -> None:
        with contextlib.suppress(Exception):  # `int_mm.wanted` probes again and raises
            int_mm.probed(shapes, name)

    thread = threading.Thread(target=probe, daemon=True, name="int-kernels-probe")
    thread.start()
    return thread


def _note_default_files(path: Path, mode: str, device: torch.device) -> None:
    """Note, in a conversion-cache entry, the mode files a run with every choice at auto
    reads (`entry_files`: prune keeps them); nothing for a model directory."""
    file = path / DENSE_FILE if mode == "none" else packed_file(path, mode, device)
    names = [file.name] if file is not None and file.is_file() \
        and is_mode_file(path, file.name) else []
    vnni = vnni_file(path) if mode != "none" else None
    if vnni is not None and vnni.is_file():  # the quantised layers' VNNI layouts
        names.append(vnni.name)
    note_default_files(path, names)


def _own_llama(path: Path) -> bool:
    """Whether the model at `path` is built as `models/families/llama.py`: one safetensors file (or
    a conversion's) and a config.json of that architecture (anything else, unreadable
    files included, goes through transformers, whose errors `model_files` rewords)."""
    if not (path / DENSE_FILE).is_file() and not (path / BASE_FILE).is_file():
        return False
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and unsupported(raw) is None


def _load_weights(path: Path, dtype: torch.dtype, mode: str = "none",
                  device: torch.device | None = None, own: bool = False) -> Any:
    """The model at `path` in `dtype`, on the CPU (quantised or `own`: on `device`, built
    there by `mapped_load`); every tensor must come from the files.

    transformers fills tensors missing from the checkpoint with random values and only
    warns; a model answering from random weights is worse than no answer, so that is an
    error here.
    """
    if mode != "none" or own:
        from aici_cli.models.mapped_load import load_mapped

        try:
            if own:  # transformers is not involved (nor imported)
                return load_mapped(path, dtype, mode, device or torch.device("cpu"), own)
            with quiet_transformers():
                return load_mapped(path, dtype, mode, device or torch.device("cpu"), own)
        except ModelError:
            raise
        except Exception as exc:  # corrupt files surface as many exception types
            problem = model_files_problem(path) or _load_problem(exc)
            raise ModelError(
                f"cannot load model from {path}: {problem}{cache_hint(path)}") from exc

    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=dtype, local_files_only=True,
                attn_implementation=attention_implementation(config),
                output_loading_info=True,
            )
        model, info = loaded  # (model, loading info) with output_loading_info
    except Exception as exc:  # corrupt/missing files surface as many exception types
        problem = model_files_problem(path) or _load_problem(exc)
        raise ModelError(f"cannot load model from {path}: {problem}{cache_hint(path)}") from exc
    missing = set(info.get("missing_keys") or ())
    # A buffer the files lack holds a value computed from the config (transformers
    # computes it too): not missing where the model's init fills it.
    buffers = sorted(missing & {name for name, _ in model.named_buffers()})
    missing = (missing - set(buffers)) | set(fill_buffers(model, buffers, torch.device("cpu")))
    if missing:
        problem = missing_tensors_problem(sorted(missing))
        raise ModelError(f"cannot load model from {path}: {problem}")
    return model


def _load_tokenizer(path: Path, config: Any = None, hub: bool = True) -> Any:
    """The tokenizer at `path`: with `hub`, a plain fast tokenizer read without
    transformers (`fast_tokenizer`). Else AutoTokenizer, which reads config.json through
    AutoConfig, to pick a tokenizer class where tokenizer_config.json names none: that
    import costs ~1 s (transformers' config classes bring torch.distributed), and
    importing AutoTokenizer itself ~0.3 s. Where the file names a class and no remote
    code, the class comes from the file either way: `TokenizersBackend` (what
    transformers writes) is loaded directly, another through AutoTokenizer with the
    model's own `config` (a `models/families/llama.py` model's) handed over."""
    if hub:
        try:
            found = read_hub_tokenizer(path)
        except Exception:  # noqa: BLE001 - unreadable files: transformers' path says why
            found = None
        if found is not None:
            return found
    with quiet_transformers():
        return _transformers_tokenizer(path, config)


def _transformers_tokenizer(path: Path, config: Any) -> Any:
    named = _named_tokenizer_class(path)
    try:
        if named == "TokenizersBackend":
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(path, padding_side="left",
                                                     local_files_only=True)
        from transformers import AutoTokenizer

        extra = {"config": config} if config is not None and named else {}
        return AutoTokenizer.from_pretrained(path, padding_side="left", local_files_only=True,
                                             **extra)
    except Exception as exc:  # bad JSON, unknown tokenizer class, missing vocabulary...
        problem = tokenizer_files_problem(path) or one_line(exc)
        raise ModelError(
            f"cannot load tokenizer from {path}: {problem}{cache_hint(path)}"
        ) from exc


def _named_tokenizer_class(path: Path) -> str | None:
    """tokenizer_config.json's `tokenizer_class`, where it names one and no remote code."""
    try:
        raw = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or "auto_map" in raw:
        return None
    named = raw.get("tokenizer_class")
    return named if isinstance(named, str) else None


def _load_problem(exc: BaseException) -> str:
    """transformers' error, reworded where its own text would mislead or say little."""
    if "ignore_mismatched_sizes" in str(exc) or "size mismatch" in str(exc):
        return "the weights' tensor shapes do not match config.json"
    return one_line(exc)


def _as_id_set(value: Any) -> set[int]:
    """Token id(s) from a config field that may be None, an int or a list of ints."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value if v is not None}
