"""`Backend`: what a run asks of wherever its lines decode.

Three implement it: an engine in a child process (`aici_cli.run.backends.supervised.
SupervisedEngine`), one in this process (`aici_cli.run.backends.local.LocalEngine`) and Ray
workers (`aici_cli.run.distributed.driver.RayBackend`). The run (`run.batch.run_batch`) reads the
input, writes each result and makes the summary; a backend only turns items into emitted
results and says what its engines measured. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from aici_cli.core.config import RunConfig
    from aici_cli.core.job import BadLine, Job
    from aici_cli.engine import Emit
    from aici_cli.run.live_input import LiveInput
    from aici_cli.run.tally import RunTally


class Backend(Protocol):
    """Where the lines run. Started before the output is touched, so that a model or
    controller that cannot load leaves it as it was."""

    model_name: str
    quantize: str  # what the model runs at (`none`: its own dtype), once it has loaded
    dtype: str  # the activations' dtype it runs in ("float32", "bfloat16", ...)

    def run(self, items: Iterator[Job | BadLine], emit: Emit,
            should_admit: Callable[[], bool], note: Callable[[str], None],
            live: LiveInput[Job | BadLine] | None = None) -> None:
        """Every item to exactly one `emit`ted result, as `Engine.run` does; returns when
        all are done, or when `should_admit()` turned False and the lines in flight are.
        `live` (None: the input never waits on its producer) is an idle reader thread
        for `items`: a backend that decodes in this process reads through it, so that its
        running lines never wait for the next line; one whose lines decode elsewhere may
        read in place."""

    def in_flight(self) -> int:
        """Lines started and not yet finished."""
        ...

    def summary(self, config: RunConfig, tally: RunTally, wall: float) -> dict[str, Any]:
        """The run summary (`--stats-out`, `schemas/stats.schema.json`)."""
        ...

    def close(self) -> None: ...
