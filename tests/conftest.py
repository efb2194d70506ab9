"""Shared fixtures: one tiny random model per test session; the example controllers built
once per session; the JavaScript toolchain's presence; the `real_model` and `ray` markers;
the marks of the fast loop (`slow`, `build`, `subprocess`, `heavy`), and the check that
keeps `subprocess` exact."""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tiny_model import build_tiny_model

from aici_cli.core.cache_paths import cache_dir

if TYPE_CHECKING:
    from aici_cli.models import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
# `aici-batch run` in the tests (CliRunner in this process, and the runs they start as
# processes, which inherit it) runs its engine inline, in the run's own process: fast, and
# monkeypatches reach it. tests/test_engine_process.py runs the engine process itself.
os.environ.setdefault("AICI_BATCH_ENGINE_PROCESS", "inline")
# Loads in the tests skip the kernel probe (a child process per mode and cache folder,
# and many tests use a cache folder of their own); tests/test_kernel_probe.py and the
# kernel-path matrix (tests/test_kernel_matrix.py) run it.
os.environ.setdefault("AICI_BATCH_KERNEL_PROBE", "off")
# Set by .ci/run (after `make setup` installed the JavaScript toolchain): there the
# JavaScript tests fail instead of skipping when node or componentize-js is missing.
REQUIRE_JS = "AICI_REQUIRE_JS"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "real_model: uses the default SmolLM2 model (first run converts its GGUF, ~25 s)",
    )
    config.addinivalue_line(
        "markers",
        "ray: starts a local Ray instance (the `ray` extra); `pytest -m ray` runs these alone",
    )


# ------------------------------------------------------------------------ the fast loop
# `pytest -m "not slow"` is the loop to run while developing (docs/testing.md). A test is
# `slow` when it is marked `real_model`, `ray`, `cuda`, `build`, `subprocess` or `heavy`;
# nothing is marked `slow` by hand. `build`, `subprocess` and `heavy` are given here, at
# collection (a test function's marks cover every parameter of it):
#   - `build`: the test uses a fixture of BUILD_FIXTURES (directly or through another
#     fixture): it needs the example controllers built from source (componentize-py or
#     componentize-js, 10-15 s each, and wasmtime's first compile of a JavaScript one ~30 s
#     more) or the JavaScript toolchain;
#   - `subprocess`: the test function is named in STARTS_A_PROCESS under its module: it
#     starts a process (`aici-batch` or a Python child, the engine child, a registry
#     server, bash, node, a componentizer, or the C++ compiler through torch.compile), or
#     reads a build through `request.getfixturevalue`. The list is kept exact by
#     `_starts_no_process`: a test that is not `slow` and starts a process, or reads a
#     build, fails and says where to name it;
#   - `heavy`: the test function is named in HEAVY: the functions of the rest that take 2 s
#     or more (all their parameters together) on a quiet 2-core AMD EPYC: `pytest -m "not slow"
#     --durations=0`, the median of five runs, four of them under other load and scaled to
#     the quiet one. They are the exhaustive cross-checks (every architecture, batch order
#     or file layout against a reference) and the whole runs they repeat; each of their
#     modules keeps its quicker tests in the loop.
BUILD_FIXTURES = frozenset({"built", "built_js", "js_toolchain", "node"})
STARTS_A_PROCESS: dict[str, frozenset[str]] = {name: frozenset(tests) for name, tests in {
    "test_aligned.py": {"test_the_avx512_int8_kernel_over_misaligned_codes_runs_as_a_layer"},
    "test_build.py": {"test_a_0_1_0_component_still_loads_and_runs"},
    "test_ci_examples.py": {"test_the_github_actions_steps", "test_the_gitlab_ci_script"},
    "test_cli.py": {"test_a_bad_run_level_default_exits_two_before_the_model_loads",
                    "test_a_local_run_does_not_import_ray",
                    "test_importing_the_cli_does_not_import_torch",
                    "test_light_commands_do_not_import_torch",
                    "test_models_does_not_import_torch",
                    "test_ray_without_ray_installed_is_a_one_line_usage_error",
                    "test_report_counts_compliance_over_all_schema_lines_and_over_those_that_ran",
                    "test_shell_completion"},
    "test_compiled_decode.py": {"test_compiled_decode_gives_the_eager_tokens_in_fp32",
                                "test_one_cpu_graph_serves_every_row_count_and_a_growing_cache",
                                "test_a_one_line_run_compiles_one_row_not_the_batch",
                                "test_a_files_last_line_moves_to_the_one_row_graph_with_the_eager_tokens"},
    "test_conversion_cache.py": {
        "test_a_conversion_says_so_in_one_line_without_a_third_party_bar",
        "test_a_second_checkout_reuses_the_first_checkouts_conversion",
        "test_quiet_run_with_a_first_conversion_writes_nothing_to_stderr"},
    "test_device_check.py": {"test_device_check_smoke_runs_every_step"},
    "test_draft_gate.py": {"test_compiled_steps_draft_only_where_drafts_pay_and_keep_the_tokens"},
    "test_engine_process.py": {
        "test_a_death_at_any_step_reruns_the_lines_in_flight_with_the_same_results",
        "test_a_death_while_the_model_loads_is_one_clear_line",
        "test_a_line_that_kills_the_engine_ends_as_engine_crash_and_the_others_run",
        "test_kill_9_of_the_engine_from_outside_loses_no_line"},
    "test_fuzz_input.py": {"test_cli_survives_a_file_of_hostile_lines"},
    "test_gguf_entry.py": {"test_int4_files_differ_exactly_where_the_cpu_kernels_pack_differently"},
    "test_hostile_controllers.py": {"test_a_python_guest_gets_nothing_of_the_host",
                                    "test_memory_stays_bounded_over_many_steps"},
    "test_js_build.py": {"test_a_bad_default_export_fails_the_build_with_the_sdk_message",
                         "test_a_syntax_error_names_the_file_and_line_without_a_build"},
    "test_vnni_kernels.py": {"test_the_probe_passes_them_and_a_faulty_kernel_keeps_the_int4_one"},
    "test_js_sdk.py": {"test_the_javascript_sdk_unit_tests_pass"},
    "test_kernel_probe.py": {
        "test_a_child_that_crashes_or_computes_wrong_rejects_the_mode",
        "test_a_child_that_hangs_is_killed_and_rejects_the_mode",
        "test_a_run_falls_back_says_so_in_one_line_and_records_it",
        "test_a_verdict_is_cached_per_machine_and_mode",
        "test_auto_walks_on_to_the_next_mode_and_an_explicit_mode_is_refused",
        "test_doctor_prints_the_fingerprint_every_verdict_and_the_pick",
        "test_every_mode_passes_on_this_machine_with_a_step_time"},
    "test_live_input.py": {"test_a_slow_producer_does_not_hold_up_running_lines",
                           "test_first_sigint_lets_running_lines_finish_while_stdin_stays_open",
                           "test_first_sigint_while_waiting_for_input_stops_at_once",
                           "test_only_what_can_wait_is_read_on_a_thread"},
    "test_llama.py": {"test_a_run_imports_no_model_code_of_transformers"},
    # lm-eval's evaluation asks the compilers and conda for the environment it reports.
    "test_lm_eval.py": {"test_generation_under_a_regex_constraint",
                        "test_scores_equal_the_hf_backends",
                        "test_the_lm_eval_command_end_to_end",
                        "test_the_lm_eval_command_without_lm_eval_installed"},
    "test_model_faults.py": {"test_killed_conversion_does_not_poison_later_runs",
                             "test_real_process_prints_one_line_without_traceback"},
    "test_model_sources.py": {"test_hub_id_through_the_installed_command"},
    "test_prepare.py": {"test_prepare_leaves_the_verdicts_a_quantised_runs_first_passes_ask_for"},
    "test_oci.py": {"test_a_component_this_host_cannot_link_is_refused_at_pull_and_at_run",
                    "test_a_tampered_blob_is_a_digest_mismatch_and_nothing_is_kept",
                    "test_an_unreachable_registry_or_missing_tls_is_one_line_at_once",
                    "test_credentials_come_from_stdin_or_the_docker_config_and_a_wrong_one_"
                    "is_refused",
                    "test_later_runs_by_digest_work_offline_and_a_tag_says_which_digest_would",
                    "test_publish_pull_and_run_by_tag_and_by_digest",
                    "test_resume_refuses_results_of_another_digest_behind_the_same_tag",
                    "test_the_example_controllers_publish_and_run_by_digest_as_from_their_file"},
    "test_quantize.py": {"test_run_takes_quantize_and_refuses_it_with_deterministic"},
    "test_readme_commands.py": {"test_each_documented_command_runs"},
    "test_resume.py": {"test_a_resume_with_a_changed_option_is_refused_naming_it",
                       "test_kill_9_at_several_points_then_resume"},
    "test_run_log.py": {"test_off_a_terminal_progress_comes_as_lines_every_interval"},
    "test_run_options.py": {"test_input_left_out_reads_a_pipe_and_a_terminal_is_told_what_to_do"},
    "test_run_outputs.py": {"test_a_summary_that_cannot_be_written_after_the_run_exits_three",
                            "test_an_unwritable_path_exits_two_before_the_model_loads"},
    "test_signals.py": {"test_a_reader_going_away_ends_the_run_quietly",
                        "test_second_sigint_stops_at_once",
                        "test_sigint_then_sigterm_stop_cleanly_and_resume_finishes"},
    "test_step_parts.py": {"test_the_runner_side_never_loads_the_generation_module"},
    "test_threads.py": {"test_a_run_takes_its_threads_from_its_affinity_and_from_the_option"},
}.items()}
HEAVY: dict[str, frozenset[str]] = {name: frozenset(tests) for name, tests in {
    "test_aligned.py": {
        "test_a_converted_gguf_and_its_kept_layers_are_aligned_in_their_files_and_in_memory",
        "test_a_users_safetensors_model_hands_kernels_aligned_weights"},
    "test_architectures.py": {"test_a_gguf_run_matches_transformers",
                              "test_a_run_matches_transformers",
                              "test_next_token_logits_match_transformers"},
    "test_cache_exact.py": {"test_ragged_chunks_backtrack_and_refill_match_single_runs"},
    # `aici-batch models` hashes every installed model file: 5-35 s, as the disk allows.
    "test_conversion_cache.py": {"test_prune_removes_what_nothing_uses_and_dry_run_only_lists_it"},
    "test_deterministic.py": {"test_any_batch_order_and_cache_state_gives_the_tokens_of_batch_1",
                              "test_the_machine_check_passes_here_and_is_cached",
                              "test_tokens_and_logprobs_are_the_same_in_any_batch"},
    "test_engine.py": {"test_sampled_output_does_not_depend_on_batch_size"},
    "test_fork.py": {"test_without_the_prefix_cache_branches_recompute_and_write_the_same"},
    "test_fuzz_input.py": {"test_any_lines_become_one_job_or_precise_error_each",
                           "test_good_lines_parse_the_same_among_hostile_ones"},
    "test_gguf_entry.py": {
        "test_other_modes_build_their_files_on_first_use_and_prune_removes_them"},
    "test_grammar.py": {"test_finished_outputs_validate_on_jsonschemabench"},
    "test_hostile_controllers.py": {"test_hostile_lines_end_alone_and_the_rest_is_unchanged"},
    "test_llama.py": {"test_engine_passes_equal_transformers"},
    # Compiles the decode step (13 s where inductor's cache is cold).
    "test_masked_finish.py": {"test_compiled_steps_take_the_masked_finish_with_the_same_results"},
    "test_model_sources.py": {"test_every_layout_loads_the_same_model",
                              "test_every_layout_runs_through_the_cli"},
    "test_ordered.py": {"test_ordered_results_follow_the_input_and_resume_appends_in_order"},
    "test_packed_weights.py": {"test_a_kept_file_that_does_not_fit_is_computed_and_written_again"},
    "test_resume.py": {"test_options_that_do_not_shape_what_is_asked_are_not_refused",
                       "test_results_without_a_record_are_taken_as_made_with_this_runs_options",
                       "test_resume_repairs_a_torn_last_line"},
    "test_sampling_fields.py": {"test_drafts_stay_exact_under_penalties"},
    "test_tool_calls.py": {"test_calls_finished_early_by_the_loop_guard",
                           "test_tool_choices_through_run_in_both_formats"},
    "test_vllm_fields.py": {"test_vllm_run_batch_inputs_run_unchanged"},
}.items()}
# Loads the default model, without the `real_model` mark where it is written.
UNMARKED_REAL_MODEL = {"test_fused_linear.py": frozenset({
    "test_the_default_models_layers_stack_for_the_compiled_step"})}
SLOW_MARKERS = ("real_model", "ray", "cuda", "build", "subprocess", "heavy")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast loop's marks (above); then the `ray` tests last: a Ray driver in this
    process installs native fault handlers (SIGILL among them) over wasmtime's, so a wasm
    trap after it would kill the process. (`make test` runs them in a process of their
    own.) The sort is stable: the order within each group stays."""
    for item in items:
        if BUILD_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker("build")
        name, module = getattr(item, "originalname", item.name), item.path.name
        for mark, table in (("subprocess", STARTS_A_PROCESS), ("heavy", HEAVY),
                            ("real_model", UNMARKED_REAL_MODEL)):
            if name in table.get(module, ()):
                item.add_marker(mark)
        if any(item.get_closest_marker(mark) for mark in SLOW_MARKERS):
            item.add_marker("slow")
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)


class _ProcessStarts:
    """What the running test did that a test outside `slow` must not: processes it
    started (and builds it read), noted by the wrappers `_watch` installs."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.seen: list[str] = []

    def note(self, what: str) -> None:
        # matplotlib's first import on a machine builds its font cache with `fc-list`:
        # a one-time step of the machine, not the test's.
        if os.getpid() == self.pid and "'fc-list'" not in what:  # not in a forked child
            self.seen.append(what[:160])

    def wrap(self, owner: Any, name: str, describe: Callable[..., str]) -> None:
        original = getattr(owner, name)

        def noting(*args: Any, **kwargs: Any) -> Any:
            self.note(describe(*args, **kwargs))
            return original(*args, **kwargs)

        setattr(owner, name, noting)


PROCESS_STARTS = _ProcessStarts()


def _watch(starts: _ProcessStarts) -> None:
    """Every way a test starts a process: subprocess (run, check_output and asyncio's go
    through Popen), multiprocessing, and the os calls beneath them."""
    starts.wrap(subprocess.Popen, "__init__",
                lambda *args, **kwargs: repr(kwargs.get("args", args[1:2])))
    starts.wrap(multiprocessing.process.BaseProcess, "start",
                lambda *args, **_: f"multiprocessing {args[:1]!r}")
    for name in ("fork", "posix_spawn", "posix_spawnp"):
        starts.wrap(os, name, lambda *args, _name=name, **_: f"os.{_name}{args[:1]!r}")


_watch(PROCESS_STARTS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    PROCESS_STARTS.seen.clear()  # from here on, the test's: its fixtures, then the test
    yield


@pytest.fixture(autouse=True)
def _starts_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test outside `slow` starts no process: if it did, it fails here, naming what."""
    yield
    if PROCESS_STARTS.seen and not request.node.get_closest_marker("slow"):
        seen = "; ".join(dict.fromkeys(PROCESS_STARTS.seen))
        pytest.fail(f"this test is not marked slow but started a process or read a build "
                    f"({seen}): name it in tests/conftest.py's STARTS_A_PROCESS under "
                    f"{request.node.path.name}", pytrace=False)


# What every test shares of the cache folder: what a run makes once and that changes no
# run's output (converted models, compiled components and kernels, the machine checks'
# verdicts, OCI pulls, their locks). The compiled steps are each test's own: a package
# one test built makes a later test's `--compile auto` run start compiled, with the
# compiled step's rounding (and the draft gate's other choice), so a suite's outcome
# would hang on its order and on what `make demo` (`aici-batch prepare`) left in the
# cache before it.
SHARED_CACHE = cache_dir()
SHARED_CACHE_ENTRIES = ("models", "components", "kernel-probe", "kernels", "invariance", "oci",
                        "locks")


@pytest.fixture(autouse=True)
def _own_compiled_steps(monkeypatch: pytest.MonkeyPatch,
                        tmp_path_factory: pytest.TempPathFactory) -> None:
    """`$AICI_BATCH_CACHE` for this test (its processes inherit it): the shared entries
    linked in, an empty `compiled-steps` of its own."""
    own = tmp_path_factory.mktemp("cache", numbered=True)
    for name in SHARED_CACHE_ENTRIES:
        (SHARED_CACHE / name).mkdir(parents=True, exist_ok=True)
        (own / name).symlink_to(SHARED_CACHE / name, target_is_directory=True)
    monkeypatch.setenv("AICI_BATCH_CACHE", str(own))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Llama + byte-level BPE tokenizer with a chat template (~0.1 s to build).

    Session-scoped and shared: tests must not modify its files (copy it first).
    """
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def lm(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model loaded once for the session (fp32, cpu, ~1 s). Shared: tests must not
    change its weights or settings."""
    from aici_cli.models import load_model

    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture
def stub_conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """A private conversion cache (`tmp_path/cache`), and the ~20 s GGUF conversion
    replaced by writing a stub config; returns the GGUF files converted."""
    from aici_cli.models.gguf import convert as gguf_convert

    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []

    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(gguf)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    return calls


def require_js(problem: str | None) -> None:
    """Skip (or, with AICI_REQUIRE_JS set, fail) a JavaScript test that cannot run here."""
    if problem is None:
        return
    if os.environ.get(REQUIRE_JS):
        pytest.fail(f"{problem} ({REQUIRE_JS} is set: the JavaScript tests must run)")
    pytest.skip(problem)


@pytest.fixture(scope="session")
def node() -> str:
    """The node executable (the JavaScript SDK's unit tests need nothing else)."""
    found = shutil.which("node")
    require_js(None if found else "node not found: the JavaScript SDK's tests need node >= 18")
    assert found is not None
    return found


@pytest.fixture(scope="session")
def js_toolchain() -> None:
    """node and the pinned componentize-js (`make setup` / `npm ci --prefix controllers/js`)."""
    from aici_cli.control.build.js import toolchain_problem

    require_js(toolchain_problem())


class Builds(Mapping[str, Path]):
    """Example components by name, each built on first use (a test that needs one example
    does not wait for the others)."""

    def __init__(self, src_dir: Path, suffix: str, out_dir: Path) -> None:
        self._src_dir, self._suffix, self._out_dir = src_dir, suffix, out_dir
        self._names = tuple(sorted(p.stem for p in src_dir.glob(f"*{suffix}")))
        self._done: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self._names:
            raise KeyError(name)
        PROCESS_STARTS.note(f"the example {name}{self._suffix} built")
        if name not in self._done:
            from aici_cli.control.build import build_controller

            src = self._src_dir / f"{name}{self._suffix}"
            self._done[name] = build_controller(src, self._out_dir / f"{name}.wasm").out
        return self._done[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    """The Python examples (controllers/examples), built once per session (~10 s each)."""
    return Builds(ROOT / "controllers" / "examples", ".py", tmp_path_factory.mktemp("wasm"))


@pytest.fixture(scope="session")
def built_js(tmp_path_factory: pytest.TempPathFactory, js_toolchain: None) -> Builds:
    """The JavaScript examples (controllers/js/examples), built once per session (~15 s
    each; wasmtime's first compile of each takes ~30 s more: builds differ byte for byte,
    so each is compiled afresh)."""
    return Builds(ROOT / "controllers" / "js" / "examples", ".js",
                  tmp_path_factory.mktemp("wasm-js"))
