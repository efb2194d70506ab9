"""One sequence's guest: its own Store, instance and `runner` resource, its calls and quotas.

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
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any

import wasmtime
from wasmtime.component import ResourceAny

from aici_cli.control.actions import Action, StepInput
from aici_cli.control.wasm.faults import Fault, Overrun, classify, clip
from aici_cli.control.wasm.host_functions import current, to_u32
from aici_cli.control.wasm.limits import size_text
from aici_cli.control.wasm.services import HostServices
from aici_cli.control.wasm.values import split_result, step_record, to_action
from aici_cli.errors import ControllerError

if TYPE_CHECKING:
    from aici_cli.control.wasm.component import ControllerComponent


class GuestInstance:
    """One sequence's controller guest: its own Store, instance and `runner` resource.

    Not thread-safe by itself: one thread at a time per instance (different instances may
    run concurrently). Every failure is a ControllerError; after a trap the instance is
    dead.
    """

    def __init__(self, component: ControllerComponent, services: HostServices) -> None:
        self.services = services
        self.logs: list[str] = []  # host.log lines, in order (cut at Limits.log_bytes)
        self.outputs: dict[str, Any] = {}  # set-output values, JSON-parsed when they parse
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
        self._log_used = 0
        self._log_cut = False
        self._output_used = 0  # bytes of key + value text of the current outputs
        self._output_sizes: dict[str, int] = {}
        self._patterns: set[str] = set()  # distinct tokens-matching patterns asked for
        self._pending: ControllerError | None = None
        self._call_start = 0.0
        self._call_host_s = 0.0
        self._budget_ms = 0

    # -- public --

    def mid_process(self, inp: StepInput) -> Action:
        """Asks the guest what to do next; validates and converts its answer.

        Raises ControllerError: controller_error (the guest returned err), bad_action,
        controller_trap / _timeout / _fuel / _memory / host_error / too_many_outputs
        (the guest is dead afterwards), controller_dead (it already was).
        """
        step = step_record(inp, self._component._text_tagged)
        raw = self._call("mid-process", self._limits.call_ms, self._mid, self._resource, step)
        ok, value = split_result(raw)
        if not ok:
            raise ControllerError("controller_error", clip(str(value), self._limits.error_chars))
        return to_action(value, self._vocab, self.services)

    def close(self) -> None:
        """Drops the store (and with it the guest's memory). Idempotent."""
        self._resource = None
        self._mid = None
        self._store = None

    @property
    def dead(self) -> bool:
        return self.error is not None or self._store is None

    # -- internals --

    def _start(self, arg: str, prompt: list[int]) -> None:
        comp = self._component
        t0 = time.perf_counter()
        try:
            self._vocab = to_u32(self.services.vocab_size(), "vocab_size")
        except Exception as e:
            self.error = ControllerError(
                "host_error", f"host services failed: vocab_size: {type(e).__name__}: {e}"
            )
            raise self.error from None
        store = wasmtime.Store(comp._shared.engine)
        store.set_limits(
            memory_size=self._limits.memory_bytes, table_elements=self._limits.table_elements
        )
        self._store = store
        instance = self._call(
            "instantiation", self._limits.init_ms, comp._linker.instantiate, comp._component
        )
        ctor = instance.get_func(store, comp._ctor_index)
        self._mid = instance.get_func(store, comp._mid_index)
        comp._memoize_mid_type(self._mid, store)
        self.setup_ms = (time.perf_counter() - t0) * 1000
        self._resource = self._call("constructor", self._limits.init_ms, ctor, arg, prompt)

    def _call(self, phase: str, budget_ms: int, fn: Any, *args: Any) -> Any:
        """Enters wasm with fresh fuel and deadline; maps every failure to ControllerError."""
        store = self._enterable()
        if phase == "mid-process":
            self.calls += 1
        ticker = self._component._shared.ticker
        self._budget_ms = budget_ms
        self._pending = None
        self._call_host_s = 0.0
        current.guest = self
        ticker.enter()  # before the deadline is set (see EpochTicker.enter)
        t0 = self._call_start = time.perf_counter()
        try:
            store.set_fuel(self._limits.fuel_per_call)
            store.set_epoch_deadline(max(1, budget_ms))
            result = fn(store, *args)
            self._check_overrun(phase, budget_ms, t0)
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

    def _check_overrun(self, phase: str, budget_ms: int, t0: float) -> None:
        """The epoch stops wasm code only: converting a huge answer runs unchecked."""
        spent_ms = (time.perf_counter() - t0 - self._call_host_s) * 1000
        if spent_ms > 2 * budget_ms:
            raise Overrun(
                ControllerError(
                    "controller_timeout",
                    f"{phase} exceeded its {budget_ms} ms deadline: it took "
                    f"{spent_ms:.0f} ms, most of it converting values between host and "
                    "guest (about 1 us per list element; keep answers small)",
                )
            )

    def _host_returned(self, host_s: float) -> None:
        """Re-arms the deadline so that host time is not charged to the guest."""
        self._call_host_s += host_s
        store = self._store
        if store is None:
            return
        guest_ms = (time.perf_counter() - self._call_start - self._call_host_s) * 1000
        store.set_epoch_deadline(max(1, math.ceil(self._budget_ms - guest_ms)))

    # -- quotas: what a guest may leave in its result line --

    def _log(self, message: str) -> None:
        """Keeps lines up to `log_bytes` (each line counts its newline, so floods of empty
        lines are bounded too); the line that crosses the cap keeps its head."""
        if self._log_cut:
            return
        data = message.encode("utf-8", "replace")
        room = self._limits.log_bytes - self._log_used
        if len(data) + 1 > room:
            self._log_cut = True
            if room > 1:
                self.logs.append(data[: room - 1].decode("utf-8", "ignore"))
            self.logs.append(f"[logs truncated: more than {self._limits.log_bytes} bytes]")
            return
        self._log_used += len(data) + 1
        self.logs.append(message)

    def _set_output(self, key: str, value: str) -> None:
        limits = self._limits
        if key not in self.outputs and len(self.outputs) >= limits.max_outputs:
            raise Fault(
                ControllerError(
                    "too_many_outputs",
                    f"set-output {clip(key, 100)!r}: more than {limits.max_outputs} outputs "
                    "per sequence",
                )
            )
        size = len(key.encode("utf-8", "replace")) + len(value.encode("utf-8", "replace"))
        used = self._output_used - self._output_sizes.get(key, 0) + size
        if used > limits.output_bytes:
            raise Fault(
                ControllerError(
                    "outputs_too_large",
                    f"set-output {clip(key, 100)!r}: the outputs would take {used:,} bytes "
                    f"of key and value text, more than the {size_text(limits.output_bytes)} "
                    "allowed per sequence",
                )
            )
        self._output_used = used
        self._output_sizes[key] = size
        try:
            self.outputs[key] = json.loads(value)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            self.outputs[key] = value

    def _count_pattern(self, pattern: str) -> None:
        """Raises ValueError (the guest's `err`) past the per-sequence pattern caps."""
        limits = self._limits
        if len(pattern) > limits.pattern_chars:
            raise ValueError(
                f"pattern of {len(pattern):,} characters; at most {limits.pattern_chars:,} "
                "are allowed"
            )
        if pattern not in self._patterns:
            if len(self._patterns) >= limits.max_patterns:
                raise ValueError(
                    f"more than {limits.max_patterns} distinct patterns per sequence "
                    "(each one scans the vocabulary); reuse the handles you have"
                )
            self._patterns.add(pattern)
