"""The wasm host (`aici_cli/control/wasm/`) against small hand-written WAT guests.

Each test states its guest's core-module code next to its assertions; `tests/support/wat.py`
wraps it into a controller component (canonical ABI written out, no componentize-py
build), so the whole module runs in a few seconds.
"""

from __future__ import annotations

import gc
import itertools
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from fake_services import FakeServices
from wasmtime.component import Record, Variant
from wat import OOM_HOOK, Guest, component, save, strings, u32s

from aici_cli.control.actions import (
    Generate,
    Sample,
    Segment,
    Splice,
    StepInput,
    Stop,
    TokenSet,
)
from aici_cli.control.wasm import (
    ControllerComponent,
    GuestInstance,
    GuestLimits,
    WasmController,
    values,
)
from aici_cli.control.wasm import component as wasm_component
from aici_cli.control.wasm.wasm_engine import EpochTicker
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import ControllerError

STEP = StepInput(backtrack=0, tokens=(4,))
Load = Callable[..., ControllerComponent]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The guests' text files and the compile cache."""
    return tmp_path_factory.mktemp("wasm")


@pytest.fixture(scope="module")
def load(folder: Path) -> Load:
    def load(guests: Guest | Mapping[str, Guest], limits: GuestLimits | None = None
             ) -> ControllerComponent:
        path = save(folder, component(guests))
        return ControllerComponent.load(path, limits or GuestLimits(), cache_dir=folder)

    return load


def start(comp: ControllerComponent, arg: str = "",
          services: FakeServices | None = None) -> GuestInstance:
    return comp.instantiate(arg, [1, 2, 3], services or FakeServices())


STOP = Guest("(call $stop)")
SAMPLE_ALL = Guest("(call $sample-all)")
ALLOW_5_7 = Guest("(call $sample-allow {allow})", data={"allow": u32s(5, 7)})
SPLICE = Guest("(call $splice (i32.const 1) {ff})", data={"ff": u32s(10, 11)})
# Answers with its input: splice {backtrack = input.backtrack, ff-tokens = input.tokens}.
ECHO = Guest("(call $splice (local.get $backtrack) (local.get $tokens) (local.get $tokens-len))")
REGEX_SEGMENT = Guest(
    "(call $generate (i32.const 1) {regex} (i32.const 8) {stop})",  # 1: regex
    data={"regex": "[0-9]+", "stop": strings("\n")},
)
# tokens-matching("(") fails: the guest logs the error; then it samples [a-z]'s handle.
MATCHING = Guest(
    """
    (call $tokens-matching {bad} (global.get $out))
    (if (i32.load8_u (global.get $out))  ;; err: log its message
      (then (call $log (i32.load offset=4 (global.get $out))
                       (i32.load offset=8 (global.get $out)))))
    (call $tokens-matching {letters} (global.get $out))
    (if (i32.load8_u (global.get $out)) (then unreachable))
    (call $sample-host-set (i32.load offset=4 (global.get $out)))
    """,
    data={"bad": "(", "letters": "[a-z]"},
)
DECODE_99 = Guest(  # the fake services raise on token 99
    "(call $decode {tokens} (global.get $out)) (call $stop)", data={"tokens": u32s(99)}
)
TRAP_ON_5TH = Guest(
    "(if (i32.ge_u (global.get $calls) (i32.const 5)) (then unreachable)) (call $sample-all)"
)
LOOP = Guest("(loop $forever (br $forever)) unreachable")


# --- actions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guest", "action"),
    [
        (STOP, Stop()),
        (ALLOW_5_7, Sample(TokenSet("allow", (5, 7)))),
        (SAMPLE_ALL, Sample(TokenSet("all"))),
        (SPLICE, Splice(backtrack=1, ff_tokens=(10, 11))),
        (
            REGEX_SEGMENT,
            Generate(
                Segment(grammar=Constraint("regex", "[0-9]+"), max_tokens=8, stop=("\n",))
            ),
        ),
    ],
    ids=["stop", "allow", "all", "splice", "generate"],
)
def test_actions_convert_to_dataclasses(load: Load, guest: Guest, action: object) -> None:
    runner = start(load(guest))
    assert runner.mid_process(STEP) == action
    assert runner.mid_process(STEP) == action  # and again: the resource stays usable


def test_step_input_reaches_the_guest(load: Load) -> None:
    runner = start(load(ECHO))
    step = StepInput(backtrack=3, tokens=(9, 8, 7), segment_text="some text")
    assert runner.mid_process(step) == Splice(backtrack=3, ff_tokens=(9, 8, 7))
    assert runner.mid_process(StepInput()) == Splice(backtrack=0, ff_tokens=())
    assert runner.calls == 2
    assert runner.guest_ms > 0 and runner.setup_ms > 0


def test_logs_and_outputs_are_collected(load: Load) -> None:
    guest = Guest(
        """
        (call $log {hello})
        (call $set-output {answer} {forty_two})
        (call $set-output {raw} {not_json})
        (call $stop)
        """,
        data={"hello": "hello", "answer": "answer", "forty_two": "42", "raw": "raw",
              "not_json": "not json"},
    )
    runner = start(load(guest))
    assert runner.mid_process(STEP) == Stop()
    assert runner.logs == ["hello"]
    assert runner.outputs == {"answer": 42, "raw": "not json"}  # JSON parsed when it parses


def test_tokenizer_imports_are_served(load: Load) -> None:
    guest = Guest(
        """
        (call $log (call $utoa (call $vocab-size)))
        (call $log (call $utoa (call $eos-token)))
        (call $tokenize {hi} (global.get $out))
        (call $log (call $utoa (i32.load offset=4 (global.get $out))))  ;; length
        (call $log (call $utoa (i32.load (i32.load (global.get $out)))))  ;; first id
        (call $token-bytes (i32.const 3) (global.get $out))
        (call $log (i32.load (global.get $out)) (i32.load offset=4 (global.get $out)))
        (call $stop)
        """,
        data={"hi": "hi"},
    )
    runner = start(load(guest))
    assert runner.mid_process(STEP) == Stop()
    # vocab size, eos, len(tokenize("hi")), first id ('h' = 104 % 100), token-bytes(3)
    assert runner.logs == ["100", "2", "2", "4", "<3>"]


def test_tokens_matching_error_reaches_the_guest_as_err(load: Load) -> None:
    services = FakeServices()
    runner = start(load(MATCHING), services=services)
    action = runner.mid_process(STEP)
    assert action == Sample(TokenSet("host-set", handle=1))
    assert services.handles == {1: "[a-z]"}
    assert len(runner.logs) == 1 and runner.logs[0].startswith("bad pattern: missing )")


def test_host_time_is_not_charged_to_the_deadline(load: Load) -> None:
    comp = load(MATCHING, GuestLimits(call_ms=20))
    runner = start(comp, services=FakeServices(matching_delay_s=0.03))  # 2 x 30 ms on the host
    assert runner.mid_process(STEP) == Sample(TokenSet("host-set", handle=1))
    assert runner.host_ms >= 60


def test_guest_err_is_a_controller_error_and_not_fatal(load: Load) -> None:
    runner = start(load(Guest("(call $err {nope})", data={"nope": "nope"})))
    for _ in range(2):
        with pytest.raises(ControllerError) as info:
            runner.mid_process(STEP)
        assert (info.value.type, info.value.message) == ("controller_error", "nope")
    assert not runner.dead


@pytest.mark.parametrize(
    ("guest", "message"),
    [
        (  # a token id beyond a 100-token vocabulary
            Guest("(call $sample-allow {ids})", data={"ids": u32s(5, 100)}),
            "sample allow: token id 100 is outside the vocabulary (size 100)",
        ),
        (
            Guest("(call $sample-allow (i32.const 0) (i32.const 0))"),
            "sample: the allow-list is empty",
        ),
        (  # one word where a 100-token vocabulary needs four
            Guest("(call $sample-bitmask {mask})", data={"mask": u32s(0xFFFFFFFF)}),
            "sample: bitmask has 1 words; a vocabulary of 100 needs 4",
        ),
        (
            Guest("(call $sample-host-set (i32.const 77))"),
            "sample: unknown host-set handle 77",
        ),
        (
            Guest(
                "(call $generate (i32.const 1) {regex} (i32.const 0) {stop})",
                data={"regex": "[0-9]+", "stop": strings("\n")},
            ),
            "generate: segment max-tokens is 0",
        ),
    ],
    ids=["beyond-vocab", "empty-allow", "short-bitmask", "unknown-handle", "max-tokens-0"],
)
def test_malformed_actions_are_bad_action(load: Load, guest: Guest, message: str) -> None:
    runner = start(load(guest))
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert (info.value.type, info.value.message) == ("bad_action", message)


class NoCompiler:
    """A grammar compiler for controllers whose segments must never reach it."""

    def compile(self, constraint: Constraint) -> None:
        raise AssertionError(f"compiled {constraint!r}")


NO_COMPILER: Any = NoCompiler()


def test_segment_json_schema_that_is_not_json(load: Load) -> None:
    """Reported where the engine asks the controller, like every bad action; the guest
    stays usable."""
    guest = Guest(
        "(call $generate (i32.const 0) {schema} (i32.const 8) {stop})",  # 0: json-schema
        data={"schema": "[0-9]+", "stop": strings("\n")},
    )
    call_times: list[float] = []
    controller = WasmController(load(guest), "", FakeServices(), NO_COMPILER,
                                call_times=call_times)
    with pytest.raises(ControllerError) as info:
        controller.start([1, 2])
    assert (info.value.type, info.value.message) == (
        "bad_action", "segment JSON schema is not JSON: Expecting ',' delimiter: line 1 column 3 "
        "(char 2)"
    )
    assert controller.guest is not None and not controller.guest.dead
    assert len(call_times) == 1 and controller.generated == 0


# --- faults -----------------------------------------------------------------------------


def test_trap_in_constructor(load: Load) -> None:
    with pytest.raises(ControllerError) as info:
        start(load(Guest("(call $stop)", constructor="unreachable")))
    assert info.value.type == "controller_trap"
    assert info.value.message.startswith(
        "constructor trapped: wasm trap: wasm `unreachable` instruction executed"
    )


def test_trap_kills_only_its_runner(load: Load) -> None:
    comp = load({"t": TRAP_ON_5TH, "s": STOP})
    doomed = start(comp, "t")
    healthy = start(comp, "t")
    for _ in range(4):
        assert doomed.mid_process(STEP) == Sample(TokenSet("all"))
    with pytest.raises(ControllerError) as info:
        doomed.mid_process(STEP)
    assert info.value.type == "controller_trap"
    assert info.value.message.startswith("mid-process trapped: wasm trap: wasm `unreachable`")
    assert doomed.dead

    spent = doomed.guest_ms
    with pytest.raises(ControllerError) as info:
        doomed.mid_process(STEP)
    assert info.value.type == "controller_dead"
    assert "controller_trap" in info.value.message
    assert doomed.guest_ms == spent  # answered without entering wasm

    for _ in range(4):  # the other runner of the same component is unaffected
        assert healthy.mid_process(STEP) == Sample(TokenSet("all"))
    assert start(comp, "s").mid_process(STEP) == Stop()


def test_deadline(load: Load) -> None:
    runner = start(load(LOOP, GuestLimits(call_ms=20)))
    t0 = time.perf_counter()
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    elapsed = time.perf_counter() - t0  # the deadline is wasmtime's, on the thread's CPU clock
    assert (info.value.type, info.value.message) == (
        "controller_timeout",
        "mid-process exceeded its 20 ms deadline",
    )
    assert 0.015 < elapsed < 0.5


def test_the_deadline_counts_cpu_time_not_a_wait_for_the_gil(load: Load) -> None:
    """A guest waits for the GIL at each host call; another thread that holds it for
    200 ms at a time (a busy pure-Python loop under a long switch interval) must not
    push a 2 ms guest past a 20 ms deadline, as wall-clock time would."""
    comp = load(MATCHING, GuestLimits(call_ms=20))
    runner = start(comp, services=FakeServices())
    stop = threading.Event()
    started = threading.Event()

    def hog() -> None:
        started.set()
        while not stop.is_set():
            pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.2)
    thread = threading.Thread(target=hog, daemon=True)
    handles = itertools.count(1)  # each call scans its pattern again: a new handle
    waited = 0.0
    try:
        thread.start()
        started.wait()
        # On a loaded machine the OS may not run the hog while the calls do (no wait for
        # the GIL, nothing tested): rounds of calls until one waited; none may time out.
        for _ in range(10):
            t0 = time.perf_counter()
            for _ in range(3):
                assert runner.mid_process(STEP) == Sample(TokenSet("host-set",
                                                                   handle=next(handles)))
            waited = max(waited, time.perf_counter() - t0)
            if waited > 0.1:
                break
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()
    assert waited > 0.1  # the guest did wait: on the wall clock it would have timed out


def test_a_collection_of_the_host_heap_is_not_charged_to_the_guest(load: Load) -> None:
    """Python's collector, were it to run while values cross (here: 100 ms of CPU at
    every collection, one due at every allocation), would take a 20 ms guest's deadline."""
    runner = start(load(ALLOW_5_7, GuestLimits(call_ms=20)))
    runner.mid_process(STEP)  # the first call memoizes types: allocations outside any call
    collections = 0

    def slow(phase: str, info: dict[str, int]) -> None:
        nonlocal collections
        if phase == "start":
            collections += 1
            end = time.thread_time() + 0.1
            while time.thread_time() < end:
                pass

    thresholds = gc.get_threshold()
    gc.callbacks.append(slow)
    gc.set_threshold(1, 1, 1)
    try:
        for _ in range(3):
            assert runner.mid_process(STEP) == Sample(TokenSet("allow", (5, 7)))
        assert gc.isenabled()  # turned back on after each call
    finally:
        gc.callbacks.remove(slow)
        gc.set_threshold(*thresholds)
    assert collections > 0  # and it ran, between calls


def test_the_epoch_ticker_counts_the_calling_threads_cpu_time() -> None:
    """A thread inside a call that waits 150 ms gets (almost) no ticks; one that works
    gets a tick per millisecond of its CPU time."""
    ticks = 0

    def increment() -> None:
        nonlocal ticks
        ticks += 1

    ticker = EpochTicker(increment, name="test-epoch")
    ticker.enter()
    time.sleep(0.15)
    ticker.leave()
    assert ticks <= 10
    before, cpu0 = ticks, time.thread_time()
    ticker.enter()
    while time.thread_time() - cpu0 < 0.06:
        pass
    time.sleep(0.01)  # the ticker's next reading
    ticker.leave()
    spent_ms = (time.thread_time() - cpu0) * 1000
    assert 0.8 * spent_ms - 5 <= ticks - before <= spent_ms + 1


def test_fuel(load: Load) -> None:
    runner = start(load(LOOP, GuestLimits(call_ms=60_000, fuel_per_call=1_000_000)))
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert (info.value.type, info.value.message) == (
        "controller_fuel",
        "mid-process ran out of fuel (1,000,000 units per call)",
    )


def test_memory_cap(load: Load) -> None:
    # Grows memory one page at a time until memory.grow fails, then aborts the way Rust's
    # allocator does.
    guest = Guest(
        """
        (loop $more (br_if $more (i32.ne (memory.grow (i32.const 1)) (i32.const -1))))
        (call $handle_alloc_error)
        unreachable
        """,
        funcs=(OOM_HOOK,),
    )
    runner = start(load(guest, GuestLimits(memory_bytes=2 << 20)))
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert info.value.type == "controller_memory"
    assert info.value.message.startswith("mid-process ran out of memory (cap 2 MiB)")


def test_host_exception_traps_the_guest_not_the_host(load: Load) -> None:
    runner = start(load(DECODE_99))
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert info.value.type == "host_error"
    assert info.value.message == (
        "host function aici:controller/tokenizer.decode failed: RuntimeError: decode exploded"
    )
    assert runner.dead


# Chatty guests get a generous deadline: each import call costs wasmtime-py ~20-30 us of
# conversion outside the host function itself, and that time is charged to the guest.
CHATTY = GuestLimits(call_ms=10_000, log_bytes=1000)


def test_log_cap_truncates_with_a_note(load: Load) -> None:
    guest = Guest(  # 2000 lines of 100 bytes
        """
        (loop $lines
          (call $log {line})
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $lines (i32.lt_u (local.get $i) (i32.const 2000))))
        (call $stop)
        """,
        data={"line": "0123456789" * 10},
    )
    runner = start(load(guest, CHATTY))
    assert runner.mid_process(STEP) == Stop()
    assert len(runner.logs) == 11
    assert runner.logs[-1] == "[logs truncated: more than 1000 bytes]"


def test_output_cap(load: Load) -> None:
    guest = Guest(  # 300 distinct keys "kaa", "kab", ...; the default cap is 256
        """
        (loop $keys
          (i32.store8 (global.get $out) (i32.const 107))  ;; k
          (i32.store8 offset=1 (global.get $out)
            (i32.add (i32.const 97) (i32.div_u (local.get $i) (i32.const 26))))
          (i32.store8 offset=2 (global.get $out)
            (i32.add (i32.const 97) (i32.rem_u (local.get $i) (i32.const 26))))
          (call $set-output (global.get $out) (i32.const 3) {forty_two})
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $keys (i32.lt_u (local.get $i) (i32.const 300))))
        (call $stop)
        """,
        data={"forty_two": "42"},
    )
    runner = start(load(guest, CHATTY))
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert info.value.type == "too_many_outputs"
    assert info.value.message == "set-output 'kjw': more than 256 outputs per sequence"
    assert len(runner.outputs) == 256
    assert runner.dead


def test_closed_runner(load: Load) -> None:
    runner = start(load(STOP))
    runner.close()
    runner.close()
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert (info.value.type, info.value.message) == ("controller_dead", "the runner is closed")


def test_runners_on_many_threads(load: Load) -> None:
    """Different runners run concurrently; host failures stay with their own runner."""
    comp = load({"h": ECHO, "d": DECODE_99})
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                good = start(comp, "h")
                bad = start(comp, "d")
                step = StepInput(backtrack=i, tokens=(i,))
                assert good.mid_process(step) == Splice(backtrack=i, ff_tokens=(i,))
                with pytest.raises(ControllerError, match="decode exploded"):
                    bad.mid_process(STEP)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_one_wasm_engine_and_one_idle_daemon_ticker(load: Load) -> None:
    comp = load(STOP)
    other = load(STOP, GuestLimits(call_ms=5))
    assert other._shared is comp._shared
    start(other).mid_process(STEP)
    tickers = [t for t in threading.enumerate() if t.name == "aici-wasm-epoch"]
    assert len(tickers) == 1 and tickers[0].daemon  # never keeps the process alive
    assert not comp._shared.ticker._wake.is_set()  # no call running: it sleeps


def test_memoized_types_give_wasmtime_py_results(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frozen-type fast path converts exactly like wasmtime-py's own slow path."""
    guests = {"s": STOP, "a": ALLOW_5_7, "A": SAMPLE_ALL, "p": SPLICE, "n": REGEX_SEGMENT,
              "h": ECHO, "m": MATCHING}
    path = save(folder, component(guests))
    steps = [STEP, StepInput(backtrack=1, tokens=(5, 6), segment_text="done")]

    def run(comp: ControllerComponent) -> list[object]:
        return [start(comp, mode).mid_process(step) for mode in guests for step in steps]

    fast_comp = ControllerComponent.load(path, cache_dir=folder)
    first = start(fast_comp, "s")  # types are read through this runner's store...
    assert type(fast_comp._mid_type).__name__ == "FrozenFuncType"
    first.close()
    del first
    gc.collect()  # ...which is gone now: the frozen types must not depend on it
    fast = run(fast_comp)

    def unavailable(ty: object) -> object:
        raise AttributeError("a wasmtime-py without these internals")

    monkeypatch.setattr(wasm_component, "freeze", unavailable)
    slow_comp = ControllerComponent.load(path, cache_dir=folder)
    slow = run(slow_comp)
    assert slow_comp._mid_type is None and slow_comp._mid_type_failed
    assert fast == slow
    assert Sample(TokenSet("allow", (5, 7))) in fast


# --- both value shapes wasmtime-py may return -------------------------------------------


def record(**fields: object) -> Record:
    r = Record()
    for name, value in fields.items():
        setattr(r, name.replace("_", "-"), value)
    return r


def test_conversion_accepts_tagged_and_bare_shapes() -> None:
    services = FakeServices()
    convert = values.to_action
    assert values.split_result(Variant("err", "no")) == (False, "no")
    assert values.split_result("no") == (False, "no")
    assert values.split_result(Variant("ok", None)) == (True, None)
    assert convert(None, 100, services) == Stop()
    assert convert(Variant("stop"), 100, services) == Stop()
    assert convert(record(backtrack=2, ff_tokens=[3]), 100, services) == Splice(2, (3,))
    segment = record(grammar=Variant("some", ["x", "y"]), max_tokens=4, stop=[])
    assert convert(segment, 100, services) == Generate(
        Segment(Constraint("choice", ["x", "y"]), 4)
    )
    assert convert(Variant("sample", None), 100, services) == Sample(TokenSet("all"))
    # a bitmask whose only set bits lie past the vocabulary (100 = 3 words + 4 bits)
    with pytest.raises(ControllerError, match="the bitmask allows no token"):
        convert(Variant("sample", Variant("bitmask", [0, 0, 0, 0xFFFFFFF0])), 100, services)
    mask = Variant("sample", Variant("bitmask", [0, 0, 0, 0b1000]))
    assert convert(mask, 100, services) == Sample(TokenSet("bitmask", (0, 0, 0, 8)))
    with pytest.raises(ControllerError, match="cannot read a token set"):
        convert(Variant("sample", [1, 2]), 100, services)  # allow or deny? ambiguous
