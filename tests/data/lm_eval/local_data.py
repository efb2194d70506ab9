"""Local datasets for the lm-eval tasks beside this file (no hub): each task's YAML names
one of these through `custom_dataset: !function local_data.NAME`, and each reads the JSONL
files beside it whatever the working directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _rows(name: str) -> list[dict[str, Any]]:
    with (HERE / name).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _splits(stem: str) -> Any:
    import datasets

    return datasets.DatasetDict({
        split: datasets.Dataset.from_list(_rows(f"{stem}.{split}.jsonl"))
        for split in ("train", "test")
    })


def capitals(**kwargs: Any) -> Any:
    """Multiple choice: a country's capital among four cities."""
    return _splits("capitals")


def yes_no(**kwargs: Any) -> Any:
    """Generation: a yes/no question answered under a constraint."""
    return _splits("yes_no")


def passages(**kwargs: Any) -> Any:
    """Perplexity: short passages scored whole (loglikelihood_rolling)."""
    return _splits("passages")
