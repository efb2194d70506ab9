"""Shared fixtures: one tiny random model per test session; the `real_model` and `ray`
markers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_model import build_tiny_model

EXAMPLES = Path(__file__).resolve().parents[1] / "controllers" / "examples"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "real_model: uses the default SmolLM2 model (first run converts its GGUF, ~25 s)",
    )
    config.addinivalue_line(
        "markers",
        "ray: starts a local Ray instance (the `ray` extra); `pytest -m ray` runs these alone",
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Llama + byte-level BPE tokenizer with a chat template (~0.1 s to build).

    Session-scoped and shared: tests must not modify its files (copy it first).
    """
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


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


@pytest.fixture(scope="session")
def example_wasm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`example_wasm("vote")`: controllers/examples/vote.py built into a component, once per
    test session (a build takes about 10 s; compiling it is cached on disk afterwards)."""
    from aici_cli.control.build import build_controller

    out_dir = tmp_path_factory.mktemp("wasm")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_controller(EXAMPLES / f"{name}.py",
                                           out_dir / f"{name}.wasm").out
        return built[name]

    return get
