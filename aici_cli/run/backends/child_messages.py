"""What the run and its engine process say to each other over their socket: small
picklable dataclasses, one per message (`multiprocessing.connection` framing).

Run to engine: `Start` (once, first), lists of `Job`s to run, `Admission` (the run's
`should_admit` as it changes), `EndOfInput`, and `ToolAnswered` per `ToolCall`. Engine to
run: load progress (`ProgressNote`, `ProgressSteps`, `ProgressAdvance`, `ProgressDone`),
then `Ready` or `LoadFailed`; after that `Started` as a line takes a row, `ToolCall` as a
controller calls a tool (`tool_relay.py`), `Finished` per result, `Drained` when the engine
has nothing more to do. A closed socket means the other side is gone.

Torch-free: the run imports this, the engine process too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aici_cli.control.guest_tools import ToolAnswer, ToolInfo
from aici_cli.core.config import RunConfig
from aici_cli.core.line_stats import StepTimes

# --------------------------------------------------------------------- run -> engine


@dataclass(frozen=True)
class Start:
    """The run's settings; `life` counts the engine processes of the run from 1; `tools`:
    those its controllers may call (None: none, every call refused in the engine's
    process, without a message)."""

    config: RunConfig
    life: int
    tools: tuple[ToolInfo, ...] | None = None


@dataclass(frozen=True)
class ToolAnswered:
    """The answer to the engine's `ToolCall` number `id`."""

    id: int
    answer: ToolAnswer


@dataclass(frozen=True)
class Admission:
    """Whether the engine may start the lines it holds (False: Ctrl-C, or `--ordered`
    holding its limit of results): the in-process engine's `should_admit`."""

    on: bool


@dataclass(frozen=True)
class EndOfInput:
    """No more lines come: the engine finishes those it holds, says `Drained`, exits."""


# --------------------------------------------------------------------- engine -> run


@dataclass(frozen=True)
class ProgressNote:
    message: str  # `LoadProgress.note`


@dataclass(frozen=True)
class ProgressSteps:
    total: int  # `LoadProgress.steps` begins: `total` steps of `description`
    description: str


@dataclass(frozen=True)
class ProgressAdvance:
    """One step of the current `ProgressSteps` done."""


@dataclass(frozen=True)
class ProgressDone:
    """The current `ProgressSteps` ended."""


@dataclass(frozen=True)
class Ready:
    """The model loaded. `info`: `model_name`, `quantize`, `meta` (the summary's model
    facts), `threads` (torch's), `compile` ("on"/"off": the decode step as built)."""

    info: dict[str, Any]


@dataclass(frozen=True)
class LoadFailed:
    """The model or controller cannot load: `kind` "usage" or "model" (the run raises
    `UsageError`/`ModelError` with `message`), or "internal" (a bug: the traceback went
    to stderr)."""

    kind: str
    message: str


@dataclass
class Figures:
    """The engine's figures since the last ones sent (a dead process's unsent ones are
    lost with it): step times, grammar compile and guest call ms; `compiled_steps` is
    this life's running total (None: no compiled step), `eager_steps` its one-token
    steps run eager, by why, so far."""

    steps: list[StepTimes] = field(default_factory=list)
    compile_ms: list[float] = field(default_factory=list)
    call_times: list[float] = field(default_factory=list)
    compiled_steps: int | None = None
    eager_steps: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Started:
    """Line `index` took a row: from now its death is charged to it (`supervised.py`)."""

    index: int


@dataclass(frozen=True)
class ToolCall:
    """A controller of line `index` calls tool `name` with `arguments` (JSON text), and
    waits for `ToolAnswered(id)`."""

    id: int
    index: int
    name: str
    arguments: str


@dataclass(frozen=True)
class Finished:
    result: dict[str, Any]
    figures: Figures


@dataclass(frozen=True)
class Drained:
    """The engine's run returned (input ended, or admission off and every started line
    done); the last figures."""

    figures: Figures
