"""`aici-batch run --ray ray://HOST:PORT` through a real Ray Client server: a head started
with `ray start --head --ray-client-server-port`, as a user's cluster is, and the installed
command as its client. The results equal a local run's (fp32), line for line.

The head gets a temp dir of its own, so that `ray.init()` elsewhere in the suite never finds
it, and is stopped by killing its process group (never `ray stop`, which would stop every
Ray instance on the machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_runs import aici_batch, results_in, run, token_counts, without_stats, write_input

pytest.importorskip("ray")
pytestmark = pytest.mark.ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the Ray Client server did not listen on {port} in {timeout:.0f} s")


@pytest.fixture(scope="module")
def client_address() -> Iterator[str]:
    """A Ray head with its client server, on free ports, for this module."""
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        pytest.skip("the `ray` command is not installed")
    # Short: Ray's unix socket paths under it must stay within 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="aray", dir="/tmp")
    gcs, client = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", f"--port={gcs}",
         f"--ray-client-server-port={client}", "--num-cpus=2", "--include-dashboard=false",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_port(client, head, timeout=180)
        yield f"ray://127.0.0.1:{client}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_run_through_ray_client_equals_the_local_run(client_address: str,
                                                       tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    src, local_out, out = tmp_path / "in.jsonl", tmp_path / "local.jsonl", tmp_path / "out.jsonl"
    write_input(src, 12)
    assert run(src, local_out, tiny_model_dir, workers=None).exit_code == 1  # the bad lines
    # The client's environment sets no RAY_AUTH_MODE: the head requires its token (Ray's
    # default for clusters it starts), which the command must send on its own.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    finished = subprocess.run(
        [*aici_batch(), "run", str(src), "-o", str(out), "--model", str(tiny_model_dir),
         "--device", "cpu", "--dtype", "float32", "--batch-size", "4", "--quiet",
         "--ray", client_address, "--workers", "2"],
        capture_output=True, text=True, timeout=600, env=env)
    assert finished.returncode == 1, finished.stderr  # 1: the input's two bad lines
    local, remote = results_in(local_out), results_in(out)
    assert len(remote) == 14
    assert without_stats(remote) == without_stats(local)
    assert token_counts(remote) == token_counts(local)
    workers = {r["stats"].get("worker") for r in remote.values() if r["finish_reason"] != "error"}
    assert len(workers) == 2 and None not in workers
