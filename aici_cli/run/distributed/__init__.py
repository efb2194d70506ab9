"""The same run on a Ray cluster: one model and one `Engine` per actor, the same input
reading, output file, resume and per-line errors as a run in one process.

    placement  connect to Ray, start the workers (actors), wait until they are ready
    worker     `EngineWorker`: one model and one engine (`backends.build.build_engine`,
               as a local run builds its own), fed chunks of lines
    driver     `RayBackend`: hands out chunks with bounded in-flight work, passes each
               result to the run's sink, gives a dead worker's unfinished lines to others
    summary    `RunFigures`: what the driver gathers for the run summary, and the summary

Ray is an optional dependency (`pip install 'aici-batch[ray]'`): nothing imports it
unless a run asks for `--ray`, and this module itself is light (the CLI checks with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aici_cli.core.errors import UsageError

if TYPE_CHECKING:
    from aici_cli.core.config import RunConfig
    from aici_cli.run.distributed.driver import RayBackend

INSTALL_HINT = "--ray needs Ray, which is not installed: pip install 'aici-batch[ray]'"


def require_ray() -> None:
    """Raise a one-line `UsageError` that says how to install Ray where it is missing."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError(INSTALL_HINT) from None


def start_ray_backend(config: RunConfig) -> RayBackend:
    """Connect to Ray and start `config.ray.workers` workers, each with the model loaded."""
    require_ray()
    from aici_cli.run.distributed.driver import RayBackend

    return RayBackend.start(config)
