"""The cache folder's CI key (models/checks/cache_key.py): the same for a model's copy
anywhere, another for other weights, another CPU or another torch."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aici_cli.models.checks import cache_key


def test_the_key_follows_the_content_the_cpu_and_the_versions(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = cache_key.cache_key(str(tiny_model_dir))
    assert key.startswith("aici-batch-") and "-torch" in key
    copy = shutil.copytree(tiny_model_dir, tmp_path / "elsewhere")
    assert cache_key.cache_key(str(copy)) == key  # by content, not by path
    weights = next(p for p in copy.iterdir() if p.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")
    assert cache_key.cache_key(str(copy)) != key

    class OtherCpu:
        fingerprint = "Linux x86_64 Another CPU 0123456789ab"

    with monkeypatch.context() as patch:
        patch.setattr(cache_key, "cpu_features", lambda: OtherCpu())
        assert cache_key.cache_key(str(tiny_model_dir)) != key
    with monkeypatch.context() as patch:
        patch.setattr(cache_key, "_version", lambda name: "9.9")
        assert cache_key.cache_key(str(tiny_model_dir)) != key
    assert cache_key.cache_key(str(tiny_model_dir)) == key
