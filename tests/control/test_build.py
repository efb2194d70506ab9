"""`build_controller`: one real componentize-py build, loaded and run in wasmtime.

The build (about 7-12 s) and the component's compilation (about 6-15 s) happen once per
module; the bad-source tests fail before componentize-py runs and take milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import wasmtime
from aici_controller.testing import StubHost
from paths import CONTROLLERS, DATA, GUESTS, ROOT
from wasmtime import component as wc

from aici_cli.control.componentize import (
    BuildError,
    BuildResult,
    build_controller,
    toolchain,
    wit_text,
)
from aici_cli.control.componentize import python as build

EXPORT = "aici:controller/controller@0.2.0"
IMPORTS = {
    "aici:controller/types@0.2.0",  # types only: the host defines an empty instance
    "aici:controller/tokenizer@0.2.0",
    "aici:controller/host@0.2.0",
    "aici:storage/storage@0.1.0",
    "aici:tools/tools@0.1.0",  # every SDK build imports it; the host links it only then
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> BuildResult:
    out = tmp_path_factory.mktemp("build") / "sub" / "yes_no.wasm"
    return build_controller(CONTROLLERS / "examples" / "yes_no.py", out)


@pytest.fixture(scope="module")
def wasm_engine() -> wasmtime.Engine:
    return wasmtime.Engine()


@pytest.fixture(scope="module")
def component(built: BuildResult, wasm_engine: wasmtime.Engine) -> wc.Component:
    return wc.Component.from_file(wasm_engine, str(built.out))


def test_build_writes_the_component(built: BuildResult) -> None:
    assert built.out.is_file() and built.out.name == "yes_no.wasm"
    assert built.size == built.out.stat().st_size > 1_000_000
    assert built.out.read_bytes()[:4] == b"\0asm"
    assert built.seconds > 0


def test_component_exports_the_runner_and_imports_only_the_contract(
    component: wc.Component, wasm_engine: wasmtime.Engine
) -> None:
    imports = component.type.imports(wasm_engine)
    assert set(imports) == IMPORTS  # no WASI at all (--stub-wasi)
    exports = component.type.exports(wasm_engine)
    assert EXPORT in exports
    runner = exports[EXPORT].ty.exports(wasm_engine)
    assert {"runner", "[constructor]runner", "[method]runner.mid-process"} <= set(runner)
    tokenizer = imports["aici:controller/tokenizer@0.2.0"].ty.exports(wasm_engine)
    assert "tokens-matching" in tokenizer
    storage = imports["aici:storage/storage@0.1.0"].ty.exports(wasm_engine)
    assert set(storage) == {"get", "set", "append"}
    tools = imports["aici:tools/tools@0.1.0"].ty.exports(wasm_engine)
    assert {"list-tools", "call-tool"} <= set(tools)


class Sequence:
    """A minimal wasmtime host around a `StubHost` (the real host lives in aici_cli)."""

    def __init__(self, wasm_engine: wasmtime.Engine, component: wc.Component,
                 stub: StubHost) -> None:
        linker = wc.Linker(wasm_engine)
        with linker.root() as root:
            with root.add_instance("aici:controller/types@0.2.0"):
                pass
            with root.add_instance("aici:controller/tokenizer@0.2.0") as tok:
                tok.add_func("vocab-size", lambda store: stub.vocab_size())
                tok.add_func("eos-token", lambda store: stub.eos_token())
                tok.add_func("tokenize", lambda store, text: stub.tokenize(text))
                tok.add_func("decode", lambda store, tokens: stub.decode(tokens))
                tok.add_func("token-bytes", lambda store, token: stub.token_bytes(token))
                tok.add_func("tokens-matching", lambda store, p: stub.tokens_matching(p))
            with root.add_instance("aici:controller/host@0.2.0") as host:
                host.add_func("log", lambda store, message: stub.log(message))
                host.add_func("set-output", lambda store, key, value: stub.set_output(key, value))
                host.add_func("set-line-output",
                              lambda store, key, value: stub.set_line_output(key, value))
            with root.add_instance("aici:storage/storage@0.1.0") as storage:
                storage.add_func("get", lambda store, key: stub.storage_get(key))
                storage.add_func("set", lambda store, key, value: stub.storage_set(key, value))
                storage.add_func("append",
                                 lambda store, key, value: stub.storage_append(key, value))
            with root.add_instance("aici:tools/tools@0.1.0") as tools:
                tools.add_func("list-tools", lambda store: [])
                tools.add_func("call-tool", lambda store, name, arguments: wc.Variant(
                    "err", f"tool_not_allowed: tool {name!r} is not on --allow-tool"))
        self.store = wasmtime.Store(wasm_engine)
        instance = linker.instantiate(self.store, component)
        ifc = component.get_export_index(EXPORT)
        assert ifc is not None
        ctor = component.get_export_index("[constructor]runner", ifc)
        method = component.get_export_index("[method]runner.mid-process", ifc)
        assert ctor is not None and method is not None
        self._ctor = instance.get_func(self.store, ctor)
        self._mid_process = instance.get_func(self.store, method)
        self.runner: Any = None

    def start(self, arg: str, prompt: list[int]) -> None:
        assert self._ctor is not None
        self.runner = self._ctor(self.store, arg, prompt)

    def mid_process(self, backtrack: int, tokens: list[int], segment_text: str | None,
                    branch: int | None = None) -> Any:
        """The action as a `Variant`, or the error message (`str`)."""
        step = wc.Record()
        step.backtrack = backtrack
        step.tokens = tokens
        setattr(step, "segment-text", segment_text)  # a WIT field name with a hyphen
        step.branch = branch
        assert self._mid_process is not None
        return self._mid_process(self.store, self.runner, step)


def test_component_runs_yes_no_in_wasmtime(
    component: wc.Component, wasm_engine: wasmtime.Engine
) -> None:
    stub = StubHost()
    seq = Sequence(wasm_engine, component, stub)
    seq.start('{"question": "Is the sky blue?"}', stub.tokenize("Q: "))

    action = seq.mid_process(0, [], None)
    assert action.tag == "splice"
    ff = getattr(action.payload, "ff-tokens")
    assert action.payload.backtrack == 0 and stub.decode(ff) == " Answer: "

    action = seq.mid_process(0, ff, None)  # the splice's echo
    assert action.tag == "generate"
    segment = action.payload
    assert getattr(segment, "max-tokens") == 256 and segment.stop == []
    assert segment.grammar.tag == "choice" and segment.grammar.payload == ["yes", "no"]

    action = seq.mid_process(0, stub.tokenize("yes"), "yes")
    assert action.tag == "splice"
    action = seq.mid_process(0, getattr(action.payload, "ff-tokens"), None)
    assert action.tag == "generate" and action.payload.grammar.tag == "regex"
    action = seq.mid_process(0, stub.tokenize("Blue.\n"), "Blue.\n")
    assert action.tag == "stop"
    assert stub.outputs == {"answer": "yes", "reason": "Blue."}
    assert stub.logs == ["question: Is the sky blue?"]


def test_component_turns_controller_errors_into_err(
    component: wc.Component, wasm_engine: wasmtime.Engine
) -> None:
    stub = StubHost()
    seq = Sequence(wasm_engine, component, stub)
    seq.start("{not json", [])
    error = seq.mid_process(0, [], None)
    assert isinstance(error, str) and error.startswith("ValueError: the controller arg is not JSON")
    assert stub.logs[-1].startswith("controller error: ValueError")
    assert "yes_no.py:" in stub.logs[-1]  # the user's frame, named after the source file
    again = seq.mid_process(0, [], None)  # the store still works: an Err is not a trap
    assert isinstance(again, str) and again.startswith("the controller already failed")


# --- failures before componentize-py runs (fast) -----------------------------------

GOOD_HEADER = "from aici_controller import TokenController, controller, stop\n\n"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def f(:\n", "bad.py:1: syntax error"),
        ("x = 1\n", "does not define a controller: decorate a generator function or a "),
        (
            GOOD_HEADER + "@controller\ndef a(ctx):\n    yield stop()\n\n"
            "@controller\ndef b(ctx):\n    yield stop()\n",
            "defines 2 controllers, a (line 4), b (line 8): define exactly one",
        ),
        (
            GOOD_HEADER + "@controller\ndef f(ctx):\n    return stop()\n",
            "bad.py:3: @controller function 'f' is not a generator function",
        ),
        (
            GOOD_HEADER + "@controller\ndef f(ctx):\n    def inner():\n        yield 1\n"
            "    return inner\n",
            "'f' is not a generator function",
        ),
        (
            GOOD_HEADER + "@controller\nasync def f(ctx):\n    yield stop()\n",
            "@controller function 'f' is async",
        ),
        (
            GOOD_HEADER + "@controller\nclass C:\n    def step(self, ctx, t):\n"
            "        return stop()\n",
            "@controller class 'C' must subclass TokenController",
        ),
        (
            GOOD_HEADER + "@controller()\ndef f(ctx):\n    yield stop()\n",
            "bad.py:3: use @controller without parentheses",
        ),
        (
            "import aici_controller as ac\n\n@ac.controller\ndef f(ctx):\n    return 1\n",
            "'f' is not a generator function",
        ),
        (
            "from aici_controller import controller as ctl\n\n@ctl\ndef f(ctx):\n    return 1\n",
            "'f' is not a generator function",
        ),
    ],
)
def test_bad_sources_fail_with_clear_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, message: str
) -> None:
    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("componentize-py must not run for a bad source")

    monkeypatch.setattr(toolchain.subprocess, "run", no_run)
    src = tmp_path / "bad.py"
    src.write_text(source, encoding="utf-8")
    with pytest.raises(BuildError) as info:
        build_controller(src, tmp_path / "out.wasm")
    assert message in str(info.value)
    assert not (tmp_path / "out.wasm").exists()


def test_good_sources_pass_the_check(tmp_path: Path) -> None:
    src = tmp_path / "ok.py"
    src.write_text(
        GOOD_HEADER + "@controller\nclass C(TokenController):\n    def step(self, ctx, t):\n"
        "        return stop()\n",
        encoding="utf-8",
    )
    assert build.check_source(src) == "C"
    for name in ("yes_no", "no_lowercase", "profile", "rewrite", "vote"):
        assert build.check_source(CONTROLLERS / "examples" / f"{name}.py")


def test_missing_and_non_python_sources(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="nope.py: no such file"):
        build_controller(tmp_path / "nope.py", tmp_path / "out.wasm")
    (tmp_path / "c.txt").write_text("x", encoding="utf-8")
    with pytest.raises(BuildError, match=r"not a Python file \(\.py\)"):
        build_controller(tmp_path / "c.txt", tmp_path / "out.wasm")


def test_missing_componentize_py_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        BuildError, match="^componentize-py not found: pip install componentize-py$"
    ):
        build_controller(CONTROLLERS / "examples" / "yes_no.py", tmp_path / "out.wasm")


def test_wit_dir_without_wit_files_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="no .wit files"):
        build_controller(CONTROLLERS / "examples" / "yes_no.py", tmp_path / "o.wasm", tmp_path)


def test_wit_text_is_the_contract_and_its_dependencies(tmp_path: Path) -> None:
    controller_wit = (ROOT / "wit" / "controller.wit").read_text(encoding="utf-8")
    storage_wit = (ROOT / "wit" / "deps" / "storage" / "storage.wit").read_text(encoding="utf-8")
    tools_wit = (ROOT / "wit" / "deps" / "tools" / "tools.wit").read_text(encoding="utf-8")
    assert wit_text() == (f"// wit/controller.wit\n{controller_wit}\n"
                          f"// wit/deps/storage/storage.wit\n{storage_wit}\n"
                          f"// wit/deps/tools/tools.wit\n{tools_wit}")
    assert "package aici:controller@0.2.0;" in controller_wit
    assert "import aici:storage/storage@0.1.0;" in controller_wit
    assert "import aici:tools/tools@0.1.0;" in controller_wit
    assert "package aici:storage@0.1.0;" in storage_wit
    assert "package aici:tools@0.1.0;" in tools_wit
    written = toolchain.write_wit(tmp_path / "wit")
    assert [p.relative_to(tmp_path).as_posix() for p in written] == [
        "wit/controller.wit", "wit/deps/storage/storage.wit", "wit/deps/tools/tools.wit"]
    assert written[1].read_text(encoding="utf-8") == storage_wit
    assert written[2].read_text(encoding="utf-8") == tools_wit


def test_build_command_stubs_wasi_and_renames_the_export() -> None:
    cmd = build.build_command("cpy", Path("w"), Path("e"), Path("s"), Path("o.wasm"))
    assert cmd == [
        "cpy", "-d", "w", "-w", "controller-world",
        "--export-interface-name", f"{EXPORT}=aici_runner",
        "componentize", "aici_runner", "--stub-wasi", "-p", "e", "-p", "s", "-o", "o.wasm",
    ]  # fmt: skip


# What componentize-py 0.25.1 printed for a class decorated with @controller that does not
# subclass TokenController (trimmed Rust backtrace).
COMPONENTIZE_FAILURE = """
Traceback (most recent call last):
  File "/work/.venv/bin/componentize-py", line 6, in <module>
    sys.exit(script())
             ^^^^^^^^
AssertionError: Traceback (most recent call last):
  File "/0/aici_runner.py", line 8, in <module>
    CONTROLLER = find_controller(_wit.load_user_module(_SOURCE, 'bad.py', 'aici_user_controller'))
                                 ~~~~~~~~~~~~~~~~~~~~~^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/0/aici_controller/_wit.py", line 130, in load_user_module
    exec(compile(source, filename, "exec"), module.__dict__)
    ~~~~^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "bad.py", line 3, in <module>
    @controller
     ^^^^^^^^^^
  File "/0/aici_controller/_controller.py", line 199, in _check_class
    raise TypeError(
    ...<2 lines>...
    )
TypeError: @controller class 'X' must subclass aici_controller.TokenController


Caused by:
    TypeError: @controller class 'X' must subclass aici_controller.TokenController

Stack backtrace:
   0: <anyhow::Error>::msg::<alloc::string::String>
   1: anyhow::__private::format_err
"""


def test_componentize_errors_keep_the_user_frame_and_the_exception() -> None:
    assert build.componentize_error(COMPONENTIZE_FAILURE) == (
        '  File "bad.py", line 3, in <module>\n'
        "TypeError: @controller class 'X' must subclass aici_controller.TokenController"
    )
    assert build.componentize_error("error: world `x` not found\n") == "error: world `x` not found"
    assert build.componentize_error("") == "componentize-py failed without output"


# --- a component of contract 0.1.0 still runs ---------------------------------------

RAW_V010 = GUESTS / "raw_v010.py"


@pytest.fixture(scope="module")
def built_v010(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/guests/raw_v010.py built the way `aici-batch build` built components before
    contract 0.2.0: componentize-py against the 0.1.0 WIT, without the SDK."""
    out = tmp_path_factory.mktemp("v010") / "raw_v010.wasm"
    cmd = build.build_command(build._componentize_py(), DATA / "wit-0.1.0",
                              RAW_V010.parent, RAW_V010.parent, out)
    cmd = [c.replace(f"{EXPORT}=aici_runner", "aici:controller/controller@0.1.0=raw_v010")
           .replace("aici_runner", "raw_v010") for c in cmd]
    proc = toolchain.subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.subprocess
def test_a_0_1_0_component_still_loads_and_runs(tiny_model_dir: Path, built_v010: Path,
                                                tmp_path: Path) -> None:
    from click.testing import CliRunner

    from aici_cli.cli.main import main
    from aici_cli.control.wasm import ControllerComponent

    loaded = ControllerComponent.load(built_v010)
    assert loaded.contract.version == "0.1.0"
    assert "aici:storage/storage@0.1.0" not in loaded._component.type.imports(
        loaded._shared.wasm_engine)
    lines = [{"prompt": "Hello there"}, {"prompt": "Bye", "controller_arg": "5"}]
    res = CliRunner().invoke(main, [
        "run", "-", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
        "--controller", str(built_v010), "-q",
    ], input="".join(json.dumps(line) + "\n" for line in lines))
    assert res.exit_code == 0, res.output
    results = {r["index"]: r for r in map(json.loads, res.stdout.splitlines())}
    for index, samples in ((1, 3), (2, 5)):
        r = results[index]
        assert r["finish_reason"] == "stop" and r["text"].startswith(" v1:")
        assert r["outputs"] == {"calls": 2 + samples}
        assert r["stats"]["output_tokens"] == len(tokenize(tiny_model_dir, " v1:")) + samples
        assert r["logs"].startswith("prompt tokens: ")
        assert "branches" not in r and "choices" not in r


def tokenize(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)
                ["input_ids"])
