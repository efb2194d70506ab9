"""`--threads`: the default from the CPUs this process may use (affinity, cgroup quota),
and the count torch really uses in a run, through real `aici-batch run` processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aici_cli.run import threads


def cgroup_tree(tmp_path: Path, files: dict[str, str], proc: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc_file = tmp_path / "proc-self-cgroup"
    proc_file.write_text(proc)
    return root, proc_file


def test_cgroup_v2_quota_bounds_the_default(tmp_path: Path) -> None:
    root, proc = cgroup_tree(tmp_path, {
        "cgroup.controllers": "cpu\n", "cpu.max": "max 100000\n",
        "ci/job/cpu.max": "150000 100000\n",  # 1.5 CPUs on the job's own group
    }, "0::/ci/job\n")
    assert threads.cgroup_cpu_quota(root, proc) == pytest.approx(1.5)
    assert threads.available_cpus(root, proc) == 1  # rounded down, at least 1


def test_a_parent_groups_quota_counts_and_max_means_none(tmp_path: Path) -> None:
    root, proc = cgroup_tree(tmp_path, {
        "cgroup.controllers": "cpu\n", "ci/cpu.max": "100000 100000\n",
        "ci/job/cpu.max": "max 100000\n",
    }, "0::/ci/job\n")
    assert threads.cgroup_cpu_quota(root, proc) == pytest.approx(1.0)
    root, proc = cgroup_tree(tmp_path / "none", {
        "cgroup.controllers": "cpu\n", "cpu.max": "max 100000\n"}, "0::/\n")
    assert threads.cgroup_cpu_quota(root, proc) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root, proc = cgroup_tree(tmp_path, {
        "cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n",
    }, "1:cpu:/\n0::/\n")
    assert threads.cgroup_cpu_quota(root, proc) == pytest.approx(3.0)
    root, proc = cgroup_tree(tmp_path / "unlimited", {
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
    }, "1:cpu,cpuacct:/\n")
    assert threads.cgroup_cpu_quota(root, proc) is None


def test_the_default_is_the_affinity_and_a_users_omp_num_threads_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.default_threads() == min(len(os.sched_getaffinity(0)),
                                            threads.available_cpus())
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.default_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # not a count: ignored
    assert threads.default_threads() == threads.available_cpus()


def aici_batch() -> list[str]:
    exe = Path(sys.executable).with_name("aici-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "aici_cli"]


def run_threads(tmp_path: Path, model: Path, prefix: list[str], args: list[str],
                env: dict[str, str]) -> int:
    """The `threads` torch used in a real run (its summary), started through `prefix`."""
    src, stats = tmp_path / "in.jsonl", tmp_path / "stats.json"
    src.write_text('{"prompt": "a", "max_tokens": 2}\n')
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "AICI_BATCH_THREADS")}
    done = subprocess.run([*prefix, *aici_batch(), "run", str(src), "-q", "--model", str(model),
                           "--stats-out", str(stats), *args], capture_output=True, text=True,
                          timeout=300, env={**clean, **env})
    assert done.returncode == 0, done.stderr
    return int(json.loads(stats.read_text())["threads"])


@pytest.mark.subprocess
@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_a_run_takes_its_threads_from_its_affinity_and_from_the_option(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # One CPU in the affinity mask: the default is 1, whatever the machine has.
    assert run_threads(tmp_path, tiny_model_dir, ["taskset", "-c", "0"], [], {}) == 1
    # The option and its environment variable set torch's count, also past the CPUs.
    assert run_threads(tmp_path, tiny_model_dir, [], ["--threads", "3"], {}) == 3
    assert run_threads(tmp_path, tiny_model_dir, [], [], {"AICI_BATCH_THREADS": "1"}) == 1
