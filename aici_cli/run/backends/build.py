"""`build_engine`: one loaded model, its `Engine`, and the `--controller` factory.

The one way an engine is built for a run, in this process (`local.LocalEngine`) and on
each Ray worker (`aici_cli.run.distributed.worker.EngineWorker`), so both run the same model
the same way with the same controller. It uses only the engine's public surface
(`Engine(lm, config)`, `set_controller_factory`, `lm`, `compiler`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aici_cli.core.config import RunConfig, load_quantize
from aici_cli.core.errors import UsageError
from aici_cli.core.job import Job
from aici_cli.engine import ControllerFactory, Engine
from aici_cli.models.load import LoadedModel, load_model

if TYPE_CHECKING:
    from aici_cli.control.guest_tools import LineTools
    from aici_cli.control.wasm import ControllerComponent, WasmController


@dataclass
class BuiltEngine:
    """An engine ready to run, and what building it measured."""

    engine: Engine
    load_started: float  # perf_counter when the model began to load
    load_ended: float  # and when it and its engine were ready (before the controller)
    component: ControllerComponent | None = None  # the --controller, compiled
    call_times: list[float] = field(default_factory=list)  # ms of every wasm guest call

    @property
    def lm(self) -> LoadedModel:
        return self.engine.lm

    @property
    def load_s(self) -> float:
        """The model's load and the engine's construction, without the controller's."""
        return self.load_ended - self.load_started


def build_engine(config: RunConfig, wasm: bytes | None = None,
                 tools: LineTools | None = None) -> BuiltEngine:
    """Load `config`'s model, build its `Engine`, and give every line a runner of the
    `--controller` component if there is one: read from its file, or from `wasm`, its
    bytes read elsewhere (a Ray worker gets them through the object store, so its node
    needs no copy of the file); `tools`: what a line's guests' tool calls reach (none
    allowed when None). Raises `ModelError`/`UsageError` as a run reports them.
    Thread counts are the caller's: a process sets them before torch starts its pool."""
    started = time.perf_counter()
    lm = load_model(config.model, config.device, config.dtype, load_quantize(config),
                    config.model_impl)
    built = BuiltEngine(Engine(lm, config.engine), started, time.perf_counter())
    if config.controller is not None:
        built.component = load_controller(config, wasm)
        built.engine.set_controller_factory(
            wasm_factory(config, built.engine, built.call_times, built.component, tools))
    return built


def load_controller(config: RunConfig, wasm: bytes | None = None) -> ControllerComponent:
    """The `--controller` component, compiled or loaded from the compile cache (on the
    node's disk, locked while one process compiles: once per node). From its file
    (an `oci://` one pinned and pulled, see `run/controller_pin.py`), or from `wasm`."""
    from aici_cli.control.registry.operations import controller_file
    from aici_cli.control.wasm import ComponentError, ControllerComponent, GuestLimits

    assert config.controller is not None
    limits = GuestLimits(call_ms=config.controller_call_ms)
    path = controller_file(config.controller) if wasm is None else Path(config.controller)
    try:
        if wasm is None:
            return ControllerComponent.load(path, limits)
        return ControllerComponent.from_bytes(path, wasm, limits)
    except ComponentError as e:  # an oci:// one is named by its reference, not its cache file
        raise UsageError(str(e).replace(str(path), config.controller)) from None


def wasm_factory(config: RunConfig, engine: Engine, call_times: list[float],
                 component: ControllerComponent,
                 tools: LineTools | None = None) -> ControllerFactory:
    """A factory giving every job its own runner of the `--controller` component, its
    tool calls reaching `tools` of its line; each guest call's ms is appended to
    `call_times`."""
    from aici_cli.control.guest_tools import NO_TOOLS
    from aici_cli.control.wasm import TokenizerServices, WasmController
    from aici_cli.core.errors import ControllerError

    lm = engine.lm
    services = TokenizerServices(
        lm.tokenizer, lm.vocab_size, min(lm.eos_token_ids), engine.compiler.tokenizer
    )

    def factory(job: Job) -> WasmController:
        if job.constraint is not None and job.constraint != config.defaults.constraint:
            raise ControllerError(
                "invalid_line", "a line's json_schema/regex/choices/grammar cannot be combined "
                "with --controller; the controller decides the constraints",
            )
        arg = job.extra.get("controller_arg", config.controller_arg)
        if not isinstance(arg, str):
            arg = json.dumps(arg)
        return WasmController(component, arg, services, engine.compiler,
                              config.engine.fast_forward, call_times,
                              tools(job.index) if tools is not None else NO_TOOLS)

    return factory


def model_meta(lm: Any) -> dict[str, Any]:
    """What the summary says of the model a run used (with the modes the kernel probe
    turned down for it, where it did)."""
    meta: dict[str, Any] = {"model": lm.name, "device": str(lm.device),
                            "dtype": str(lm.dtype).removeprefix("torch."),
                            "quantize": getattr(lm, "quantize", "none")}
    kernels = getattr(lm, "kernels", None)
    if kernels is not None and kernels.rejected:
        meta["kernel_probe"] = {"rejected": [list(r) for r in kernels.rejected]}
    return meta
