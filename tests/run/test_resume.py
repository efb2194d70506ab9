"""`--resume` and crash safety: reading an output back, torn lines, digests, and a real
`aici-batch run` killed with SIGKILL at several points and resumed each time."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner, Result

from aici_cli.cli.main import main
from aici_cli.core.config import JobDefaults
from aici_cli.core.errors import UsageError
from aici_cli.formats.jobs import read_jobs
from aici_cli.formats.schemas import load_schema
from aici_cli.run.result_writer import ResultWriter
from aici_cli.run.resume import (
    DIGEST_FIELD,
    InputLines,
    OutputFile,
    ResumeError,
    check_input,
    line_digest,
    scan_output,
    with_digest,
)

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Alice", "Bob",
         "Paris", "London", "model", "token", "batch", "prompt", "answer", "json", "schema",
         "regex", "value", "key", "name"]


def result_line(index: int, raw: bytes, **extra: Any) -> bytes:
    obj = {"id": str(index), "index": index, DIGEST_FIELD: line_digest(raw), "text": "x",
           "finish_reason": "stop", **extra}
    return json.dumps(obj).encode() + b"\n"


# ---------------------------------------------------------------------------- digests


def test_digest_ignores_the_line_ending_only() -> None:
    assert line_digest(b'{"prompt": "a"}\n') == line_digest(b'{"prompt": "a"}')
    assert line_digest(b'{"prompt": "a"}\r\n') == line_digest(b'{"prompt": "a"}')
    assert line_digest(b'{"prompt": "a"}') != line_digest(b'{"prompt": "b"}')
    assert line_digest(b'{"prompt": "a"} ') != line_digest(b'{"prompt": "a"}')
    assert len(line_digest(b"x")) == 16 and int(line_digest(b"x"), 16) >= 0


def test_digest_goes_right_after_index() -> None:
    tagged = with_digest({"id": "a", "index": 3, "text": "t"}, "0123456789abcdef")
    assert list(tagged) == ["id", "index", DIGEST_FIELD, "text"]
    jsonschema.validate({**tagged, "finish_reason": "stop", "stats": {
        k: 0 for k in load_schema("result-line")["properties"]["stats"]["required"]}},
        load_schema("result-line"))


# ----------------------------------------------------------------------- scan_output

INPUT = [b'{"id": "a", "prompt": "x"}\n', b"\n", b'{"id": "a", "prompt": "y"}\n',
         b'{"prompt": "z"}\n']


def test_scan_reads_complete_lines() -> None:
    data = result_line(3, INPUT[2]) + result_line(1, INPUT[0], finish_reason="error")
    scan = scan_output(data, "out.jsonl")
    assert sorted(scan.done) == [1, 3]
    assert scan.done[3].out_line == 1 and scan.done[1].error and scan.errors == 1
    assert scan.keep_bytes == len(data) and scan.torn_line == 0
    assert scan_output(b"", "out.jsonl").done == {}


@pytest.mark.parametrize("tail", [
    b'{"id": "4", "index": 4, "inp',  # cut mid-write
    b'{"id": "4", "index": 4}',  # whole JSON, but no newline: the write did not finish
    b"\0\0\0\0\0\0\n",  # a page of zeros a crashed disk cache left, newline or not
    b"\0\0\0",
])
def test_scan_reports_a_torn_last_line(tail: bytes) -> None:
    good = result_line(1, INPUT[0]) + b"\n" + result_line(3, INPUT[2])
    scan = scan_output(good + tail, "out.jsonl")
    assert sorted(scan.done) == [1, 3]
    assert scan.keep_bytes == len(good)
    assert (scan.torn_line, scan.torn_bytes) == (4, len(tail))


def test_scan_drops_an_unterminated_whitespace_tail_silently() -> None:
    good = result_line(1, INPUT[0])
    scan = scan_output(good + b"  ", "out.jsonl")
    assert scan.keep_bytes == len(good) and scan.torn_line == 0


@pytest.mark.parametrize(("data", "needle"), [
    (b"garbage\n" + result_line(1, INPUT[0]), "line 1 is not a JSON result line"),
    (result_line(1, INPUT[0]) + result_line(1, INPUT[0]), "two results for input line 1"),
    (b'{"id": "1", "index": 1, "text": ""}\n', "no 'input_sha256'"),
    (b'{"id": "1", "text": ""}\n', "no valid 'index'"),
    (b'{"id": "1", "index": 0, "input_sha256": "00"}\n', "no valid 'index'"),
])
def test_scan_refuses_what_no_interrupted_run_leaves(data: bytes, needle: str) -> None:
    with pytest.raises(ResumeError) as info:
        scan_output(data, "out.jsonl")
    assert needle in str(info.value) and "out.jsonl" in str(info.value)


# ----------------------------------------------------------------------- check_input


def test_check_input_counts_non_blank_lines_and_accepts_repeated_ids() -> None:
    scan = scan_output(result_line(1, INPUT[0]) + result_line(3, INPUT[2]), "o")
    assert check_input(scan.done, INPUT, "in.jsonl", "o") == 3


def test_check_input_refuses_a_changed_line() -> None:
    scan = scan_output(result_line(3, INPUT[2]), "out.jsonl")
    changed = [*INPUT[:2], b'{"id": "a", "prompt": "Y"}\n', INPUT[3]]
    with pytest.raises(ResumeError) as info:
        check_input(scan.done, changed, "in.jsonl", "out.jsonl")
    message = str(info.value)
    assert "line 3 of in.jsonl changed" in message and "'3'" in message
    # Lines moved down by one inserted line are refused too, not silently re-matched.
    with pytest.raises(ResumeError):
        check_input(scan.done, [b"\n", *INPUT], "in.jsonl", "out.jsonl")


def test_check_input_refuses_results_past_its_end() -> None:
    scan = scan_output(result_line(4, INPUT[3]), "out.jsonl")
    with pytest.raises(ResumeError) as info:
        check_input(scan.done, INPUT[:2], "in.jsonl", "out.jsonl")
    assert "line 4" in str(info.value) and "only 2 lines" in str(info.value)


# ------------------------------------------------------------------------ InputLines


def test_input_lines_skip_done_lines_and_keep_line_numbers() -> None:
    scan = scan_output(result_line(1, INPUT[0]), "o")
    lines = InputLines(INPUT, skip=scan.done)
    jobs = list(read_jobs(lines, JobDefaults()))
    assert [j.index for j in jobs] == [3, 4]
    assert lines.exhausted
    assert lines.digests == {3: line_digest(INPUT[2]), 4: line_digest(INPUT[3])}
    tagged = lines.tag({"id": "a", "index": 3, "text": ""})
    assert tagged[DIGEST_FIELD] == line_digest(INPUT[2]) and 3 not in lines.digests


def test_input_lines_stop_when_told() -> None:
    lines = InputLines(INPUT)
    it = iter(lines)
    assert next(it) == INPUT[0]
    lines.stop = True
    assert list(it) == [] and not lines.exhausted


# ------------------------------------------------------------------------ OutputFile


def test_output_file_is_locked_and_changed_only_by_prepare(tmp_path: Path) -> None:
    path, src = tmp_path / "out.jsonl", tmp_path / "in.jsonl"
    src.write_bytes(b"".join(INPUT))
    good = result_line(1, INPUT[0])
    path.write_bytes(good + b'{"id": "3", "ind')
    first = OutputFile(str(path))
    try:
        with pytest.raises(UsageError, match="another run is writing"):
            OutputFile(str(path))
        assert path.read_bytes().startswith(good) and len(path.read_bytes()) > len(good)
        plan = first.plan(str(src))
        assert plan.total == 3 and plan.remaining == 2 and plan.scan.torn_line == 2
        first.prepare(plan)
        assert path.read_bytes() == good
        first.stream().write("appended\n")
    finally:
        first.close()
    assert path.read_bytes() == good + b"appended\n"
    second = OutputFile(str(path))  # the lock went with the first
    second.prepare(None)
    second.close()
    assert path.read_bytes() == b""


# ---------------------------------------------------------------------- ResultWriter


def test_writer_writes_each_line_in_one_os_write(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[bytes] = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, b: writes.append(bytes(b)) or real_write(fd, b))
    path = tmp_path / "out.jsonl"
    with open(path, "w", encoding="utf-8") as stream:
        writer = ResultWriter(stream, sync_interval_s=3600)
        big = {"id": "1", "index": 1, "text": "y" * 100_000}
        writer.write(big)
        writer.write({"id": "2", "index": 2, "text": "lone \ud800 surrogate"})
        writer.sync()
    assert len(writes) == 2 and all(w.endswith(b"\n") for w in writes)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0]) == big
    assert json.loads(lines[1])["text"] == "lone \ud800 surrogate"


def test_writer_fsyncs_at_most_once_per_interval(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[int] = []
    monkeypatch.setattr(os, "fsync", syncs.append)
    with open(tmp_path / "out.jsonl", "w", encoding="utf-8") as stream:
        writer = ResultWriter(stream, sync_interval_s=3600)
        for i in range(50):
            writer.write({"index": i})
        assert syncs == []
        writer.sync()
        assert len(syncs) == 1
        writer.sync()  # nothing new: no second fsync
        assert len(syncs) == 1
        eager = ResultWriter(stream, sync_interval_s=0.0)
        eager.write({"index": 99})
        assert len(syncs) == 2
    # Pipes and in-memory streams have nothing to fsync.
    ResultWriter(io.StringIO(), sync_interval_s=0.0).write({"index": 1})
    assert len(syncs) == 2


# ------------------------------------------------------------- the CLI, in process


def make_input(path: Path, n: int, seed: int = 0) -> list[bytes]:
    """`n` lines of varied prompts and lengths (so results finish out of order), plus a
    blank line, a malformed line and a repeated id; returns the raw lines."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))
        id_ = "p0" if i == n // 4 else f"p{i}"  # ids need not be unique: `index` is the key
        obj = {"id": id_, "prompt": prompt, "max_tokens": rng.randint(6, 24)}
        lines.append(json.dumps(obj).encode() + b"\n")
    lines[n // 2] = b"\n"
    lines[n // 3] = b'{"id": "broken", "prompt": \n'
    path.write_bytes(b"".join(lines))
    return lines


def invoke(args: list[str]) -> Result:
    return CliRunner().invoke(main, args)


def results_in(path: Path) -> dict[int, dict[str, Any]]:
    """The results by index, each checked against the schema; fails on a repeated index."""
    validator = jsonschema.Draft202012Validator(load_schema("result-line"))
    out: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        validator.validate(r)
        assert r["index"] not in out, f"two results for line {r['index']}"
        out[r["index"]] = r
    return out


def outcome(result: dict[str, Any]) -> tuple[str, str]:
    return result["text"], result["finish_reason"]


N_LINES = 40


@pytest.fixture(scope="module")
def model_args(tiny_model_dir: Path) -> list[str]:
    return ["--model", str(tiny_model_dir), "--dtype", "float32", "--device", "cpu",
            "--batch-size", "4"]


@pytest.fixture(scope="module")
def reference(model_args: list[str],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[list[bytes], bytes]:
    """An input and the output of an uninterrupted run over it, made once."""
    work = tmp_path_factory.mktemp("reference")
    src, ref = work / "in.jsonl", work / "ref.jsonl"
    lines = make_input(src, N_LINES)
    res = invoke(["run", str(src), "-o", str(ref), *model_args, "-q"])
    assert res.exit_code == 1, res.output  # the malformed line is an error result
    return lines, ref.read_bytes()


@pytest.fixture()
def clean_run(reference: tuple[list[bytes], bytes],
              tmp_path: Path) -> tuple[Path, list[bytes], Path]:
    """This test's own copy of the reference input and output."""
    lines, ref_bytes = reference
    src, ref = tmp_path / "in.jsonl", tmp_path / "ref.jsonl"
    src.write_bytes(b"".join(lines))
    ref.write_bytes(ref_bytes)
    return src, lines, ref


@pytest.mark.heavy
def test_resume_repairs_a_torn_last_line(clean_run: tuple[Path, list[bytes], Path],
                                         model_args: list[str], tmp_path: Path) -> None:
    src, lines, ref = clean_run
    reference = results_in(ref)
    kept = ref.read_bytes().splitlines(keepends=True)[:6]
    out = tmp_path / "out.jsonl"
    torn = ref.read_bytes().splitlines(keepends=True)[6][:40]
    out.write_bytes(b"".join(kept) + torn)

    res = invoke(["run", str(src), "-o", str(out), *model_args, "--resume"])
    assert res.exit_code == 1, res.output
    assert "incomplete last line (line 7, 40 bytes)" in res.stderr
    assert f"resuming: 6 of {N_LINES - 1} lines" in res.stderr
    assert out.read_bytes().startswith(b"".join(kept))
    results = results_in(out)
    assert sorted(results) == sorted(reference)
    for index, r in results.items():
        assert outcome(r) == outcome(reference[index])
        assert r[DIGEST_FIELD] == line_digest(lines[index - 1])


def test_resume_of_a_finished_output_runs_nothing(clean_run: tuple[Path, list[bytes], Path],
                                                  model_args: list[str]) -> None:
    src, _, ref = clean_run
    before = ref.read_bytes()
    res = invoke(["run", str(src), "-o", str(ref), *model_args, "--resume"])
    assert res.exit_code == 1  # the earlier error result still counts
    assert "running the other 0" in res.stderr
    assert ref.read_bytes() == before


def test_resume_refuses_a_changed_input(clean_run: tuple[Path, list[bytes], Path],
                                        model_args: list[str]) -> None:
    src, lines, ref = clean_run
    before = ref.read_bytes()
    edited = list(lines)
    edited[2] = edited[2].replace(b'"prompt": "', b'"prompt": "edited ')
    src.write_bytes(b"".join(edited))
    res = invoke(["run", str(src), "-o", str(ref), *model_args, "--resume"])
    assert res.exit_code == 2
    assert f"line 3 of {src} changed" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert ref.read_bytes() == before  # refused before touching anything


@pytest.mark.parametrize(("args", "needle"), [
    (["-o", "-", "--resume"], "--resume needs -o FILE"),
    (["-o", "{tmp}/o.jsonl", "--resume", "--input-dash"], "--resume needs INPUT"),
    (["-o", "{src}"], "is the input file"),
])
def test_resume_usage_errors(clean_run: tuple[Path, list[bytes], Path], model_args: list[str],
                             tmp_path: Path, args: list[str], needle: str) -> None:
    src = clean_run[0]
    before = src.read_bytes()
    source = "-" if "--input-dash" in args else str(src)
    args = [a.format(tmp=tmp_path, src=src) for a in args if a != "--input-dash"]
    res = invoke(["run", source, *args, *model_args])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr
    assert src.read_bytes() == before


# ------------------------------------------------ kill -9 a real run, resume, repeat


def aici_batch() -> list[str]:
    exe = Path(sys.executable).with_name("aici-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "aici_cli"]


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen[bytes],
             timeout: float = 180.0) -> bool:
    """Poll until `condition` holds (True) or the process ends (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    raise AssertionError("timed out waiting for the run")


@pytest.mark.subprocess
def test_kill_9_at_several_points_then_resume(clean_run: tuple[Path, list[bytes], Path],
                                              model_args: list[str], tmp_path: Path) -> None:
    src, lines, ref = clean_run
    out = tmp_path / "out.jsonl"
    reference = results_in(ref)
    expected = {i + 1 for i, raw in enumerate(lines) if raw.strip()}
    assert set(reference) == expected

    args = [*aici_batch(), "run", str(src), "-o", str(out), *model_args, "--resume", "-q"]
    # Where to kill: during start-up, then once the file holds this many results (and at
    # least one more than when the run started, so every kill lands mid-run).
    targets: list[int | None] = [None, 2, 2 * N_LINES // 3]
    kills = finished_early = 0
    snapshots: list[bytes] = []  # the complete lines present after each kill
    for target in targets:
        before = count_lines(out)
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if target is None:
            time.sleep(0.3)
            alive = proc.poll() is None
        else:
            goal = max(target, before + 1)
            alive = wait_for(lambda goal=goal: count_lines(out) >= goal, proc)
        if alive:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        _, err = proc.communicate(timeout=60)
        if alive:
            assert proc.returncode == -signal.SIGKILL
        else:
            finished_early += 1
            assert proc.returncode in (0, 1), err.decode()
        data = out.read_bytes() if out.exists() else b""
        snapshots.append(data[: data.rfind(b"\n") + 1])

    final = subprocess.run(args, capture_output=True, timeout=300)
    assert final.returncode == 1, final.stderr.decode()  # the malformed line
    assert b"Traceback" not in final.stderr

    results = results_in(out)  # also fails on any repeated index
    assert set(results) == expected
    for index, r in results.items():
        assert outcome(r) == outcome(reference[index]), index
        assert r[DIGEST_FIELD] == line_digest(lines[index - 1])
    data = out.read_bytes()
    lost = sum(
        sum(1 for line in snap.splitlines() if line not in data.splitlines())
        for snap in snapshots
    )
    assert all(data.startswith(snap) for snap in snapshots)
    print(f"\nkill -9: {kills} kills survived ({finished_early} runs finished before their "
          f"kill point), {lost} results lost, {len(results)} results, no duplicates")
    assert lost == 0
    assert kills >= 2


# ------------------------------------------------- what made a result (`made_with`)


def half_done(clean_run: tuple[Path, list[bytes], Path], tmp_path: Path) -> tuple[Path, Path]:
    """The reference run's output cut to its first 10 results: a run to resume."""
    src, _, ref = clean_run
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(ref.read_bytes().splitlines(keepends=True)[:10]))
    return src, out


def test_every_result_says_what_made_it(clean_run: tuple[Path, list[bytes], Path],
                                        tiny_model_dir: Path) -> None:
    _, _, ref = clean_run
    records = [r["made_with"] for r in results_in(ref).values()]
    # The paths where a line may depend on its neighbours: an unquantised float32 run's.
    assert {tuple(r.pop("batch_variant")) for r in records} == {
        ("attention", "dense-gemm", "compiled-steps")}
    # The model as results name it; of the options only what differs from the defaults.
    assert {json.dumps(r) for r in records} == {json.dumps({"model": tiny_model_dir.name})}


@pytest.mark.subprocess
@pytest.mark.parametrize(("option", "message"), [
    (["--max-tokens", "64"], "--max-tokens 256 (result line 1), this run has --max-tokens 64"),
    (["--temperature", "0.7"], "--temperature 0.0 (result line 1), this run has "
                               "--temperature 0.7"),
    (["--stop", "x"], "no --stop (result line 1), this run has --stop 'x'"),
    (["--choices", "yes,no"], "no --choices (result line 1), this run has --choices 'yes,no'"),
    (["--json-schema", "{schema}"], "no --json-schema (result line 1), this run has "
                                    "--json-schema (sha256:"),
    (["--no-close-at-limit"], "--close-at-limit (result line 1), this run has "
                              "no --close-at-limit"),
])
def test_a_resume_with_a_changed_option_is_refused_naming_it(
    clean_run: tuple[Path, list[bytes], Path], model_args: list[str], tmp_path: Path,
    option: list[str], message: str
) -> None:
    src, out = half_done(clean_run, tmp_path)
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "boolean"}')
    before = out.read_bytes()
    args = [a.format(schema=schema) for a in option]
    done = subprocess.run([*aici_batch(), "run", str(src), "-o", str(out), *model_args,
                           "--resume", *args], capture_output=True, text=True, timeout=300)

    assert done.returncode == 2
    expected = f"Error: --resume: {out} holds results made with {message}"
    assert done.stderr.startswith(expected), done.stderr
    assert "add --resume-mixed to mix them" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert out.read_bytes() == before  # nothing changed


def test_another_model_is_refused_once_it_is_known(
    clean_run: tuple[Path, list[bytes], Path], model_args: list[str], tiny_model_dir: Path,
    tmp_path: Path
) -> None:
    src, out = half_done(clean_run, tmp_path)
    other = Path(shutil.copytree(tiny_model_dir, tmp_path / "other-model"))
    args = [*model_args, "--model", str(other)]
    before = out.read_bytes()

    res = invoke(["run", str(src), "-o", str(out), *args, "--resume"])

    assert res.exit_code == 2
    assert (f"--resume: {out} holds results made with --model {tiny_model_dir.name} (result "
            "line 1), this run has --model other-model") in res.stderr
    assert out.read_bytes() == before


def test_another_quantization_is_refused_once_it_is_known(
    clean_run: tuple[Path, list[bytes], Path], model_args: list[str], tmp_path: Path
) -> None:
    """Quantized weights change the logits as another model does: results made at one
    quantization are not resumed at another (`--quantize auto` resolves per model, so
    this is checked once the model has loaded)."""
    src, out = half_done(clean_run, tmp_path)
    before = out.read_bytes()

    res = invoke(["run", str(src), "-o", str(out), *model_args, "--resume",
                  "--quantize", "int8"])

    assert res.exit_code == 2
    assert (f"--resume: {out} holds results made with --quantize none (result line 1), "
            "this run has --quantize int8") in res.stderr
    assert out.read_bytes() == before


@pytest.mark.heavy
@pytest.mark.parametrize("option", [
    ["--batch-size", "2"], ["--no-prefix-cache"], ["--draft-tokens", "0"], ["--no-ff"],
    ["--lookahead", "1"], ["--deterministic"], ["--step-stats"], ["--dtype", "float32"],
])
def test_options_that_do_not_shape_what_is_asked_are_not_refused(
    clean_run: tuple[Path, list[bytes], Path], model_args: list[str], tmp_path: Path,
    option: list[str]
) -> None:
    src, out = half_done(clean_run, tmp_path)
    res = invoke(["run", str(src), "-o", str(out), *model_args, "--resume", "-q", *option])
    assert res.exit_code == 1, res.output  # the malformed line's error result
    assert len(results_in(out)) == N_LINES - 1


def test_resume_mixed_keeps_both_and_says_so(clean_run: tuple[Path, list[bytes], Path],
                                             model_args: list[str], tmp_path: Path,
                                             tiny_model_dir: Path) -> None:
    src, out = half_done(clean_run, tmp_path)
    res = invoke(["run", str(src), "-o", str(out), *model_args, "--resume", "--resume-mixed",
                  "--max-tokens", "3"])
    assert res.exit_code == 1, res.output
    assert (f"--resume-mixed: {out} holds results made with --max-tokens 256 (result line 1), "
            "this run has --max-tokens 3; the new results are added beside them") in res.stderr
    # `batch_variant` says how a result was computed, not what was asked: left aside.
    made = [{k: v for k, v in r["made_with"].items() if k != "batch_variant"}
            for r in results_in(out).values()]
    model = tiny_model_dir.name
    assert made.count({"model": model}) == 10
    assert made.count({"model": model, "max_tokens": 3}) == N_LINES - 1 - 10


def test_resume_mixed_needs_resume(model_args: list[str], tmp_path: Path) -> None:
    res = invoke(["run", "-", *model_args, "--resume-mixed"])
    assert res.exit_code == 2 and "--resume-mixed goes with --resume" in res.stderr


@pytest.mark.heavy
def test_results_without_a_record_are_taken_as_made_with_this_runs_options(
    clean_run: tuple[Path, list[bytes], Path], model_args: list[str], tmp_path: Path
) -> None:
    src, out = half_done(clean_run, tmp_path)
    old = [json.loads(line) for line in out.read_text().splitlines()]
    for r in old:
        del r["made_with"]  # as an older aici-batch wrote them
    out.write_text("".join(json.dumps(r) + "\n" for r in old))

    res = invoke(["run", str(src), "-o", str(out), *model_args, "--resume", "--max-tokens", "5"])

    assert res.exit_code == 1, res.output
    assert (f"{out}: 10 results say nothing of the model and options that made them (an "
            "older aici-batch wrote them): they are kept as if made with this run's"
            ) in res.stderr
    assert len(results_in(out)) == N_LINES - 1


def test_made_with_records_only_what_differs_and_names_each_option() -> None:
    from aici_cli.core.config import EngineConfig, RunConfig
    from aici_cli.core.constraint import Constraint
    from aici_cli.run.made_with import DEFAULTS, mismatch, run_record

    plain = RunConfig(input="-")
    assert run_record(plain, "m", None) == {"model": "m"}
    shaped = RunConfig(input="-", defaults=JobDefaults(
        max_tokens=64, stop=("a", "b"), constraint=Constraint("regex", "[0-9]+"), n=2),
        engine=EngineConfig(strict_json=False, batch_size=1, deterministic=True),
        controller_arg='{"k": 1}')
    record = run_record(shaped, "m", "sha256:00ff")
    assert record == {"model": "m", "max_tokens": 64, "stop": ["a", "b"], "regex": "[0-9]+",
                      "n": 2, "json_permissive": True, "controller": "sha256:00ff",
                      "controller_arg": '{"k": 1}'}  # no batch size, no --deterministic
    assert set(DEFAULTS) >= set(record) - {"model"}
    assert mismatch(record, {"model": "m"}) == ("--regex '[0-9]+'", "no --regex")
    assert mismatch({**record, "regex": None}, record) == ("no --regex", "--regex '[0-9]+'")
    assert mismatch(record, {**record, "stop": ["a"]}) == ("--stop 'a' --stop 'b'",
                                                           "--stop 'a'")
    assert mismatch(record, {**record, "controller": "sha256:11"}) == (
        "--controller (sha256:00ff)", "--controller (sha256:11)")
    assert mismatch(record, dict(record)) is None


def test_made_with_says_which_dtype_ran_the_quantised_weights() -> None:
    """A quantised model's results name the activations' dtype (float32 + int4 is the int
    kernels' float32, not the model's own numbers); a resume on a machine whose `--dtype
    auto` picks the other is not refused for it."""
    from aici_cli.core.config import RunConfig
    from aici_cli.run.made_with import mismatch, run_record

    plain = RunConfig(input="-")
    four = run_record(plain, "m", None, "int4", "float32")
    assert four == {"model": "m", "quantize": "int4", "dtype": "float32",
                    "batch_variant": ["long-prompts"]}
    assert run_record(plain, "m", None, "none", "float32") == {
        "model": "m", "batch_variant": ["attention", "dense-gemm"]}
    assert mismatch(four, run_record(plain, "m", None, "int4", "bfloat16")) is None
    assert mismatch(four, run_record(plain, "m", None, "none", "float32")) == (
        "--quantize int4", "--quantize none")


def test_made_with_names_the_paths_where_a_line_may_depend_on_its_neighbours() -> None:
    """The float32 and bf16 int kernels' passes attend one token at a time (engine/
    forward/attention.py), run prompt tokens alone on dense copies in tiles of one shape,
    and their compiled step computes as they do: what is left is named (float16 attends
    on SDPA); `--deterministic` leaves nothing."""
    from dataclasses import replace

    from aici_cli.core.config import EngineConfig, RunConfig
    from aici_cli.run.made_with import run_record

    cli = RunConfig(input="-", engine=EngineConfig(compile="auto"))
    for dtype in ("bfloat16", "float32"):
        assert run_record(cli, "m", None, "int4", dtype)["batch_variant"] == ["long-prompts"]
    assert run_record(cli, "m", None, "int4", "float16")["batch_variant"] == [
        "attention", "compiled-steps"]
    assert "batch_variant" not in run_record(
        replace(cli, engine=EngineConfig(compile="auto", prefix_cache=False)), "m", None,
        "int4", "bfloat16")
    exact = replace(cli, engine=EngineConfig(compile="off", deterministic=True))
    assert "batch_variant" not in run_record(exact, "m", None, "none", "float32")
