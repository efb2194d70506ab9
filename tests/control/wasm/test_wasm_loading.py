"""Loading a controller component: the compile cache, and every file the host refuses
(not a component, another contract version, WASI or other host access, signatures that
differ from the contract), each with a one-line message.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_services import FakeServices
from wasmtime.component import Component
from wat import Guest, component, save, u32s

from aici_cli.control.actions import Sample, StepInput, Stop, TokenSet
from aici_cli.control.wasm import ComponentError, ControllerComponent, GuestLimits

STEP = StepInput(backtrack=0, tokens=(4,))
STOP = Guest("(call $stop)")


def run_once(comp: ControllerComponent) -> object:
    """The first answer of a new runner of `comp`."""
    return comp.instantiate("", [1, 2, 3], FakeServices()).mid_process(STEP)


# --- the compile cache ------------------------------------------------------------------


def test_compile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save(tmp_path, component(STOP))
    first = ControllerComponent.load(path, cache_dir=tmp_path)
    assert not first.cache_hit
    files = list((tmp_path / "components").glob("*.cwasm"))
    assert files == [first.cache_file]
    mtime = files[0].stat().st_mtime_ns

    loaded: list[str] = []
    real = Component.deserialize_file

    def spy(wasm_engine: object, path: str) -> Component:
        loaded.append(path)
        return real(wasm_engine, path)  # type: ignore[arg-type]

    monkeypatch.setattr(Component, "deserialize_file", staticmethod(spy))
    second = ControllerComponent.load(path, cache_dir=tmp_path)
    assert second.cache_hit and loaded == [str(files[0])]
    assert files[0].stat().st_mtime_ns == mtime
    assert run_once(second) == Stop()


def test_damaged_cache_file_is_replaced(tmp_path: Path) -> None:
    path = save(tmp_path, component(Guest("(call $sample-allow {a})", data={"a": u32s(5, 7)})))
    first = ControllerComponent.load(path, cache_dir=tmp_path)
    assert first.cache_file is not None
    first.cache_file.write_bytes(b"not a compiled component")
    again = ControllerComponent.load(path, cache_dir=tmp_path)
    assert not again.cache_hit
    assert run_once(again) == Sample(TokenSet("allow", (5, 7)))
    assert ControllerComponent.load(path, cache_dir=tmp_path).cache_hit


# --- files the host refuses ----------------------------------------------------------


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
    if binary:
        path = tmp_path / "core.wasm"
        path.write_bytes(b"\0asm\x01\0\0\0")
    else:
        path = tmp_path / "core.wat"
        path.write_text('(module (func (export "mid_process") (result i32) (i32.const 0)))')
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(path, cache_dir=tmp_path)
    assert "is not a WebAssembly component: it is a core WebAssembly module" in str(info.value)


def test_other_contract_version_is_named(tmp_path: Path) -> None:
    path = tmp_path / "v9.wat"
    path.write_text("""
        (component
          (instance $controller)
          (export "aici:controller/controller@0.9.0" (instance $controller)))
    """)
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(path, cache_dir=tmp_path)
    message = str(info.value)
    assert ("does not export aici:controller/controller@0.2.0 or "
            "aici:controller/controller@0.1.0") in message
    assert "it exports aici:controller/controller@0.9.0" in message
    assert "\n" not in message


def test_component_without_exports(tmp_path: Path) -> None:
    path = tmp_path / "empty.wat"
    path.write_text("(component)")
    with pytest.raises(ComponentError, match=r"\(it exports nothing\)"):
        ControllerComponent.load(path, cache_dir=tmp_path)


def test_wasi_import_is_refused(tmp_path: Path) -> None:
    # What componentize-py builds without --stub-wasi.
    path = tmp_path / "wasi.wat"
    path.write_text("""
        (component
          (import "wasi:cli/environment@0.2.0" (instance $env
            (export "get-arguments" (func (result (list string))))))
          (instance $controller)
          (export "aici:controller/controller@0.1.0" (instance $controller)))
    """)
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(path, cache_dir=tmp_path)
    message = str(info.value)
    assert "imports wasi:cli/environment@0.2.0" in message
    assert "no filesystem, environment, clock or network" in message
    assert "aici-batch build" in message


def test_invalid_text(tmp_path: Path) -> None:
    path = tmp_path / "broken.wat"
    path.write_text("(component (oops))")
    with pytest.raises(ComponentError, match="invalid WebAssembly text"):
        ControllerComponent.load(path, cache_dir=tmp_path)


def test_memory_cap_below_the_initial_memory_fails_at_load(tmp_path: Path) -> None:
    path = save(tmp_path, component(STOP))  # its memory starts at one 64 KiB page
    with pytest.raises(ComponentError, match="needs more memory at start than the 1 KiB cap"):
        ControllerComponent.load(path, GuestLimits(memory_bytes=1024), cache_dir=tmp_path)


# Changing the eos-token import to u64 also needs the core module's import to agree.
EOS_U64 = [
    ('(export "eos-token" (func (result u32)))', '(export "eos-token" (func (result u64)))'),
    ("(func $eos-token (result i32))", "(func $eos-token (result i64))"),
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
    ids=["import", "export"],
)
def test_signature_mismatch_is_refused(
    tmp_path: Path, edits: list[tuple[str, str]], message: str
) -> None:
    text = component(Guest("(drop (call $eos-token)) (call $stop)"))
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(save(tmp_path, text), cache_dir=tmp_path)
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


# --- what a component may import -------------------------------------------------------

_EXPORT = """
  (instance $controller)
  (export "aici:controller/controller@0.1.0" (instance $controller))
"""


def _component_importing(*imports: str) -> str:
    return "(component\n" + "\n".join(imports) + _EXPORT + ")\n"


def _instance(name: str, func: str = "get", result: str = "(list string)") -> str:
    return f'(import "{name}" (instance (export "{func}" (func (result {result})))))'


@pytest.mark.parametrize(
    ("imports", "message"),
    [
        ([_instance("wasi:filesystem/preopens@0.2.0", "get-directories")],
         "imports wasi:filesystem/preopens@0.2.0, but controllers get no filesystem"),
        ([_instance("wasi:sockets/instance-network@0.2.0", "instance-network", "u32")],
         "imports wasi:sockets/instance-network@0.2.0, but controllers get no filesystem"),
        ([_instance("wasi:cli/environment@0.2.0", "get-environment")],
         "imports wasi:cli/environment@0.2.0, but"),
        ([_instance("wasi:http/outgoing-handler@0.2.0", "handle", "u32"),
          _instance("wasi:random/random@0.2.0", "get-random-u64", "u64"),
          _instance("wasi:clocks/wall-clock@0.2.0", "now", "u64")],
         "imports wasi:clocks/wall-clock@0.2.0 (and 2 more WASI interfaces), but"),
        # beside the contract's own imports it is refused all the same
        ([_instance("aici:controller/host@0.1.0", "log", "u32"),
          _instance("wasi:filesystem/types@0.2.0", "filesystem-error-code", "u32")],
         "imports wasi:filesystem/types@0.2.0, but"),
        ([_instance("evil:os/files@1.0.0", "read")],
         "imports evil:os/files@1.0.0, which this host does not provide; this host provides "
         "only aici:controller/host@0.1.0, "),
        (['(import "getenv" (func (result string)))'],
         "imports getenv, which this host does not provide"),
        # an extra function smuggled into a contract interface
        ([_instance("aici:controller/host@0.1.0", "read-file", "string")],
         "imports aici:controller/host@0.1.0#read-file, which this host does not provide"),
    ],
)
def test_host_access_imports_are_refused_at_load(
    tmp_path: Path, imports: list[str], message: str
) -> None:
    path = tmp_path / "hostile.wat"
    path.write_text(_component_importing(*imports))
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(path, cache_dir=tmp_path)
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path} imports ")
