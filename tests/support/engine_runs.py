"""Running jobs through the engine in-process, for tests that read whole result lines."""

from __future__ import annotations

from typing import Any

from aici_cli.core.config import EngineConfig
from aici_cli.core.job import Job
from aici_cli.engine import Engine
from aici_cli.models import LoadedModel


def run(lm: LoadedModel, jobs: list[Job], **config: Any) -> dict[int, dict[str, Any]]:
    """The result lines of `jobs` by input index, under `EngineConfig(**config)`."""
    results: list[dict[str, Any]] = []
    Engine(lm, EngineConfig(**config)).run(jobs, results.append)
    return {r["index"]: r for r in results}


def output_ids(result: dict[str, Any]) -> list[int]:
    """The token ids a result generated, from its logprobs."""
    return [e["id"] for e in result["logprobs"]]
