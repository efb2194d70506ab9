"""One sequence's guest: its own Store, instance and `runner` resource, its calls and
deadlines, and its replay into a fork's new branch (what it may leave in its result line
is `quotas.py`'s; its calls to the line's storage and the run's tools, and their journal,
are `journal.py`'s).

Isolation: one `Store` per sequence. A trap poisons a store for good ("cannot enter
component instance"), so one failing controller ends only its own sequence; a dead guest
answers `controller_dead` without entering wasm again. A store plus instantiation costs
0.05 ms for a WAT guest, 0.9 ms for a componentize-py guest (whose constructor adds
~1.3 ms).

Deadlines: each call gets fresh fuel and an epoch deadline, re-armed whenever a host
function returns so that host time is not charged to the guest. wasmtime interrupts wasm
code only, while wasmtime-py converts values element by element in Python, about 1 us
per list element (wasmtime itself refuses to copy a list of 4 Mi u32 out of a guest;
2 Mi pass, costing ~2 s and ~170 MB for a moment). A call that took more than twice its
deadline, host functions excluded, ends with `controller_timeout` even though it
returned, so a guest that answers every step with a huge list ends at its first such
answer instead of slowing the batch at every step.

A trivial `mid-process` costs 60-90 us p50 (2-core CPU, wasmtime 50; it was 300-500 us
before `frozen_types` stopped wasmtime-py from re-reading the function's type through FFI
on every call). An 8192-word `list<u32>` costs about 4.5 ms to cross, which is why
vocabulary-sized sets stay on the host behind `tokens-matching` handles.

Forks (contract 0.2.0): wasmtime cannot copy a store, so a new branch's guest is a new
instance brought to the forking guest's state by replay: the host journals a guest's
constructor arguments, every `mid-process` input with the action it got back, and every
storage and tool call with its answer; `replica` constructs a new instance and calls it
with the same inputs, answering its storage and tool calls from the journal and dropping
its writes (they were made once already; a tool is not called again). The sandbox gives
a guest no clock, randomness or other input, so it answers alike; a replay that answers
otherwise ends the line with `controller_nondeterministic`. Its own logs and outputs are
re-recorded along the way, so a branch starts with the ones made before the fork. Cost:
one instantiation and constructor, plus one call per journaled call.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import wasmtime
from wasmtime.component import ResourceAny

from aici_cli.control.actions import Action, StepInput
from aici_cli.control.guest_tools import NO_TOOLS, GuestTools
from aici_cli.control.line_scope import LineScope
from aici_cli.control.wasm.faults import Overrun, classify, clip
from aici_cli.control.wasm.host_calls import HostCalls, current, to_u32
from aici_cli.control.wasm.journal import DETERMINISM, Journal, LineCalls
from aici_cli.control.wasm.quotas import GuestQuotas
from aici_cli.control.wasm.services import HostServices
from aici_cli.control.wasm.values import split_result, step_record, to_action
from aici_cli.core.errors import ControllerError

if TYPE_CHECKING:
    from aici_cli.control.wasm.limits import GuestLimits
    from aici_cli.control.wasm.signatures import Contract
    from aici_cli.control.wasm.values import Lowering
    from aici_cli.control.wasm.wasm_engine import EpochTicker


class GuestBlueprint(Protocol):
    """What a guest instance is made from: a compiled, checked component
    (`component.ControllerComponent`) and the host it links to."""

    limits: GuestLimits
    contract: Contract
    lowering: Lowering
    ctor_index: Any  # the runner's constructor and mid-process, as export indices
    mid_index: Any

    @property
    def wasm_engine(self) -> wasmtime.Engine: ...

    @property
    def ticker(self) -> EpochTicker: ...

    def link(self, store: wasmtime.Store) -> Any: ...

    def memoize_mid_type(self, func: Any, store: wasmtime.Store) -> None: ...


class GuestInstance(LineCalls):
    """One sequence's controller guest: its own Store, instance and `runner` resource.

    Not thread-safe by itself: one thread at a time per instance (different instances may
    run concurrently). Every failure is a ControllerError; after a trap the instance is
    dead.
    """

    def __init__(self, component: GuestBlueprint, services: HostServices,
                 scope: LineScope, tools: GuestTools = NO_TOOLS) -> None:
        self.services = services
        self.scope = scope  # storage and outputs shared with the line's other sequences
        self.tools = tools  # what its aici:tools calls reach
        self.tool_calls = 0
        self.quotas = GuestQuotas(component.limits)  # its logs, outputs and patterns
        self.guest_ms = 0.0  # wall time inside constructor + mid-process calls
        self.host_ms = 0.0  # of which inside host functions
        self.setup_ms = 0.0  # Store + instantiation
        self.calls = 0  # mid-process calls made
        self.error: ControllerError | None = None  # what killed the guest, if anything
        self._component = component
        self._limits = component.limits
        self._store: wasmtime.Store | None = None
        self._resource: ResourceAny | None = None
        self._mid: Any = None
        self._vocab = 0
        self._pending: ControllerError | None = None
        self._call_host_s = 0.0
        self._call_cpu_start = 0.0  # this thread's CPU clock at the call's start
        self._call_host_cpu_s = 0.0
        self._budget_ms = 0
        self._arg = ""
        self._prompt: list[int] = []
        # Kept only where a guest can fork (contract 0.2.0).
        self.journal: Journal | None = Journal() if component.contract.forks else None
        self._replay: Iterator[tuple[str, str, Any]] | None = None  # while replaying

    # -- public --

    def mid_process(self, inp: StepInput) -> Action:
        """Asks the guest what to do next; validates and converts its answer.

        Raises ControllerError: controller_error (the guest returned err), bad_action,
        controller_trap / _timeout / _fuel / _memory / host_error / too_many_outputs
        (the guest is dead afterwards), controller_dead (it already was).
        """
        lowering = self._component.lowering
        step = step_record(inp, lowering.segment_text,
                           lowering.branch if self._component.contract.forks else None)
        raw = self._call("mid-process", self._limits.call_ms, self._mid, self._resource, step)
        ok, value = split_result(raw)
        if not ok:
            raise ControllerError("controller_error", clip(str(value), self._limits.error_chars))
        action = to_action(value, self._vocab, self.services)
        if self.journal is not None:
            self.journal.inputs.append(inp)
            self.journal.actions.append(action)
        return action

    def replica(self) -> GuestInstance:
        """A new instance in this one's state, by replaying its journal (see the module
        doc), sharing its line. Raises ControllerError: what the new instance's calls
        raise, or controller_nondeterministic when it answers otherwise."""
        journal = self.journal
        assert journal is not None, "only a 0.2.0 guest can fork"
        guest = GuestInstance(self._component, self.services, self.scope, self.tools)
        guest.journal = None  # a replayed call is journaled already
        guest._replay = iter(journal.calls)
        try:
            guest.construct(self._arg, self._prompt)
            for i, (inp, expected) in enumerate(zip(journal.inputs, journal.actions)):
                got = guest.mid_process(inp)
                if got != expected:
                    raise ControllerError(
                        "controller_nondeterministic",
                        f"a new branch's guest, replaying the {len(journal.inputs)} calls "
                        f"before the fork, answered call {i + 1} with "
                        f"{clip(repr(got), 200)} where the forking guest had answered "
                        f"{clip(repr(expected), 200)}: {DETERMINISM}",
                    )
            if next(guest._replay, None) is not None:
                raise ControllerError(
                    "controller_nondeterministic",
                    f"a new branch's guest made fewer storage or tool calls than the "
                    f"forking guest while replaying the calls before the fork: {DETERMINISM}",
                )
        except ControllerError:
            guest.close()
            raise
        guest._replay = None
        guest.journal = journal.copy()
        return guest

    def close(self) -> None:
        """Drops the store (and with it the guest's memory). Idempotent."""
        self._resource = None
        self._mid = None
        self._store = None

    @property
    def dead(self) -> bool:
        return self.error is not None or self._store is None

    @property
    def logs(self) -> list[str]:
        """host.log lines, in order (cut at `GuestLimits.log_bytes`)."""
        return self.quotas.logs

    @property
    def outputs(self) -> dict[str, Any]:
        """set-output values, JSON-parsed when they parse."""
        return self.quotas.outputs

    # -- internals --

    def construct(self, arg: str, prompt: list[int]) -> None:
        """Instantiate the component in a new store and run the runner's constructor."""
        comp = self._component
        self._arg, self._prompt = arg, prompt
        t0 = time.perf_counter()
        try:
            self._vocab = to_u32(self.services.vocab_size(), "vocab_size")
        except Exception as e:
            self.error = ControllerError(
                "host_error", f"host services failed: vocab_size: {type(e).__name__}: {e}"
            )
            raise self.error from None
        store = wasmtime.Store(comp.wasm_engine)
        store.set_limits(
            memory_size=self._limits.memory_bytes, table_elements=self._limits.table_elements
        )
        self._store = store
        instance = self._call(
            "instantiation", self._limits.init_ms, comp.link
        )
        ctor = instance.get_func(store, comp.ctor_index)
        self._mid = instance.get_func(store, comp.mid_index)
        comp.memoize_mid_type(self._mid, store)
        self.setup_ms = (time.perf_counter() - t0) * 1000
        self._resource = self._call("constructor", self._limits.init_ms, ctor, arg, prompt)

    def _call(self, phase: str, budget_ms: int, fn: Any, *args: Any) -> Any:
        """Enters wasm with fresh fuel and deadline; maps every failure to ControllerError.

        The deadline counts this thread's CPU time, host functions excluded (see
        `EpochTicker`). Python's cyclic collector is held off for the call: a collection
        of a large host heap (hundreds of ms in a process holding a model) would
        otherwise run inside the call, at an allocation made while converting values,
        and be charged to the guest. It runs at the host's next allocation after."""
        store = self._enterable()
        if phase == "mid-process":
            self.calls += 1
        ticker = self._component.ticker
        self._budget_ms = budget_ms
        self._pending = None
        self._call_host_s = self._call_host_cpu_s = 0.0
        guest: HostCalls = self  # mypy checks here that an instance serves the host calls
        current.guest = guest
        collecting = gc.isenabled()
        gc.disable()
        ticker.enter()  # before the deadline is set (see EpochTicker.enter)
        t0 = time.perf_counter()
        self._call_cpu_start = time.thread_time()
        try:
            store.set_fuel(self._limits.fuel_per_call)
            store.set_epoch_deadline(max(1, budget_ms))
            result = fn(store, *args)
            self._check_overrun(phase, budget_ms)
            return result
        except Overrun as e:
            self.error = e.error
            self.close()
            raise self.error from None
        except wasmtime.WasmtimeError as e:
            self.error = self._pending or classify(str(e), phase, budget_ms, self._limits)
            self.close()
            raise self.error from None
        except Exception as e:  # a wasmtime-py conversion error: contained like a trap
            self.error = self._pending or ControllerError(
                "host_error", f"{phase} failed in the host: {type(e).__name__}: {e}"
            )
            self.close()
            raise self.error from None
        finally:
            ticker.leave()
            if collecting:
                gc.enable()
            current.guest = None
            dt = time.perf_counter() - t0
            if phase != "instantiation":
                self.guest_ms += dt * 1000
                self.host_ms += self._call_host_s * 1000

    def _enterable(self) -> wasmtime.Store:
        """The store to call into; controller_dead when the guest failed or was closed."""
        if self.error is not None:
            raise ControllerError(
                "controller_dead",
                f"the controller already failed ({self.error.type}: {self.error.message})",
            )
        if self._store is None:
            raise ControllerError("controller_dead", "the runner is closed")
        return self._store

    def _check_overrun(self, phase: str, budget_ms: int) -> None:
        """The epoch stops wasm code only: converting a huge answer runs unchecked."""
        spent_ms = self._guest_cpu_ms()
        if spent_ms > 2 * budget_ms:
            raise Overrun(
                ControllerError(
                    "controller_timeout",
                    f"{phase} exceeded its {budget_ms} ms deadline: it took "
                    f"{spent_ms:.0f} ms, most of it converting values between host and "
                    "guest (about 1 us per list element; keep answers small)",
                )
            )

    # -- host calls: the `host_calls.HostCalls` protocol the host functions call --

    def vocab_size(self) -> int:
        return self._vocab

    def host_failed(self, error: ControllerError) -> None:
        """The call in progress ends with `error` (reported instead of wasmtime's trap)."""
        self._pending = error

    def host_returned(self, host_s: float, host_cpu_s: float) -> None:
        """Re-arms the deadline so that host time is not charged to the guest."""
        self._call_host_s += host_s
        self._call_host_cpu_s += host_cpu_s
        store = self._store
        if store is None:
            return
        remaining_ms = self._budget_ms - self._guest_cpu_ms()
        store.set_epoch_deadline(max(1, math.ceil(remaining_ms)))

    def _guest_cpu_ms(self) -> float:
        """This thread's CPU time in the call so far, host functions excluded."""
        return (time.thread_time() - self._call_cpu_start - self._call_host_cpu_s) * 1000

    # -- quotas: what a guest may leave in its result line (`quotas.py`) --

    def log(self, message: str) -> None:
        self.quotas.log(message)

    def set_output(self, key: str, value: str) -> None:
        self.quotas.set_output(key, value)

    def count_pattern(self, pattern: str) -> None:
        self.quotas.count_pattern(pattern)
