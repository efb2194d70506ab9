"""The wasm host: runs controllers that are WebAssembly components, sandboxed by wasmtime.

A controller implements `aici:controller/controller@0.1.0` (`wit/controller.wit`): one
`runner` resource per sequence, asked by `mid-process` what to do next. This module loads
and checks a component once (`ControllerComponent.load`), then gives each sequence its
own `Runner`, converting wasmtime's values to the dataclasses of `actions.py` at the
boundary so the rest of the host never sees `Record`/`Variant`.

Isolation and limits (why each piece is there):
- One `Store` per sequence. A trap poisons a store for good ("cannot enter component
  instance"), so one failing controller ends only its own sequence; a dead runner answers
  `controller_dead` without entering wasm again. A store plus instantiation costs about
  0.6-1 ms.
- Per call: fuel (`Limits.fuel_per_call`, a deterministic CPU bound) and an epoch deadline
  (`Limits.call_ms`, wall clock). One process-wide engine runs one daemon thread that
  advances the epoch once per millisecond, and only while some guest call is running, so
  an idle process stays quiet. Time spent inside host functions (for example a first
  `tokens-matching` over a 262k vocabulary) is not charged to the guest's deadline.
- Per store: a memory cap (`Limits.memory_bytes`). wasmtime makes `memory.grow` fail
  (return -1) at the cap rather than trap, and the guest then usually aborts; the host
  reports `controller_memory` when it can tell (an allocator-failure frame such as
  `handle_alloc_error` in the backtrace, or a cap too small to instantiate), and
  `controller_trap` otherwise. A componentize-py guest turns MemoryError into an uncaught
  exception, whose traceback needs the stubbed-out WASI: that one reads as a trap.
- Per store: a table cap (`Limits.table_elements`). Tables live in host memory outside
  the linear-memory cap, and `table.grow` can otherwise claim ~2 GB a second.
- What a guest leaves in its result line is capped, so a chatty or hostile guest cannot
  grow the process or a result line without bound: logs (`Limits.log_bytes`, cut with a
  note: they are for people, and the head is what explains a failure), outputs
  (`Limits.max_outputs` keys and `Limits.output_bytes` of key and value text, a precise
  error instead: outputs are data a program reads, and silently cut data would be worse
  than none), and the text of a guest `err` (`Limits.error_chars`, cut with a note).
  Each `tokens-matching` pattern costs a vocabulary scan and a cached bitmask, so a
  sequence may ask for `Limits.max_patterns` distinct ones of at most
  `Limits.pattern_chars` characters; past that the guest gets `err`.
- wasmtime interrupts wasm code only, while wasmtime-py converts values element by
  element in Python, about 1 us per list element (wasmtime itself refuses to copy a list
  of 4 Mi u32 out of a guest; 2 Mi pass, costing ~2 s and ~170 MB for a moment). A call
  that took more than twice its deadline, host functions excluded, ends with
  `controller_timeout` even though it returned, so a guest that answers every step with
  a huge list ends at its first such answer instead of slowing the batch at every step.
- Host functions never let a Python exception reach wasmtime-py: it parks those in a
  process-global slot and re-raises them from whichever call looks next, which is a race
  between threads. They record the failure on the runner and trap the guest instead.

Costs measured here (2-core CPU, shared and busy, wasmtime 50): compiling an 18 MB
componentize-py component 6-18 s (`Component.serialize` output: 40 MB), loading it from
the compile cache 20-40 ms. Per runner: Store + instantiate 0.05 ms for a WAT guest, 0.9 ms
for a Python guest, whose constructor adds ~1.3 ms. A trivial `mid-process` 60-90 us p50
(it was 300-500 us before `_freeze` stopped wasmtime-py from re-reading the function's type
through FFI on every call). Values cross the boundary element by element (an 8192-word
`list<u32>` about 4.5 ms), which is why vocabulary-sized sets stay on the host behind
`tokens-matching` handles.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import wasmtime
from wasmtime.component import (
    BorrowType,
    Component,
    ComponentInstanceType,
    EnumType,
    FlagsType,
    FuncType,
    Linker,
    ListType,
    OptionType,
    OwnType,
    Record,
    RecordType,
    ResourceAny,
    ResultType,
    TupleType,
    Variant,
    VariantType,
)

from aici_cli.control.actions import (
    Action,
    Generate,
    Grammar,
    GrammarKind,
    Sample,
    Segment,
    Splice,
    StepInput,
    Stop,
    TokenSet,
    TokenSetKind,
)
from aici_cli.errors import ControllerError

__all__ = [
    "CONTROLLER_INTERFACE",
    "ComponentError",
    "ControllerComponent",
    "HostServices",
    "Limits",
    "Runner",
]

CONTROLLER_INTERFACE = "aici:controller/controller@0.1.0"
TYPES_INTERFACE = "aici:controller/types@0.1.0"
TOKENIZER_INTERFACE = "aici:controller/tokenizer@0.1.0"
HOST_INTERFACE = "aici:controller/host@0.1.0"
_CONSTRUCTOR = "[constructor]runner"
_MID_PROCESS = "[method]runner.mid-process"

# The interfaces this host provides to guests (types carries only types).
_PROVIDED = (TYPES_INTERFACE, TOKENIZER_INTERFACE, HOST_INTERFACE)

_U32_MAX = 0xFFFF_FFFF


class ComponentError(Exception):
    """A controller component cannot be used at all (usage level: the CLI exits 2).

    The message is one line that names the file and says how to fix the problem.
    """


@dataclass(frozen=True)
class Limits:
    """Per-runner resource limits: wasmtime enforces the first five, the host the rest."""

    call_ms: int = 50  # wall-clock deadline per mid-process call (epoch interruption)
    init_ms: int = 2000  # deadline for instantiation and the constructor (Python is slow)
    fuel_per_call: int = 2_000_000_000  # CPU bound per call (Config.consume_fuel)
    memory_bytes: int = 256 << 20  # cap per linear memory (a Python guest needs ~12.3 MiB)
    table_elements: int = 1 << 20  # cap per table (a Python guest starts with ~5,700)
    log_bytes: int = 64 << 10  # per-sequence log text (+1 per line); beyond it: cut, a note
    max_outputs: int = 256  # per-sequence distinct output keys; beyond: too_many_outputs
    output_bytes: int = 1 << 20  # per-sequence key + value text; beyond: outputs_too_large
    error_chars: int = 4096  # a guest err's text is cut to this, with a note
    max_patterns: int = 32  # distinct tokens-matching patterns per sequence; beyond: err
    pattern_chars: int = 16 << 10  # longest tokens-matching pattern; longer: err


class HostServices(Protocol):
    """What the guest's `tokenizer` imports are served from (the model's tokenizer).

    Called from the thread that calls the runner, while the guest waits. Exceptions are
    contained: `tokens_matching`'s ValueError becomes the guest-visible `err(message)`;
    any other exception ends the runner with a `host_error` ControllerError.
    """

    def vocab_size(self) -> int: ...
    def eos_token(self) -> int: ...
    def tokenize(self, text: str) -> list[int]: ...
    def decode(self, tokens: list[int]) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...
    def tokens_matching(self, pattern: str) -> int: ...  # ValueError on a bad pattern
    def has_host_set(self, handle: int) -> bool: ...


# --- engine, epoch ticker, compile cache ------------------------------------------------


class _EpochTicker:
    """Advances an engine's epoch once per elapsed millisecond while guest calls run.

    A deadline of N ticks is then about N ms. The tick count follows the monotonic clock
    (not the number of sleeps, which overshoot by ~0.1-0.3 ms each), and the thread
    blocks while no call is active so that it does not compete for the GIL with the
    decode loop. Daemon: it never keeps the process alive.
    """

    def __init__(self, engine: wasmtime.Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()  # guards _active, _resume and the increments
        self._active = 0
        self._resume = time.monotonic()  # when _active last went from 0 to 1
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aici-wasm-epoch", daemon=True)
        self._thread.start()

    def enter(self) -> None:
        """Call before setting a deadline: ticks from before it never count against it."""
        with self._lock:
            if not self._thread.is_alive():  # a forked child inherits no threads
                self._thread = threading.Thread(
                    target=self._run, name="aici-wasm-epoch", daemon=True
                )
                self._thread.start()
            if self._active == 0:
                self._resume = time.monotonic()
            self._active += 1
            self._wake.set()

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._wake.clear()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            self._wake.wait()
            time.sleep(0.001)
            with self._lock:
                if self._active == 0:
                    continue  # went idle meanwhile: idle time is nobody's deadline
                last = max(last, self._resume)
                elapsed = int((time.monotonic() - last) * 1000)
                for _ in range(elapsed):
                    self._engine.increment_epoch()
                last += elapsed / 1000


@dataclass(frozen=True)
class _SharedEngine:
    engine: wasmtime.Engine
    ticker: _EpochTicker
    fingerprint: str  # everything besides the wasm bytes that a compiled artifact depends on


_engine_lock = threading.Lock()
_shared: _SharedEngine | None = None


def _shared_engine() -> _SharedEngine:
    """The process-wide engine (fuel + epochs on) and its ticker, created once.

    Engines are thread-safe and compiled components are tied to the engine's config, so
    one engine for every component keeps one ticker thread and one cache key space.
    """
    global _shared
    with _engine_lock:
        if _shared is None:
            config = wasmtime.Config()
            config.consume_fuel = True
            config.epoch_interruption = True
            engine = wasmtime.Engine(config)
            fingerprint = (
                f"wasmtime={_wasmtime_version()};fuel=1;epoch=1;"
                f"arch={platform.machine()};os={platform.system()}"
            )
            _shared = _SharedEngine(engine, _EpochTicker(engine), fingerprint)
        return _shared


def _wasmtime_version() -> str:
    try:
        from importlib.metadata import version

        return version("wasmtime")
    except Exception:  # metadata missing (vendored install): the artifact check still guards
        return "unknown"


def _default_cache_dir() -> Path:
    from aici_cli.models import cache_dir

    return cache_dir()


def _compile(
    engine: wasmtime.Engine, wasm: bytes, fingerprint: str, cache_dir: Path
) -> tuple[Component, bool, Path | None]:
    """Compiles `wasm`, through `cache_dir/components/<key>.cwasm`.

    Returns (component, cache_hit, cache_file). The key is the sha256 of the wasm bytes
    and the engine fingerprint (wasmtime version, config, target). A cache file that
    fails to deserialize (truncated, other wasmtime) is recompiled and replaced. Writes
    are atomic (temp file + rename) so concurrent loads never see half a file; a cache
    that cannot be written is skipped silently. The cache holds native code: it must
    live in a directory only the user can write (the default is the user's cache dir).
    """
    key = hashlib.sha256(wasm + b"\0" + fingerprint.encode()).hexdigest()
    folder = cache_dir / "components"
    path = folder / f"{key}.cwasm"
    if path.is_file():
        try:
            return Component.deserialize_file(engine, str(path)), True, path
        except wasmtime.WasmtimeError:
            pass  # stale or damaged: recompile below and overwrite
    component = Component(engine, wasm)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(component.serialize())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, wasmtime.WasmtimeError):
        return component, False, None
    return component, False, path


# --- loading and checking a component --------------------------------------------------


def _read_wasm(path: Path) -> bytes:
    """The component's binary: a .wasm file, or WebAssembly text (used by the tests)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ComponentError(f"controller component not found: {path}") from None
    except IsADirectoryError:
        raise ComponentError(f"controller component {path} is a directory, not a file") from None
    except OSError as e:
        raise ComponentError(f"cannot read controller component {path}: {e.strerror}") from None
    if not data.startswith(b"\0asm"):
        text = _as_text(data)
        if text is None:
            raise ComponentError(
                f"{path} is not a WebAssembly component (not a WebAssembly file at all); "
                "build one with `aici-batch build`"
            )
        try:
            data = bytes(wasmtime.wat2wasm(text))
        except wasmtime.WasmtimeError as e:
            raise ComponentError(
                f"{path} is not a WebAssembly component: invalid WebAssembly text: "
                f"{_first_line(str(e))}"
            ) from None
    layer = data[4:8]
    if layer == b"\x01\0\0\0":
        raise ComponentError(
            f"{path} is not a WebAssembly component: it is a core WebAssembly module; "
            "controllers must be components of world aici:controller/controller-world "
            "(build one with `aici-batch build`)"
        )
    if len(layer) < 4 or layer[2:4] != b"\x01\0":
        raise ComponentError(
            f"{path} is not a WebAssembly component (unknown WebAssembly version/layer "
            f"{layer.hex()})"
        )
    return data


def _as_text(data: bytes) -> str | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    head = text.lstrip()
    return text if head.startswith(("(", ";;")) else None


# The contract's function signatures as `_signature` renders them (own/borrow handles
# carry no resource name in wasmtime-py's reflection). Checked at load so that a component
# built against an edited WIT with the same version fails here, in one line, instead of
# failing value conversions mid-run.
_TOKEN_SET = (
    "variant{all, allow(list<u32>), deny(list<u32>), bitmask(list<u32>), host-set(u32), "
    "not-host-set(u32)}"
)
_GRAMMAR = "variant{json-schema(string), regex(string), lark(string), choice(list<string>)}"
_SEGMENT = f"record{{grammar: option<{_GRAMMAR}>, max-tokens: u32, stop: list<string>}}"
_ACTION = (
    f"variant{{sample({_TOKEN_SET}), generate({_SEGMENT}), "
    "splice(record{backtrack: u32, ff-tokens: list<u32>}), stop}"
)
_STEP_INPUT = "record{backtrack: u32, tokens: list<u32>, segment-text: option<string>}"
_SIGNATURES: dict[str, dict[str, str]] = {
    TYPES_INTERFACE: {},
    TOKENIZER_INTERFACE: {
        "vocab-size": "func() -> u32",
        "eos-token": "func() -> u32",
        "tokenize": "func(text: string) -> list<u32>",
        "decode": "func(tokens: list<u32>) -> string",
        "token-bytes": "func(token: u32) -> list<u8>",
        "tokens-matching": "func(pattern: string) -> result<u32, string>",
    },
    HOST_INTERFACE: {
        "log": "func(message: string)",
        "set-output": "func(key: string, value: string)",
    },
    CONTROLLER_INTERFACE: {
        _CONSTRUCTOR: "func(arg: string, prompt: list<u32>) -> own",
        _MID_PROCESS: f"func(self: borrow, input: {_STEP_INPUT}) -> result<{_ACTION}, string>",
    },
}


def _signature(ty: Any) -> str:
    """WIT-like text of a reflected wasmtime type (structural: type names are not kept)."""
    if isinstance(ty, FuncType):
        params = ", ".join(f"{name}: {_signature(t)}" for name, t in ty.params)
        result = ty.result
        return f"func({params})" + ("" if result is None else f" -> {_signature(result)}")
    if isinstance(ty, ListType):
        return f"list<{_signature(ty.element)}>"
    if isinstance(ty, OptionType):
        return f"option<{_signature(ty.payload)}>"
    if isinstance(ty, ResultType):
        ok, err = ty.ok, ty.err
        return f"result<{'_' if ok is None else _signature(ok)}, " + (
            "_>" if err is None else f"{_signature(err)}>"
        )
    if isinstance(ty, RecordType):
        fields = ", ".join(f"{name}: {_signature(t)}" for name, t in ty.fields)
        return f"record{{{fields}}}"
    if isinstance(ty, VariantType):
        cases = ", ".join(n if t is None else f"{n}({_signature(t)})" for n, t in ty.cases)
        return f"variant{{{cases}}}"
    if isinstance(ty, TupleType):
        return f"tuple<{', '.join(_signature(t) for t in ty.elements)}>"
    if isinstance(ty, EnumType):
        return f"enum{{{', '.join(ty.names)}}}"
    if isinstance(ty, FlagsType):
        return f"flags{{{', '.join(ty.names)}}}"
    if isinstance(ty, OwnType):
        return "own"
    if isinstance(ty, BorrowType):
        return "borrow"
    return type(ty).__name__.lower()  # the primitives: u32, string, bool, ...


def _check_signature(path: Path, where: str, found: str, expected: str) -> None:
    if found == expected:
        return
    i = next((k for k, (a, b) in enumerate(zip(found, expected)) if a != b), None)
    if i is None:
        i = min(len(found), len(expected))
    if max(len(found), len(expected)) <= 120:
        detail = f"`{found}`, but this host expects `{expected}`"
    else:
        lo = max(0, i - 30)
        detail = (
            f"a signature that differs from this host's at `...{found[lo : i + 30]}...` "
            f"(expected `...{expected[lo : i + 30]}...`)"
        )
    raise ComponentError(f"{path}: {where} has {detail}; rebuild against wit/controller.wit")


def _instance_funcs(item: Any, engine: wasmtime.Engine) -> dict[str, FuncType] | None:
    ty = item.ty
    if not isinstance(ty, ComponentInstanceType):
        return None
    return {n: e.ty for n, e in ty.exports(engine).items() if isinstance(e.ty, FuncType)}


def _check_imports(path: Path, component: Component, engine: wasmtime.Engine) -> None:
    """Every import must be one this host provides: no WASI, no other contract version."""
    imports = component.type.imports(engine)
    wasi = sorted(name for name in imports if name.startswith("wasi:"))
    if wasi:
        more = f" (and {len(wasi) - 1} more WASI interfaces)" if len(wasi) > 1 else ""
        raise ComponentError(
            f"{path} imports {wasi[0]}{more}, but controllers get no filesystem, "
            "environment, clock or network; build it with `aici-batch build`, which uses "
            "componentize-py --stub-wasi"
        )
    for name, item in imports.items():
        provided = _SIGNATURES[name] if name in _PROVIDED else None
        if provided is None:
            base = name.split("@", 1)[0]
            same = [p for p in _PROVIDED if p.split("@", 1)[0] == base]
            hint = (
                f"; this host provides {same[0]} (rebuild against wit/controller.wit)"
                if same
                else "; this host provides only " + ", ".join(sorted(_PROVIDED))
            )
            raise ComponentError(f"{path} imports {name}, which this host does not provide{hint}")
        funcs = _instance_funcs(item, engine)
        if funcs is None:
            raise ComponentError(f"{path} imports {name} as something other than an instance")
        for func, fty in sorted(funcs.items()):
            if func not in provided:
                raise ComponentError(
                    f"{path} imports {name}#{func}, which this host does not provide "
                    "(rebuild against wit/controller.wit)"
                )
            _check_signature(path, f"import {name}#{func}", _signature(fty), provided[func])


def _check_exports(path: Path, component: Component, engine: wasmtime.Engine) -> FuncType:
    """The contract interface, its constructor and mid-process; returns mid-process's type."""
    exports = component.type.exports(engine)
    item = exports.get(CONTROLLER_INTERFACE)
    funcs = None if item is None else _instance_funcs(item, engine)
    if funcs is None:
        names = sorted(exports)
        others = [n for n in names if n.split("@", 1)[0] == CONTROLLER_INTERFACE.split("@")[0]]
        what = (
            f"it exports {', '.join(others)}: built against another version of the contract"
            if others
            else f"it exports {', '.join(names) if names else 'nothing'}"
        )
        raise ComponentError(
            f"{path} does not export {CONTROLLER_INTERFACE} ({what}); build controllers "
            "against wit/controller.wit, world controller-world"
        )
    for name, expected in _SIGNATURES[CONTROLLER_INTERFACE].items():
        fty = funcs.get(name)
        if fty is None:
            raise ComponentError(
                f"{path} exports {CONTROLLER_INTERFACE} without {name} (it has: "
                f"{', '.join(sorted(funcs)) or 'no functions'})"
            )
        _check_signature(path, f"export {CONTROLLER_INTERFACE}#{name}", _signature(fty), expected)
    return funcs[_MID_PROCESS]


def _is_tagged(ty: Any) -> bool:
    """Whether wasmtime-py represents values of this variant-like type as `Variant`.

    wasmtime-py uses `Variant(tag, payload)` only when two cases' Python classes overlap;
    otherwise a value is its bare payload (None for a payload-less case). `add_classes`
    is the public hook that tells which classes a type accepts.
    """
    classes: set[type] = set()
    ty.add_classes(classes)
    return Variant in classes


def _segment_text_tagged(mid_process: FuncType) -> bool:
    """How `step-input.segment-text` (an `option<string>`) must be lowered."""
    record = mid_process.params[1][1]
    assert isinstance(record, RecordType)  # _check_exports verified the signature
    return _is_tagged(dict(record.fields)["segment-text"])


# --- the component and its runners -----------------------------------------------------

# The runner whose call is in progress on this thread: host functions are bound once per
# component (one Linker), and find the sequence's state here. A guest call and the host
# functions it calls run on the same thread, so this is exact.
_current = threading.local()


class _Fault(Exception):
    """Raised inside a host function to end the call with this ControllerError."""

    def __init__(self, error: ControllerError) -> None:
        super().__init__(error.message)
        self.error = error


class _Overrun(_Fault):
    """A call that returned but overran its deadline outside wasm (in conversions)."""


class ControllerComponent:
    """A compiled, checked controller component; makes one `Runner` per sequence.

    Thread-safe: runners of one component may run on different threads at once.
    """

    def __init__(
        self,
        path: Path,
        component: Component,
        shared: _SharedEngine,
        limits: Limits,
        text_tagged: bool,
        tokens_matching_tagged: bool,
        compile_ms: float,
        cache_hit: bool,
        cache_file: Path | None,
    ) -> None:
        self.path = path
        self.limits = limits
        self.compile_ms = compile_ms  # compile or cache load, wall time
        self.cache_hit = cache_hit
        self.cache_file = cache_file
        self._component = component
        self._shared = shared
        self._text_tagged = text_tagged
        self._tm_tagged = tokens_matching_tagged
        iface = component.get_export_index(CONTROLLER_INTERFACE)
        self._ctor_index = component.get_export_index(_CONSTRUCTOR, iface)
        self._mid_index = component.get_export_index(_MID_PROCESS, iface)
        self._linker = self._make_linker()
        self._types_lock = threading.Lock()
        self._mid_type: FuncType | None = None
        self._mid_type_failed = False

    @classmethod
    def load(
        cls, path: str | Path, limits: Limits = Limits(), cache_dir: Path | None = None
    ) -> ControllerComponent:
        """Reads, compiles (or loads from the compile cache) and checks a component.

        Raises ComponentError with a one-line message when the file is missing, is not a
        component, does not export the contract, or imports what the host does not give.
        Cold compile of an 18 MB componentize-py component: 6-18 s; cached: 20-40 ms.
        """
        path = Path(path)
        wasm = _read_wasm(path)
        shared = _shared_engine()
        t0 = time.perf_counter()
        try:
            component, hit, cache_file = _compile(
                shared.engine,
                wasm,
                shared.fingerprint,
                cache_dir if cache_dir is not None else _default_cache_dir(),
            )
        except wasmtime.WasmtimeError as e:
            raise ComponentError(
                f"{path} is not a valid WebAssembly component: {_root_cause(str(e))}"
            ) from None
        compile_ms = (time.perf_counter() - t0) * 1000
        _check_imports(path, component, shared.engine)
        mid_ty = _check_exports(path, component, shared.engine)
        text_tagged = _segment_text_tagged(mid_ty)
        tm = component.type.imports(shared.engine).get(TOKENIZER_INTERFACE)
        tm_tagged = False
        if tm is not None and isinstance(tm.ty, ComponentInstanceType):
            f = tm.ty.exports(shared.engine).get("tokens-matching")
            if f is not None and isinstance(f.ty, FuncType) and f.ty.result is not None:
                tm_tagged = _is_tagged(f.ty.result)
        self = cls(
            path, component, shared, limits, text_tagged, tm_tagged, compile_ms, hit, cache_file
        )
        self._trial_instantiate()
        return self

    def instantiate(self, arg: str, prompt: list[int], services: HostServices) -> Runner:
        """A new runner for one sequence: new Store, instantiate, `runner(arg, prompt)`.

        Raises ControllerError (the store is dropped) when instantiation or the
        constructor fails: controller_trap / _timeout / _fuel / _memory / host_error.
        """
        runner = Runner(self, services)
        try:
            runner._start(arg, list(prompt))
        except ControllerError:
            runner.close()
            raise
        return runner

    def _memoize_mid_type(self, func: Any, store: wasmtime.Store) -> None:
        """Makes `func` use one frozen copy of mid-process's type (see `_freeze`)."""
        with self._types_lock:
            if self._mid_type is None and not self._mid_type_failed:
                try:
                    self._mid_type = _freeze(func.type(store))
                except Exception:  # another wasmtime-py layout: keep its slow, correct path
                    self._mid_type_failed = True
            fty = self._mid_type
        if fty is not None:
            # Func.__call__ asks `self.type(store)` on every call; an instance attribute
            # shadows the method. The type is store-independent (no resource identity is
            # used when converting own/borrow handles), so one copy serves every runner.
            func.__dict__["type"] = lambda _store: fty

    # Host functions, bound once; each finds its sequence's state through `_current`.
    def _make_linker(self) -> Linker:
        linker = Linker(self._shared.engine)
        tm_tagged = self._tm_tagged

        def tokens_matching(r: Runner, pattern: str) -> Any:
            try:
                r._count_pattern(pattern)
                handle = r.services.tokens_matching(pattern)
            except ValueError as e:
                msg = str(e) or f"invalid pattern {pattern!r}"
                return Variant("err", msg) if tm_tagged else msg
            handle = _u32(handle, "tokens_matching")
            return Variant("ok", handle) if tm_tagged else handle

        tokenizer: dict[str, Callable[..., Any]] = {
            "vocab-size": lambda r: r._vocab,
            "eos-token": lambda r: _u32(r.services.eos_token(), "eos_token"),
            "tokenize": lambda r, text: [_u32(t, "tokenize") for t in r.services.tokenize(text)],
            "decode": lambda r, tokens: _str(r.services.decode(list(tokens)), "decode"),
            "token-bytes": lambda r, token: bytes(r.services.token_bytes(token)),
            "tokens-matching": tokens_matching,
        }
        host: dict[str, Callable[..., Any]] = {
            "log": lambda r, message: r._log(message),
            "set-output": lambda r, key, value: r._set_output(key, value),
        }
        with linker.root() as root:
            for iface, funcs in ((TOKENIZER_INTERFACE, tokenizer), (HOST_INTERFACE, host)):
                with root.add_instance(iface) as inst:
                    for name, fn in funcs.items():
                        inst.add_func(name, _host_function(f"{iface.split('@')[0]}.{name}", fn))
        return linker

    def _trial_instantiate(self) -> None:
        """Instantiates once at load so that link errors are a ComponentError, not N
        per-sequence failures. Traps here are ignored: they are per-sequence matters."""
        store = wasmtime.Store(self._shared.engine)
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
                    f"{_size(self.limits.memory_bytes)} cap: {_root_cause(msg)}"
                ) from None
            if "exceeds table limits" in msg:
                raise ComponentError(
                    f"{self.path} needs larger tables at start than the cap of "
                    f"{self.limits.table_elements:,} elements: {_root_cause(msg)}"
                ) from None
            if not _is_trap(msg):
                raise ComponentError(
                    f"{self.path} cannot be linked against this host: {_root_cause(msg)}"
                ) from None
        finally:
            self._shared.ticker.leave()


def _host_function(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a host import: finds the calling runner, contains exceptions, keeps time.

    A Python exception must not escape to wasmtime-py (it would park it in a global and
    re-raise it from whichever thread looks next); a WasmtimeError traps the guest and
    the runner's `_pending` error says why.
    """

    def call(store: Any, *args: Any) -> Any:
        runner: Runner | None = getattr(_current, "runner", None)
        if runner is None:
            raise wasmtime.WasmtimeError(f"host function {name} called outside a runner call")
        t0 = time.perf_counter()
        try:
            return fn(runner, *args)
        except _Fault as e:
            runner._pending = e.error
        except Exception as e:
            runner._pending = ControllerError(
                "host_error", f"host function {name} failed: {type(e).__name__}: {e}"
            )
        finally:
            runner._host_returned(time.perf_counter() - t0)
        raise wasmtime.WasmtimeError(runner._pending.message)

    return call


def _u32(value: Any, what: str) -> int:
    v = int(value)
    if not 0 <= v <= _U32_MAX:
        raise ValueError(f"{what} returned {v}, which is not a u32")
    return v


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} returned {type(value).__name__}, not str")
    return value


class Runner:
    """One sequence's controller: its own Store, instance and `runner` resource.

    Not thread-safe by itself: one thread at a time per runner (different runners may run
    concurrently). Every failure is a ControllerError; after a trap the runner is dead.
    """

    def __init__(self, component: ControllerComponent, services: HostServices) -> None:
        self.services = services
        self.logs: list[str] = []  # host.log lines, in order (cut at Limits.log_bytes)
        self.outputs: dict[str, Any] = {}  # set-output values, JSON-parsed when they parse
        self.guest_ms = 0.0  # wall time inside constructor + mid-process calls
        self.host_ms = 0.0  # of which inside host functions
        self.setup_ms = 0.0  # Store + instantiation
        self.calls = 0  # mid-process calls made
        self.error: ControllerError | None = None  # what killed the runner, if anything
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
        (the runner is dead afterwards), controller_dead (it already was).
        """
        # wasmtime-py reads record fields by their WIT names (hyphens included) and wants
        # a `list`, not a tuple, for `list<u32>`.
        text: Any = inp.segment_text
        if self._component._text_tagged:
            text = Variant("none") if text is None else Variant("some", text)
        step = Record()
        for name, value in (
            ("backtrack", int(inp.backtrack)),
            ("tokens", [int(t) for t in inp.tokens]),
            ("segment-text", text),
        ):
            setattr(step, name, value)
        raw = self._call("mid-process", self._limits.call_ms, self._mid, self._resource, step)
        ok, value = _split_result(raw)
        if not ok:
            raise ControllerError("controller_error", clip(str(value), self._limits.error_chars))
        return _to_action(value, self._vocab, self.services)

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
            self._vocab = _u32(self.services.vocab_size(), "vocab_size")
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
        if self.error is not None:
            raise ControllerError(
                "controller_dead",
                f"the controller already failed ({self.error.type}: {self.error.message})",
            )
        store = self._store
        if store is None:
            raise ControllerError("controller_dead", "the runner is closed")
        if phase == "mid-process":
            self.calls += 1
        ticker = self._component._shared.ticker
        self._budget_ms = budget_ms
        self._pending = None
        self._call_host_s = 0.0
        _current.runner = self
        ticker.enter()  # before the deadline is set (see _EpochTicker.enter)
        t0 = self._call_start = time.perf_counter()
        try:
            store.set_fuel(self._limits.fuel_per_call)
            store.set_epoch_deadline(max(1, budget_ms))
            result = fn(store, *args)
            # The epoch stops wasm code only: converting a huge answer runs unchecked.
            spent_ms = (time.perf_counter() - t0 - self._call_host_s) * 1000
            if spent_ms > 2 * budget_ms:
                raise _Overrun(
                    ControllerError(
                        "controller_timeout",
                        f"{phase} exceeded its {budget_ms} ms deadline: it took "
                        f"{spent_ms:.0f} ms, most of it converting values between host and "
                        "guest (about 1 us per list element; keep answers small)",
                    )
                )
            return result
        except _Overrun as e:
            self.error = e.error
            self.close()
            raise self.error from None
        except wasmtime.WasmtimeError as e:
            self.error = self._pending or _classify(str(e), phase, budget_ms, self._limits)
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
            _current.runner = None
            dt = time.perf_counter() - t0
            if phase != "instantiation":
                self.guest_ms += dt * 1000
                self.host_ms += self._call_host_s * 1000

    def _host_returned(self, host_s: float) -> None:
        """Re-arms the deadline so that host time is not charged to the guest."""
        self._call_host_s += host_s
        store = self._store
        if store is None:
            return
        guest_ms = (time.perf_counter() - self._call_start - self._call_host_s) * 1000
        store.set_epoch_deadline(max(1, math.ceil(self._budget_ms - guest_ms)))

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
            raise _Fault(
                ControllerError(
                    "too_many_outputs",
                    f"set-output {clip(key, 100)!r}: more than {limits.max_outputs} outputs "
                    "per sequence",
                )
            )
        size = len(key.encode("utf-8", "replace")) + len(value.encode("utf-8", "replace"))
        used = self._output_used - self._output_sizes.get(key, 0) + size
        if used > limits.output_bytes:
            raise _Fault(
                ControllerError(
                    "outputs_too_large",
                    f"set-output {clip(key, 100)!r}: the outputs would take {used:,} bytes "
                    f"of key and value text, more than the {_size(limits.output_bytes)} "
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


# --- faster value conversion ------------------------------------------------------------

# wasmtime-py re-reads a function's type through FFI on every call and every property
# access (`VariantType.cases`, `RecordType.fields`, ...), and recomputes whether a variant
# is tagged each time: about 1,000 Python calls and 250-300 us per mid-process, against
# ~20 us inside wasm. `_freeze` reads the type tree once and swaps each node's class for a
# subclass whose properties return the stored children, so later conversions run the
# same wasmtime-py code on constant types: about 5x faster. Only reading is memoized;
# converting values is still wasmtime-py's own code.
_FROZEN_CHILDREN: dict[type, tuple[str, ...]] = {
    FuncType: ("params", "result"),
    ListType: ("element",),
    RecordType: ("fields",),
    TupleType: ("elements",),
    VariantType: ("cases",),
    OptionType: ("payload",),
    ResultType: ("ok", "err"),
}
_frozen_classes: dict[type, type] = {}
_frozen_lock = threading.Lock()


def _stored(key: str) -> property:
    def get(self: Any) -> Any:
        return self.__dict__[key]

    return property(get)


def _stored_tagged(self: Any) -> bool:
    return bool(self.__dict__["_frozen_tagged"])


def _frozen_class(cls: type, names: tuple[str, ...]) -> type:
    with _frozen_lock:
        sub = _frozen_classes.get(cls)
        if sub is None:
            namespace: dict[str, Any] = {name: _stored(f"_frozen_{name}") for name in names}
            if hasattr(cls, "_tagged"):
                namespace["_tagged"] = _stored_tagged
            sub = type(f"Frozen{cls.__name__}", (cls,), namespace)
            _frozen_classes[cls] = sub
        return sub


def _freeze(ty: Any) -> Any:
    """`ty` with its reflected children read once and kept (in place; returns `ty`)."""
    cls = type(ty)
    names = _FROZEN_CHILDREN.get(cls)
    if names is None:  # a primitive, own/borrow, or already frozen
        return ty
    values = {name: _freeze_child(getattr(ty, name)) for name in names}
    ty.__class__ = _frozen_class(cls, names)
    for name, value in values.items():
        ty.__dict__[f"_frozen_{name}"] = value
    if hasattr(cls, "_tagged"):
        ty.__dict__["_frozen_tagged"] = cls._tagged(ty)  # computed over the frozen children
    return ty


def _freeze_child(value: Any) -> Any:
    if isinstance(value, list):  # [(name, type | None)] or [type]
        return [
            (item[0], None if item[1] is None else _freeze(item[1]))
            if isinstance(item, tuple)
            else _freeze(item)
            for item in value
        ]
    return None if value is None else _freeze(value)


# --- fault classification --------------------------------------------------------------

_FRAME = re.compile(r"^\s*\d+:\s+0x[0-9a-f]+ - (?P<name>.+)$", re.MULTILINE)
# Frames that mean "an allocation failed": Rust's OOM hooks, C's, CPython's.
_OOM_FRAME = re.compile(r"alloc_error|rust_oom|__rg_oom|out_of_memory|PyErr_NoMemory|\boom\b")
# Frames of WASI functions that componentize-py's --stub-wasi turned into traps.
_WASI_FRAME = re.compile(
    r"preopens|get_directories|get_stdout|get_stderr|get_stdin|get_environment|"
    r"wall_clock|monotonic_clock|get_random|wasi"
)


def _classify(message: str, phase: str, budget_ms: int, limits: Limits) -> ControllerError:
    cause = _root_cause(message)
    frames = [m.group("name").strip() for m in _FRAME.finditer(message)]
    if "all fuel consumed" in message:
        return ControllerError(
            "controller_fuel",
            f"{phase} ran out of fuel ({limits.fuel_per_call:,} units per call)",
        )
    if "wasm trap: interrupt" in message:
        return ControllerError(
            "controller_timeout", f"{phase} exceeded its {budget_ms} ms deadline"
        )
    cap = _size(limits.memory_bytes)
    if "call stack exhausted" in message:
        named = [f for f in frames if "<wasm function" not in f]
        where = f" in {named[0]}" if named else ""
        return ControllerError(
            "controller_trap",
            f"{phase} trapped: stack overflow (recursion too deep?): {cause}{where}",
        )
    if "exceeds table limits" in message:
        return ControllerError(
            "controller_memory",
            f"{phase} needs a table larger than the cap of {limits.table_elements:,} "
            f"elements: {cause}",
        )
    if "exceeds memory limits" in message:
        return ControllerError(
            "controller_memory", f"{phase} needs more than the {cap} cap: {cause}"
        )
    if any(_OOM_FRAME.search(f) for f in frames) or "memory allocation of" in message:
        return ControllerError(
            "controller_memory",
            f"{phase} ran out of memory (cap {cap}): {cause} (tables are capped too, at "
            f"{limits.table_elements:,} elements)",
        )
    named = [f for f in frames if "<wasm function" not in f]
    where = f" in {named[0]}" if named else ""
    text = f"{phase} trapped: {cause}{where}"
    if any(_WASI_FRAME.search(f) for f in named):
        text += (
            " (a WASI function stubbed out at build time: controllers get no filesystem, "
            "stdio, environment, clock or network; an uncaught Python exception ends here "
            "too, because printing its traceback needs them)"
        )
    return ControllerError("controller_trap", text)


def _root_cause(message: str) -> str:
    """The innermost reason in a wasmtime error ("wasm trap: ..."), one line."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if "Caused by:" in lines:
        after = lines[lines.index("Caused by:") + 1 :]
        causes = [re.sub(r"^\d+: ", "", ln) for ln in after if not _FRAME.match(ln)]
        if causes:
            return "; ".join(causes)
    return lines[0] if lines else "unknown error"


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} bytes"


def _is_trap(message: str) -> bool:
    return "wasm trap" in message or "wasm backtrace" in message


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, with a note saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit:,} more characters cut]"


# --- wasmtime values -> actions --------------------------------------------------------


def _case(value: Any, infer: Callable[[Any], str | None], what: str) -> tuple[str, Any]:
    """(tag, payload) of a variant value in either shape wasmtime-py returns."""
    if isinstance(value, Variant):
        return value.tag, value.payload
    tag = infer(value)
    if tag is None:
        raise ControllerError("bad_action", f"cannot read {what} from {clip(repr(value), 200)}")
    return tag, value


def _split_result(value: Any) -> tuple[bool, Any]:
    """`result<action, string>`: untagged today (an action is a Variant, an error a str)."""
    if isinstance(value, Variant) and value.tag in ("ok", "err"):
        return value.tag == "ok", value.payload
    if isinstance(value, str):
        return False, value
    return True, value


def _infer_action(v: Any) -> str | None:
    if v is None:
        return "stop"
    if isinstance(v, Record):
        if hasattr(v, "max-tokens"):
            return "generate"
        if hasattr(v, "ff-tokens"):
            return "splice"
    return None


def _infer_token_set(v: Any) -> str | None:
    return "all" if v is None else None


def _infer_grammar(v: Any) -> str | None:
    return "choice" if isinstance(v, list) else None


def _to_action(value: Any, vocab: int, services: HostServices) -> Action:
    tag, payload = _case(value, _infer_action, "an action")
    if tag == "stop":
        return Stop()
    if tag == "sample":
        return Sample(_to_token_set(payload, vocab, services))
    if tag == "splice":
        ff = _token_ids(getattr(payload, "ff-tokens"), vocab, "splice ff-tokens")
        return Splice(backtrack=int(payload.backtrack), ff_tokens=ff)
    if tag == "generate":
        max_tokens = int(getattr(payload, "max-tokens"))
        if max_tokens <= 0:
            raise ControllerError("bad_action", "generate: segment max-tokens is 0")
        grammar = payload.grammar
        if isinstance(grammar, Variant) and grammar.tag in ("none", "some"):
            grammar = grammar.payload  # option in its tagged shape
        return Generate(
            Segment(
                grammar=None if grammar is None else _to_grammar(grammar),
                max_tokens=max_tokens,
                stop=tuple(str(s) for s in payload.stop),
            )
        )
    raise ControllerError("bad_action", f"unknown action {tag!r}")


def _to_token_set(value: Any, vocab: int, services: HostServices) -> TokenSet:
    tag, payload = _case(value, _infer_token_set, "a token set")
    if tag == "all":
        return TokenSet("all")
    if tag in ("allow", "deny"):
        ids = _token_ids(payload, vocab, f"sample {tag}")
        if tag == "allow" and not ids:
            raise ControllerError("bad_action", "sample: the allow-list is empty")
        return TokenSet(cast(TokenSetKind, tag), ids)
    if tag == "bitmask":
        words = tuple(int(w) for w in payload)
        need = (vocab + 31) // 32
        if len(words) != need:
            raise ControllerError(
                "bad_action",
                f"sample: bitmask has {len(words)} words; a vocabulary of {vocab} needs {need}",
            )
        tail = vocab % 32
        last = words[-1] if words else 0
        past = last >> tail if tail else 0  # the bits of ids >= vocab, in the last word
        if not (any(words[:-1]) or last ^ (past << tail)):
            raise ControllerError("bad_action", "sample: the bitmask allows no token")
        if past:
            # A guest that sets them has its vocabulary size wrong (e.g. a padded logits
            # size); for a model with padded logits they would allow tokens with no text.
            extra = (past & -past).bit_length() - 1  # the lowest such bit
            raise ControllerError(
                "bad_action",
                f"sample: bitmask allows token id {vocab + extra}, outside the vocabulary "
                f"(size {vocab})",
            )
        return TokenSet("bitmask", words)
    if tag in ("host-set", "not-host-set"):
        handle = int(payload)
        if not services.has_host_set(handle):
            raise ControllerError("bad_action", f"sample: unknown host-set handle {handle}")
        return TokenSet(cast(TokenSetKind, tag), handle=handle)
    raise ControllerError("bad_action", f"unknown token set {tag!r}")


def _to_grammar(value: Any) -> Grammar:
    tag, payload = _case(value, _infer_grammar, "a grammar")
    if tag == "choice":
        return Grammar("choice", tuple(str(s) for s in payload))
    if tag in ("json-schema", "regex", "lark"):
        return Grammar(cast(GrammarKind, tag), str(payload))
    raise ControllerError("bad_action", f"unknown grammar {tag!r}")


def _token_ids(values: Any, vocab: int, what: str) -> tuple[int, ...]:
    ids = tuple(int(t) for t in values)
    if ids and max(ids) >= vocab:
        t = next(t for t in ids if t >= vocab)
        raise ControllerError(
            "bad_action", f"{what}: token id {t} is outside the vocabulary (size {vocab})"
        )
    return ids
