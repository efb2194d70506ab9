"""The wasm host (`aici_cli/control/wasm/`) against hand-written WAT components.

`tests/wat/controller.wat` implements the controller world with the canonical ABI written
out by hand; the first byte of the constructor's `arg` picks its behaviour (see the table
at the top of that file). No componentize-py build: the whole module runs in about a
second.
"""

from __future__ import annotations

import gc
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from wasmtime.component import Component, Record, Variant

from aici_cli.control.actions import (
    Generate,
    Sample,
    Segment,
    Splice,
    StepInput,
    Stop,
    TokenSet,
)
from aici_cli.control.constraint import Constraint
from aici_cli.control.wasm import (
    ComponentError,
    ControllerComponent,
    GuestInstance,
    Limits,
    values,
)
from aici_cli.control.wasm import component as wasm_component
from aici_cli.errors import ControllerError

WAT = Path(__file__).parent / "wat"
CONTROLLER = WAT / "controller.wat"


class FakeServices:
    """A 100-token vocabulary: token i decodes to f"<{i}>"; token 99 makes decode raise."""

    def __init__(self, matching_delay_s: float = 0.0) -> None:
        self.handles: dict[int, str] = {}
        self.matching_delay_s = matching_delay_s

    def vocab_size(self) -> int:
        return 100

    def eos_token(self) -> int:
        return 2

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, tokens: list[int]) -> str:
        if 99 in tokens:
            raise RuntimeError("decode exploded")
        return "".join(f"<{t}>" for t in tokens)

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def tokens_matching(self, pattern: str) -> int:
        time.sleep(self.matching_delay_s)
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"bad pattern: {e}") from None
        handle = len(self.handles) + 1
        self.handles[handle] = pattern
        return handle

    def has_host_set(self, handle: int) -> bool:
        return handle in self.handles


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wasm-cache")


@pytest.fixture(scope="module")
def component(cache: Path) -> ControllerComponent:
    return ControllerComponent.load(CONTROLLER, cache_dir=cache)


def start(
    comp: ControllerComponent, mode: str, services: FakeServices | None = None
) -> GuestInstance:
    return comp.instantiate(mode, [1, 2, 3], services or FakeServices())


STEP = StepInput(backtrack=0, tokens=(4,))


class NoCompiler:
    """A grammar compiler for controllers whose segments must never reach it."""

    def compile(self, constraint: Constraint) -> None:
        raise AssertionError(f"compiled {constraint!r}")


NO_COMPILER: Any = NoCompiler()


# --- actions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "action"),
    [
        ("s", Stop()),
        ("a", Sample(TokenSet("allow", (5, 7)))),
        ("A", Sample(TokenSet("all"))),
        ("p", Splice(backtrack=1, ff_tokens=(10, 11))),
        (
            "n",
            Generate(
                Segment(grammar=Constraint("regex", "[0-9]+"), max_tokens=8, stop=("\n",))
            ),
        ),
    ],
)
def test_actions_convert_to_dataclasses(
    component: ControllerComponent, mode: str, action: object
) -> None:
    runner = start(component, mode)
    assert runner.mid_process(STEP) == action
    assert runner.mid_process(STEP) == action  # and again: the resource stays usable


def test_step_input_reaches_the_guest(component: ControllerComponent) -> None:
    runner = start(component, "h")  # echoes the input as a splice
    step = StepInput(backtrack=3, tokens=(9, 8, 7), segment_text="some text")
    assert runner.mid_process(step) == Splice(backtrack=3, ff_tokens=(9, 8, 7))
    assert runner.mid_process(StepInput()) == Splice(backtrack=0, ff_tokens=())
    assert runner.calls == 2
    assert runner.guest_ms > 0 and runner.setup_ms > 0


def test_logs_and_outputs_are_collected(component: ControllerComponent) -> None:
    runner = start(component, "l")
    assert runner.mid_process(STEP) == Stop()
    assert runner.logs == ["hello"]
    assert runner.outputs == {"answer": 42, "raw": "not json"}  # JSON parsed when it parses


def test_tokenizer_imports_are_served(component: ControllerComponent) -> None:
    runner = start(component, "v")
    assert runner.mid_process(STEP) == Stop()
    # vocab size, eos, len(tokenize("hi")), first id ('h' = 104 % 100), token-bytes(3)
    assert runner.logs == ["100", "2", "2", "4", "<3>"]


def test_tokens_matching_error_reaches_the_guest_as_err(component: ControllerComponent) -> None:
    services = FakeServices()
    runner = start(component, "m", services)
    action = runner.mid_process(STEP)
    assert action == Sample(TokenSet("host-set", handle=1))
    assert services.handles == {1: "[a-z]"}
    assert len(runner.logs) == 1 and runner.logs[0].startswith("bad pattern: missing )")


def test_host_time_is_not_charged_to_the_deadline(cache: Path) -> None:
    comp = ControllerComponent.load(CONTROLLER, Limits(call_ms=20), cache_dir=cache)
    runner = start(comp, "m", FakeServices(matching_delay_s=0.03))  # 2 x 30 ms on the host
    assert runner.mid_process(STEP) == Sample(TokenSet("host-set", handle=1))
    assert runner.host_ms >= 60


def test_guest_err_is_a_controller_error_and_not_fatal(component: ControllerComponent) -> None:
    runner = start(component, "x")
    for _ in range(2):
        with pytest.raises(ControllerError) as info:
            runner.mid_process(STEP)
        assert (info.value.type, info.value.message) == ("controller_error", "nope")
    assert not runner.dead


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("b", "sample allow: token id 100 is outside the vocabulary (size 100)"),
        ("e", "sample: the allow-list is empty"),
        ("k", "sample: bitmask has 1 words; a vocabulary of 100 needs 4"),
        ("H", "sample: unknown host-set handle 77"),
        ("z", "generate: segment max-tokens is 0"),
    ],
)
def test_malformed_actions_are_bad_action(
    component: ControllerComponent, mode: str, message: str
) -> None:
    runner = start(component, mode)
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert (info.value.type, info.value.message) == ("bad_action", message)


def test_segment_json_schema_that_is_not_json(tmp_path: Path) -> None:
    """Reported where the engine asks the controller, like every bad action; the guest
    stays usable."""
    from aici_cli.control.wasm import WasmController

    text = CONTROLLER.read_text()
    regex = "(i32.store8 (i32.const 1036) (i32.const 1))   ;; regex"
    assert regex in text
    path = tmp_path / "json.wat"
    path.write_text(text.replace(regex, "(i32.store8 (i32.const 1036) (i32.const 0))"))
    comp = ControllerComponent.load(path, cache_dir=tmp_path)
    call_times: list[float] = []
    controller = WasmController(comp, "n", FakeServices(), NO_COMPILER, call_times=call_times)
    with pytest.raises(ControllerError) as info:
        controller.start([1, 2])
    assert (info.value.type, info.value.message) == (
        "bad_action", "segment JSON schema is not JSON: Expecting ',' delimiter: line 1 column 3 "
        "(char 2)"
    )
    assert controller.guest is not None and not controller.guest.dead
    assert len(call_times) == 1 and controller.generated == 0


# --- faults -----------------------------------------------------------------------------


def test_trap_in_constructor(component: ControllerComponent) -> None:
    with pytest.raises(ControllerError) as info:
        start(component, "c")
    assert info.value.type == "controller_trap"
    assert info.value.message.startswith(
        "constructor trapped: wasm trap: wasm `unreachable` instruction executed"
    )


def test_trap_kills_only_its_runner(component: ControllerComponent) -> None:
    doomed = start(component, "t")  # traps on its 5th call
    healthy = start(component, "t")
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
    assert start(component, "s").mid_process(STEP) == Stop()


def test_deadline(cache: Path) -> None:
    comp = ControllerComponent.load(CONTROLLER, Limits(call_ms=20), cache_dir=cache)
    runner = start(comp, "w")  # loops forever
    t0 = time.perf_counter()
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    elapsed = time.perf_counter() - t0
    assert (info.value.type, info.value.message) == (
        "controller_timeout",
        "mid-process exceeded its 20 ms deadline",
    )
    assert 0.015 < elapsed < 0.5


def test_fuel(cache: Path) -> None:
    limits = Limits(call_ms=60_000, fuel_per_call=1_000_000)
    runner = start(ControllerComponent.load(CONTROLLER, limits, cache_dir=cache), "w")
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert (info.value.type, info.value.message) == (
        "controller_fuel",
        "mid-process ran out of fuel (1,000,000 units per call)",
    )


def test_memory_cap(cache: Path) -> None:
    comp = ControllerComponent.load(CONTROLLER, Limits(memory_bytes=2 << 20), cache_dir=cache)
    runner = start(comp, "g")  # grows until memory.grow fails, then aborts
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert info.value.type == "controller_memory"
    assert info.value.message.startswith("mid-process ran out of memory (cap 2 MiB)")


def test_memory_cap_below_the_initial_memory_fails_at_load(cache: Path) -> None:
    with pytest.raises(ComponentError, match="needs more memory at start than the 1 KiB cap"):
        ControllerComponent.load(CONTROLLER, Limits(memory_bytes=1024), cache_dir=cache)


def test_host_exception_traps_the_guest_not_the_host(component: ControllerComponent) -> None:
    runner = start(component, "d")  # decode([99]): the fake raises RuntimeError
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert info.value.type == "host_error"
    assert info.value.message == (
        "host function aici:controller/tokenizer.decode failed: RuntimeError: decode exploded"
    )
    assert runner.dead


# Chatty guests get a generous deadline: each import call costs wasmtime-py ~20-30 us of
# conversion outside the host function itself, and that time is charged to the guest.
CHATTY = Limits(call_ms=10_000, log_bytes=1000)


def test_log_cap_truncates_with_a_note(cache: Path) -> None:
    comp = ControllerComponent.load(CONTROLLER, CHATTY, cache_dir=cache)
    runner = start(comp, "L")  # 2000 lines of 100 bytes
    assert runner.mid_process(STEP) == Stop()
    assert len(runner.logs) == 11
    assert runner.logs[-1] == "[logs truncated: more than 1000 bytes]"


def test_output_cap(cache: Path) -> None:
    comp = ControllerComponent.load(CONTROLLER, CHATTY, cache_dir=cache)
    runner = start(comp, "O")  # 300 distinct keys; the default cap is 256
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert info.value.type == "too_many_outputs"
    assert info.value.message == "set-output 'kjw': more than 256 outputs per sequence"
    assert len(runner.outputs) == 256
    assert runner.dead


def test_closed_runner(component: ControllerComponent) -> None:
    runner = start(component, "s")
    runner.close()
    runner.close()
    with pytest.raises(ControllerError) as info:
        runner.mid_process(STEP)
    assert (info.value.type, info.value.message) == ("controller_dead", "the runner is closed")


def test_runners_on_many_threads(component: ControllerComponent) -> None:
    """Different runners run concurrently; host failures stay with their own runner."""
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                good = start(component, "h")
                bad = start(component, "d")
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


def test_one_engine_and_one_idle_daemon_ticker(component: ControllerComponent, cache: Path) -> None:
    other = ControllerComponent.load(CONTROLLER, Limits(call_ms=5), cache_dir=cache)
    assert other._shared is component._shared
    start(other, "s").mid_process(STEP)
    tickers = [t for t in threading.enumerate() if t.name == "aici-wasm-epoch"]
    assert len(tickers) == 1 and tickers[0].daemon  # never keeps the process alive
    assert not component._shared.ticker._wake.is_set()  # no call running: it sleeps


# --- loading ----------------------------------------------------------------------------


def test_compile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ControllerComponent.load(CONTROLLER, cache_dir=tmp_path)
    assert not first.cache_hit
    files = list((tmp_path / "components").glob("*.cwasm"))
    assert files == [first.cache_file]
    mtime = files[0].stat().st_mtime_ns

    loaded: list[str] = []
    real = Component.deserialize_file

    def spy(engine: object, path: str) -> Component:
        loaded.append(path)
        return real(engine, path)  # type: ignore[arg-type]

    monkeypatch.setattr(Component, "deserialize_file", staticmethod(spy))
    second = ControllerComponent.load(CONTROLLER, cache_dir=tmp_path)
    assert second.cache_hit and loaded == [str(files[0])]
    assert files[0].stat().st_mtime_ns == mtime
    assert start(second, "s").mid_process(STEP) == Stop()


def test_damaged_cache_file_is_replaced(tmp_path: Path) -> None:
    first = ControllerComponent.load(CONTROLLER, cache_dir=tmp_path)
    assert first.cache_file is not None
    first.cache_file.write_bytes(b"not a compiled component")
    again = ControllerComponent.load(CONTROLLER, cache_dir=tmp_path)
    assert not again.cache_hit
    assert start(again, "a").mid_process(STEP) == Sample(TokenSet("allow", (5, 7)))
    assert ControllerComponent.load(CONTROLLER, cache_dir=tmp_path).cache_hit


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ComponentError, match=r"^controller component not found: .*nope\.wasm$"):
        ControllerComponent.load(tmp_path / "nope.wasm", cache_dir=tmp_path)
    with pytest.raises(ComponentError, match="is a directory"):
        ControllerComponent.load(tmp_path, cache_dir=tmp_path)


def test_garbage_is_not_a_component(tmp_path: Path) -> None:
    path = tmp_path / "junk.wasm"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(ComponentError, match="junk.wasm is not a WebAssembly component"):
        ControllerComponent.load(path, cache_dir=tmp_path)


@pytest.mark.parametrize("binary", [False, True])
def test_core_module_is_not_a_component(tmp_path: Path, binary: bool) -> None:
    path = WAT / "core_module.wat"
    if binary:
        path = tmp_path / "core.wasm"
        path.write_bytes(b"\0asm\x01\0\0\0")
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(path, cache_dir=tmp_path)
    assert "is not a WebAssembly component: it is a core WebAssembly module" in str(info.value)


def test_other_contract_version_is_named(tmp_path: Path) -> None:
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(WAT / "wrong_version.wat", cache_dir=tmp_path)
    message = str(info.value)
    assert "does not export aici:controller/controller@0.1.0" in message
    assert "it exports aici:controller/controller@0.2.0" in message
    assert "\n" not in message


def test_component_without_exports(tmp_path: Path) -> None:
    with pytest.raises(ComponentError, match=r"\(it exports nothing\)"):
        ControllerComponent.load(WAT / "no_exports.wat", cache_dir=tmp_path)


def test_wasi_import_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(WAT / "wasi_import.wat", cache_dir=tmp_path)
    message = str(info.value)
    assert "imports wasi:cli/environment@0.2.0" in message
    assert "no filesystem, environment, clock or network" in message
    assert "aici-batch build" in message


def test_invalid_text(tmp_path: Path) -> None:
    path = tmp_path / "broken.wat"
    path.write_text("(component (oops))")
    with pytest.raises(ComponentError, match="invalid WebAssembly text"):
        ControllerComponent.load(path, cache_dir=tmp_path)


def test_memoized_types_give_wasmtime_py_results(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frozen-type fast path converts exactly like wasmtime-py's own slow path."""
    steps = [STEP, StepInput(backtrack=1, tokens=(5, 6), segment_text="done")]
    modes = "saApnhm"

    def run(comp: ControllerComponent) -> list[object]:
        return [start(comp, mode).mid_process(step) for mode in modes for step in steps]

    fast_comp = ControllerComponent.load(CONTROLLER, cache_dir=cache)
    first = start(fast_comp, "s")  # types are read through this runner's store...
    assert type(fast_comp._mid_type).__name__ == "FrozenFuncType"
    first.close()
    del first
    gc.collect()  # ...which is gone now: the frozen types must not depend on it
    fast = run(fast_comp)

    def unavailable(ty: object) -> object:
        raise AttributeError("a wasmtime-py without these internals")

    monkeypatch.setattr(wasm_component, "freeze", unavailable)
    slow_comp = ControllerComponent.load(CONTROLLER, cache_dir=cache)
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


# Changing the eos-token import to u64 also needs the core module to agree.
EOS_U64 = [
    ('(export "eos-token" (func (result u32)))', '(export "eos-token" (func (result u64)))'),
    ("(func $eos-token (result i32))", "(func $eos-token (result i64))"),
    ("(call $log-u32 (call $eos-token))", "(call $log-u32 (i32.wrap_i64 (call $eos-token)))"),
]


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        (  # an import whose type changed without a version bump
            EOS_U64,
            "import aici:controller/tokenizer@0.1.0#eos-token has `func() -> u64`, "
            "but this host expects `func() -> u32`",
        ),
        (  # a renamed record field inside mid-process's result type
            [('"ff-tokens"', '"ff-token"')],
            "export aici:controller/controller@0.1.0#[method]runner.mid-process has a "
            "signature that differs from this host's at `...",
        ),
    ],
)
def test_signature_mismatch_is_refused(
    tmp_path: Path, edits: list[tuple[str, str]], message: str
) -> None:
    text = CONTROLLER.read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "edited.wat"
    path.write_text(text)
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(path, cache_dir=tmp_path)
    assert message in str(info.value)
    assert str(info.value).endswith("rebuild against wit/controller.wit")


def test_invalid_binary_names_the_cause(tmp_path: Path) -> None:
    path = tmp_path / "cut.wasm"
    path.write_bytes(b"\0asm\x0d\0\x01\0garbage")
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(path, cache_dir=tmp_path)
    assert str(info.value) == (
        f"{path} is not a valid WebAssembly component: unexpected end-of-file (at offset 0xa)"
    )
