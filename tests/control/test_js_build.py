"""`aici-batch build x.js`: the JavaScript toolchain (componentize-js) behind the same command.

Most failures are found before componentize-js runs (milliseconds); one real build checks
that the SDK's check of the default export fails the build with its own message (~15 s).
A good build is tested in `test_js_controllers.py`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from paths import ROOT

from aici_cli.cli.main import main
from aici_cli.control.componentize import BuildError, build_controller
from aici_cli.control.componentize import js as build_js
from aici_cli.control.componentize.js import (
    DISABLED_FEATURES,
    JsToolchain,
    build_command,
    check_js_source,
    componentize_js_error,
    find_toolchain,
    glue_file,
)
from aici_cli.control.componentize.toolchain import contract_version

JS = ROOT / "controllers" / "js"
YES_NO = JS / "examples" / "yes_no.js"
INSTALL = "run `make setup` or `npm ci --prefix controllers/js` (needs node >= 18 and npm)"


def no_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("componentize-js must not run for a bad source")

    monkeypatch.setattr(build_js.subprocess, "run", refuse)


def sdk_copy(tmp_path: Path) -> Path:
    """A controllers/js without node_modules (as in a checkout before `make setup`)."""
    root = tmp_path / "js"
    shutil.copytree(JS / "sdk", root / "sdk")
    shutil.copy(JS / "package.json", root / "package.json")
    return root


# --- the toolchain -----------------------------------------------------------------


def test_without_node_the_build_is_a_one_line_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no node on it
    res = CliRunner().invoke(main, ["build", str(YES_NO), "-o", str(tmp_path / "x.wasm")])
    assert res.exit_code == 2
    assert res.output == (
        "Error: node not found: JavaScript controllers need node and componentize-js; "
        f"{INSTALL}\n"
    )
    assert not (tmp_path / "x.wasm").exists()


def test_without_componentize_js_the_error_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "node").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "node").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    root = sdk_copy(tmp_path)
    with pytest.raises(BuildError) as info:
        find_toolchain(root)
    assert str(info.value) == f"componentize-js not found in {root / 'node_modules'}: {INSTALL}"
    # Another version than the pin: the same advice.
    package = root / "node_modules" / "@bytecodealliance" / "componentize-js"
    (package / "src").mkdir(parents=True)
    (package / "src" / "cli.js").write_text("")
    (package / "package.json").write_text(json.dumps({"version": "0.1.0"}))
    pinned = json.loads((JS / "package.json").read_text())["devDependencies"][build_js.PACKAGE]
    with pytest.raises(BuildError, match=rf"^componentize-js 0\.1\.0 is installed but "
                       rf"controllers/js/package.json pins {pinned}: run `make setup`"):
        find_toolchain(root)
    with pytest.raises(BuildError, match="the JavaScript SDK was not found"):
        find_toolchain(tmp_path / "elsewhere")


def test_the_pin_is_exact_and_locked() -> None:
    package = json.loads((JS / "package.json").read_text())
    lock = json.loads((JS / "package-lock.json").read_text())
    for name, version in package["devDependencies"].items():
        assert version[0].isdigit(), f"{name} {version}: pin an exact version"
        assert lock["packages"][f"node_modules/{name}"]["version"] == version
    assert "node_modules/" in (JS / ".gitignore").read_text().split()


# --- the source, before componentize-js runs ----------------------------------------


@pytest.mark.parametrize(
    ("name", "source", "message"),
    [
        ("plain.js", "export const x = 1;\n", "plain.js has no default export: write `export "
         "default function* (ctx) { ... }` or `export default class extends TokenController"),
        ("__aici_entry__.js", "export default 1;\n", "the names __aici* and aici-controller "
         "are reserved by the build"),
    ],
)
def test_bad_sources_fail_before_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str, message: str
) -> None:
    no_subprocess(monkeypatch)
    src = tmp_path / name
    src.write_text(source, encoding="utf-8")
    with pytest.raises(BuildError) as info:
        build_controller(src, tmp_path / "out.wasm")
    assert message in str(info.value)
    assert not (tmp_path / "out.wasm").exists()


def test_missing_non_utf8_and_unknown_sources(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="nope.js: no such file"):
        build_controller(tmp_path / "nope.js", tmp_path / "out.wasm")
    (tmp_path / "latin.mjs").write_bytes(b"export default 1; // caf\xe9\n")
    with pytest.raises(BuildError, match=r"latin\.mjs: not UTF-8 text"):
        check_js_source(tmp_path / "latin.mjs")
    (tmp_path / "c.ts").write_text("x", encoding="utf-8")
    with pytest.raises(BuildError, match=r"not a Python file \(\.py\) or a JavaScript module "
                       r"\(\.js, \.mjs\)"):
        build_controller(tmp_path / "c.ts", tmp_path / "out.wasm")


@pytest.mark.subprocess
def test_a_syntax_error_names_the_file_and_line_without_a_build(
    tmp_path: Path, js_toolchain: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    real_run = subprocess.run

    def only_node_check(cmd: list[str], **kwargs: object) -> object:
        calls.append(cmd)
        assert cmd[1] == "--check", "componentize-js must not run for a syntax error"
        return real_run(cmd, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(build_js.subprocess, "run", only_node_check)
    src = tmp_path / "broken.js"
    src.write_text("export default function* (ctx) {\n  yield fixed(;\n}\n", encoding="utf-8")
    with pytest.raises(BuildError) as info:
        build_controller(src, tmp_path / "out.wasm")
    assert str(info.value) == f"{src}:2: SyntaxError: Unexpected token ';'"
    assert len(calls) == 1


# --- contract versions, the command, its errors ---------------------------------------


def test_the_bindings_follow_the_contract_version(tmp_path: Path) -> None:
    assert contract_version(ROOT / "wit") == "0.2.0"
    assert glue_file("0.1.0") == JS / "sdk" / "wit" / "v0_1_0.js"
    assert glue_file("0.2.0") == JS / "sdk" / "wit" / "v0_2_0.js"
    (tmp_path / "c.wit").write_text("package aici:controller@9.9.9;\n")
    assert contract_version(tmp_path) == "9.9.9"
    with pytest.raises(BuildError, match=r"no bindings for aici:controller@9\.9\.9 \(it has "
                       r"0\.1\.0, 0\.2\.0\)"):
        glue_file("9.9.9")
    (tmp_path / "c.wit").write_text("package other:thing@1.0.0;\n")
    with pytest.raises(BuildError, match="no `package aici:controller@...`"):
        contract_version(tmp_path)


def test_build_command_disables_every_wasi_feature() -> None:
    tools = JsToolchain("node", Path("/cjs/cli.js"), "0.23.0")
    assert build_command(tools, ROOT / "wit", Path("o.wasm")) == [
        "node", "/cjs/cli.js", "__aici_entry__.js", "--wit", str(ROOT / "wit"),
        "--world-name", "controller-world",
        "--disable", "stdio", "random", "clocks", "http", "fetch-event", "-o", "o.wasm",
    ]  # fmt: skip
    assert DISABLED_FEATURES == ("stdio", "random", "clocks", "http", "fetch-event")


# What componentize-js 0.23.0 printed when the SDK's check of the default export failed
# while Wizer evaluated the modules, and for an error at a controller's top level (paths
# shortened).
NODE_TAIL = """\
    at componentize (file:///w/componentize-js/src/componentize.js:365:11)
    at async componentizeCmd (file:///w/componentize-js/src/cli.js:9:25)
    at async file:///w/componentize-js/src/cli.js:84:7

Node.js v20.20.2
"""
HEAD = """
file:///w/componentize-js/src/componentize.js:365
    throw new Error(err);
          ^

Error: Failed to initialize component (wizer (/w/wizer-linux-x64/wizer)):
Exception while evaluating top-level script
"""
SDK_CHECK_FAILED = HEAD + """\
__aici_sdk__/session.js:80:9 TypeError: plain.js: controller plain is not a generator function
Additionally, some promises were rejected, but the rejection never handled:
Promise rejected but never handled: plain.js: controller plain is not a generator function
Stack:
  checkController@__aici_sdk__/session.js:80:9
  findController@__aici_sdk__/session.js:49:10
  controllerExport@__aici_sdk__/wit/bindings.js:20:30
  exportController@__aici_sdk__/wit/v0_1_0.js:17:10
  @__aici_entry__.js:5:43
""" + NODE_TAIL
TOP_LEVEL_ERROR = HEAD + """\
helpers.js:3:1 TypeError: can't access property "y", x is null
Additionally, some promises were rejected, but the rejection never handled:
Promise rejected but never handled: can't access property "y", x is null
Stack:
  setUp@helpers.js:3:1
  @topthrow.js:4:1
""" + NODE_TAIL
TOP_LEVEL_HERE = HEAD + """\
topthrow.js:3:1 TypeError: can't access property "y", x is null
Stack:
  @topthrow.js:3:1
""" + NODE_TAIL
MISSING_MODULE = HEAD + """\
ReferenceError: Error loading module "./missing.js" (resolved path "missing.js"): No such \
file or directory
""" + NODE_TAIL


def test_componentize_js_errors_keep_the_exception_and_the_users_frames() -> None:
    assert componentize_js_error(SDK_CHECK_FAILED) == (
        "TypeError: plain.js: controller plain is not a generator function"
    )
    assert componentize_js_error(TOP_LEVEL_ERROR) == (
        'helpers.js:3: TypeError: can\'t access property "y", x is null\n'
        "  at helpers.js:3 in setUp\n"
        "  at topthrow.js:4"
    )
    assert componentize_js_error(TOP_LEVEL_HERE) == (
        'topthrow.js:3: TypeError: can\'t access property "y", x is null'
    )
    assert componentize_js_error(MISSING_MODULE) == (
        'ReferenceError: Error loading module "./missing.js" (resolved path "missing.js"): '
        "No such file or directory"
    )
    assert componentize_js_error("Error: world `x` not found\n    at f (x.js:1:1)\n") == (
        "Error: world `x` not found"
    )
    assert componentize_js_error("") == "componentize-js failed without output"


# --- one real build that fails in the sandbox ---------------------------------------


@pytest.mark.subprocess
def test_a_bad_default_export_fails_the_build_with_the_sdk_message(
    tmp_path: Path, js_toolchain: None
) -> None:
    src = tmp_path / "plain.js"
    src.write_text('import { fixed } from "aici-controller";\n\n'
                   "export default function plain(ctx) {\n  return fixed('x');\n}\n")
    with pytest.raises(BuildError) as info:
        build_controller(src, tmp_path / "out.wasm")
    assert str(info.value) == (
        f"building {src} failed:\nTypeError: plain.js: controller plain is not a generator "
        "function: declare it `function*` and `yield` actions (fixed(...), gen(...), "
        "sample(...)); for a controller that decides every token, extend TokenController"
    )
    assert not (tmp_path / "out.wasm").exists()
