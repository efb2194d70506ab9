"""Shared fixtures: one tiny random model per test session; the example controllers built
once per session; the JavaScript toolchain's presence; the `real_model` and `ray` markers."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from tiny_model import build_tiny_model

if TYPE_CHECKING:
    from aici_cli.models import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
# `aici-batch run` in the tests (CliRunner in this process, and the runs they start as
# processes, which inherit it) runs its engine inline, in the run's own process: fast, and
# monkeypatches reach it. tests/test_engine_process.py runs the engine process itself.
os.environ.setdefault("AICI_BATCH_ENGINE_PROCESS", "inline")
# Loads in the tests skip the kernel probe (a child process per mode and cache folder,
# and many tests use a cache folder of their own); tests/test_kernel_probe.py and the
# kernel-path matrix (tests/test_kernel_matrix.py) run it.
os.environ.setdefault("AICI_BATCH_KERNEL_PROBE", "off")
# Set by .ci/run (after `make setup` installed the JavaScript toolchain): there the
# JavaScript tests fail instead of skipping when node or componentize-js is missing.
REQUIRE_JS = "AICI_REQUIRE_JS"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "real_model: uses the default SmolLM2 model (first run converts its GGUF, ~25 s)",
    )
    config.addinivalue_line(
        "markers",
        "ray: starts a local Ray instance (the `ray` extra); `pytest -m ray` runs these alone",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `ray` tests last: a Ray driver in this process installs native fault handlers
    (SIGILL among them) over wasmtime's, so a wasm trap after it would kill the process.
    (`make test` runs them in a process of their own.) The sort is stable: the order
    within each group stays."""
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Llama + byte-level BPE tokenizer with a chat template (~0.1 s to build).

    Session-scoped and shared: tests must not modify its files (copy it first).
    """
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def lm(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model loaded once for the session (fp32, cpu, ~1 s). Shared: tests must not
    change its weights or settings."""
    from aici_cli.models import load_model

    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture
def stub_conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """A private conversion cache (`tmp_path/cache`), and the ~20 s GGUF conversion
    replaced by writing a stub config; returns the GGUF files converted."""
    from aici_cli.models import gguf_convert

    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []

    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(gguf)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    return calls


def require_js(problem: str | None) -> None:
    """Skip (or, with AICI_REQUIRE_JS set, fail) a JavaScript test that cannot run here."""
    if problem is None:
        return
    if os.environ.get(REQUIRE_JS):
        pytest.fail(f"{problem} ({REQUIRE_JS} is set: the JavaScript tests must run)")
    pytest.skip(problem)


@pytest.fixture(scope="session")
def node() -> str:
    """The node executable (the JavaScript SDK's unit tests need nothing else)."""
    found = shutil.which("node")
    require_js(None if found else "node not found: the JavaScript SDK's tests need node >= 18")
    assert found is not None
    return found


@pytest.fixture(scope="session")
def js_toolchain() -> None:
    """node and the pinned componentize-js (`make setup` / `npm ci --prefix controllers/js`)."""
    from aici_cli.control.build.js import toolchain_problem

    require_js(toolchain_problem())


class Builds(Mapping[str, Path]):
    """Example components by name, each built on first use (a test that needs one example
    does not wait for the others)."""

    def __init__(self, src_dir: Path, suffix: str, out_dir: Path) -> None:
        self._src_dir, self._suffix, self._out_dir = src_dir, suffix, out_dir
        self._names = tuple(sorted(p.stem for p in src_dir.glob(f"*{suffix}")))
        self._done: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self._names:
            raise KeyError(name)
        if name not in self._done:
            from aici_cli.control.build import build_controller

            src = self._src_dir / f"{name}{self._suffix}"
            self._done[name] = build_controller(src, self._out_dir / f"{name}.wasm").out
        return self._done[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    """The Python examples (controllers/examples), built once per session (~10 s each)."""
    return Builds(ROOT / "controllers" / "examples", ".py", tmp_path_factory.mktemp("wasm"))


@pytest.fixture(scope="session")
def built_js(tmp_path_factory: pytest.TempPathFactory, js_toolchain: None) -> Builds:
    """The JavaScript examples (controllers/js/examples), built once per session (~15 s
    each; wasmtime's first compile of each takes ~30 s more: builds differ byte for byte,
    so each is compiled afresh)."""
    return Builds(ROOT / "controllers" / "js" / "examples", ".js",
                  tmp_path_factory.mktemp("wasm-js"))
