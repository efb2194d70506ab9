"""The wasm host: runs controllers that are WebAssembly components, sandboxed by wasmtime.

A controller implements `aici:controller/controller@0.2.0` (`wit/controller.wit`, which
adds `fork` and `aici:storage`) or the first version, `@0.1.0`: one `runner` resource per
sequence, asked by `mid-process` what to do next. Either may import `aici:tools`, the run's
tools (linked only into a component that imports it). A component is loaded and checked once
(`ControllerComponent.load`), under the version it exports; each sequence (each branch of
a fork) gets its own `GuestInstance`, and a `WasmController` drives that instance for the
engine.

The modules, in the order a component meets them:
- `component_file`: reading the file (binary or text); `ComponentError`.
- `wasm_engine`: the process-wide wasmtime engine and its epoch ticker thread.
- `compile_cache`: compiling, through a cache of serialized components on disk.
- `signatures`: the contract's versions, imports and exports, checked at load.
- `component`: `ControllerComponent` (load, trial instantiation, instantiate).
- `host_functions`: the `tokenizer`, `host`, `storage` and `tools` imports, bound once per
  component.
- `host_calls`: `HostCalls`, what those imports ask of the calling instance (a protocol
  `instance` implements, so neither imports the other).
- `services`: what the tokenizer imports are served from (`HostServices`,
  `TokenizerServices`); the tools are `aici_cli.control.guest_tools`'s.
- `instance`: `GuestInstance`, one sequence's store, calls and deadlines, and its replay
  into a fork's new branch.
- `journal`: `LineCalls`, a guest's calls to its line's storage and the run's tools, and
  the `Journal` a replay answers them from.
- `quotas`: `GuestQuotas`, what a sequence may leave in its result line (logs, outputs)
  and the `tokens-matching` patterns it may ask for.
- `limits`: `GuestLimits`, the per-guest resource limits and why each one is there.
- `faults`: wasmtime errors classified into `ControllerError`s.
- `values`: wasmtime-py values converted to and from the host's action types.
- `frozen_types`: reflected types read once, which makes conversions ~5x faster.
- `controller`: `WasmController`, the engine's per-step contract on top of a guest.
"""

from aici_cli.control.wasm.component import ControllerComponent
from aici_cli.control.wasm.component_file import ComponentError
from aici_cli.control.wasm.controller import WasmController
from aici_cli.control.wasm.instance import GuestInstance
from aici_cli.control.wasm.limits import GuestLimits
from aici_cli.control.wasm.services import HostServices, TokenizerServices
from aici_cli.control.wasm.signatures import CONTROLLER_INTERFACE

__all__ = [
    "CONTROLLER_INTERFACE",
    "ComponentError",
    "ControllerComponent",
    "GuestInstance",
    "GuestLimits",
    "HostServices",
    "TokenizerServices",
    "WasmController",
]
