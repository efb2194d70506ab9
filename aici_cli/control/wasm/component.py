"""A controller component: loaded, compiled and checked once, instantiated per sequence."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import wasmtime
from wasmtime.component import Component, FuncType

from aici_cli.control.guest_tools import NO_TOOLS, GuestTools
from aici_cli.control.line_scope import LineScope
from aici_cli.control.wasm.compile_cache import compile_component, default_cache_dir
from aici_cli.control.wasm.component_file import ComponentError, read_wasm
from aici_cli.control.wasm.faults import is_trap, root_cause
from aici_cli.control.wasm.frozen_types import freeze
from aici_cli.control.wasm.host_functions import make_linker
from aici_cli.control.wasm.instance import GuestInstance
from aici_cli.control.wasm.limits import DEFAULT_GUEST_LIMITS, GuestLimits
from aici_cli.control.wasm.services import HostServices
from aici_cli.control.wasm.signatures import (
    CONSTRUCTOR,
    MID_PROCESS,
    STORAGE_INTERFACE,
    TOOLS_INTERFACE,
    Contract,
    check_exports,
    check_imports,
    find_contract,
    import_result_tagged,
    imports,
    step_field_tagged,
)
from aici_cli.control.wasm.values import Lowering
from aici_cli.control.wasm.wasm_engine import EpochTicker, SharedWasmEngine, shared_wasm_engine
from aici_cli.core.errors import ControllerError
from aici_cli.core.units import byte_size


class ControllerComponent:
    """A compiled, checked controller component; makes one `GuestInstance` per sequence.

    Thread-safe: instances of one component may run on different threads at once.
    `contract` is the version of `aici:controller` it exports; it runs under that one.
    """

    def __init__(
        self,
        path: Path,
        component: Component,
        shared: SharedWasmEngine,
        limits: GuestLimits,
        contract: Contract,
        lowering: Lowering,
        compile_ms: float,
        cache_hit: bool,
        cache_file: Path | None,
    ) -> None:
        self.path = path
        self.limits = limits
        self.contract = contract
        self.compile_ms = compile_ms  # compile or cache load, wall time
        self.cache_hit = cache_hit
        self.cache_file = cache_file
        self._component = component
        self._shared = shared
        self.lowering = lowering
        iface = component.get_export_index(contract.controller)
        self.ctor_index = component.get_export_index(CONSTRUCTOR, iface)
        self.mid_index = component.get_export_index(MID_PROCESS, iface)
        self._linker = make_linker(shared.wasm_engine, contract, lowering)
        self._types_lock = threading.Lock()
        self._mid_type: FuncType | None = None
        self._mid_type_failed = False

    # -- what a GuestInstance is made from (instance.GuestBlueprint) --

    @property
    def wasm_engine(self) -> wasmtime.Engine:
        return self._shared.wasm_engine

    @property
    def ticker(self) -> EpochTicker:
        return self._shared.ticker

    def link(self, store: wasmtime.Store) -> Any:
        """The component instantiated in `store`, its imports linked to the host."""
        return self._linker.instantiate(store, self._component)

    @classmethod
    def load(
        cls, path: str | Path, limits: GuestLimits = DEFAULT_GUEST_LIMITS,
        cache_dir: Path | None = None,
    ) -> ControllerComponent:
        """Reads, compiles (or loads from the compile cache) and checks a component.

        Raises ComponentError with a one-line message when the file is missing, is not a
        component, does not export the contract, or imports what the host does not give.
        Cold compile of an 18 MB componentize-py component: 6-18 s; cached: 20-40 ms.
        """
        path = Path(path)
        return cls.from_bytes(path, read_wasm(path), limits, cache_dir)

    @classmethod
    def from_bytes(
        cls, path: Path, wasm: bytes, limits: GuestLimits = DEFAULT_GUEST_LIMITS,
        cache_dir: Path | None = None,
    ) -> ControllerComponent:
        """`load` for a component's binary read elsewhere (by `read_wasm`; a Ray
        worker gets it through the object store); `path` names it in messages."""
        shared = shared_wasm_engine()
        t0 = time.perf_counter()
        try:
            component, hit, cache_file = compile_component(
                shared.wasm_engine,
                wasm,
                shared.fingerprint,
                cache_dir if cache_dir is not None else default_cache_dir(),
            )
        except wasmtime.WasmtimeError as e:
            raise ComponentError(
                f"{path} is not a valid WebAssembly component: {root_cause(str(e))}"
            ) from None
        compile_ms = (time.perf_counter() - t0) * 1000
        wasm_engine = shared.wasm_engine
        contract = find_contract(path, component, wasm_engine)
        check_imports(path, component, wasm_engine, contract)
        mid_ty = check_exports(path, component, wasm_engine, contract)
        lowering = Lowering(
            segment_text=step_field_tagged(mid_ty, "segment-text"),
            branch=contract.forks and step_field_tagged(mid_ty, "branch"),
            tokens_matching=import_result_tagged(component, wasm_engine, contract.tokenizer,
                                                 "tokens-matching"),
            storage_get=import_result_tagged(component, wasm_engine, STORAGE_INTERFACE, "get"),
            tools=imports(component, wasm_engine, TOOLS_INTERFACE),
            call_tool=import_result_tagged(component, wasm_engine, TOOLS_INTERFACE,
                                           "call-tool"),
        )
        self = cls(path, component, shared, limits, contract, lowering, compile_ms, hit,
                   cache_file)
        self._trial_instantiate()
        return self

    def interfaces(self) -> tuple[list[str], list[str]]:
        """The names the component exports and imports, sorted (what the OCI artifact's
        config lists)."""
        ty = self._component.type
        wasm_engine = self._shared.wasm_engine
        return sorted(ty.exports(wasm_engine)), sorted(ty.imports(wasm_engine))

    def instantiate(self, arg: str, prompt: list[int], services: HostServices,
                    line: LineScope | None = None,
                    tools: GuestTools = NO_TOOLS) -> GuestInstance:
        """A new guest for one sequence: new Store, instantiate, `runner(arg, prompt)`.
        `line`: what the line's sequences share (storage, line outputs; a fresh scope
        of its own when None); `tools`: what its `aici:tools` calls reach.

        Raises ControllerError (the store is dropped) when instantiation or the
        constructor fails: controller_trap / _timeout / _fuel / _memory / host_error.
        """
        guest = GuestInstance(self, services, line if line is not None else LineScope(),
                              tools)
        try:
            guest.construct(arg, list(prompt))
        except ControllerError:
            guest.close()
            raise
        return guest

    def memoize_mid_type(self, func: Any, store: wasmtime.Store) -> None:
        """Makes `func` use one frozen copy of mid-process's type (see `frozen_types`)."""
        with self._types_lock:
            if self._mid_type is None and not self._mid_type_failed:
                try:
                    self._mid_type = freeze(func.type(store))
                except Exception:  # another wasmtime-py layout: keep its slow, correct path
                    self._mid_type_failed = True
            fty = self._mid_type
        if fty is not None:
            # Func.__call__ asks `self.type(store)` on every call; an instance attribute
            # shadows the method. The type is store-independent (no resource identity is
            # used when converting own/borrow handles), so one copy serves every guest.
            func.__dict__["type"] = lambda _store: fty

    def _trial_instantiate(self) -> None:
        """Instantiates once at load so that link errors are a ComponentError, not N
        per-sequence failures. Traps here are ignored: they are per-sequence matters."""
        store = wasmtime.Store(self._shared.wasm_engine)
        store.set_limits(
            memory_size=self.limits.memory_bytes, table_elements=self.limits.table_elements
        )
        self._shared.ticker.enter()
        store.set_fuel(self.limits.fuel_per_call)
        store.set_epoch_deadline(max(1, self.limits.init_ms))
        try:
            self._linker.instantiate(store, self._component)
        except wasmtime.WasmtimeError as e:
            msg = str(e)
            if "exceeds memory limits" in msg:
                raise ComponentError(
                    f"{self.path} needs more memory at start than the "
                    f"{byte_size(self.limits.memory_bytes)} cap: {root_cause(msg)}"
                ) from None
            if "exceeds table limits" in msg:
                raise ComponentError(
                    f"{self.path} needs larger tables at start than the cap of "
                    f"{self.limits.table_elements:,} elements: {root_cause(msg)}"
                ) from None
            if not is_trap(msg):
                raise ComponentError(
                    f"{self.path} cannot be linked against this host: {root_cause(msg)}"
                ) from None
        finally:
            self._shared.ticker.leave()
