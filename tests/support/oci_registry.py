"""A real OCI registry for the tests: the CNCF distribution registry (Debian package
`docker-registry`), on 127.0.0.1 with a free port and a temporary storage directory,
without auth or with htpasswd (bcrypt, from apache2-utils' `htpasswd`).

Without the binary the tests that need it skip, unless AICI_REQUIRE_REGISTRY is set (as
.ci/run does after installing it): then they fail.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REQUIRE = "AICI_REQUIRE_REGISTRY"
BINARY = "docker-registry"


def require(tool: str, package: str) -> str:
    found = shutil.which(tool)
    if found is None:
        problem = f"{tool} not found (apt-get install {package})"
        if os.environ.get(REQUIRE):
            pytest.fail(f"{problem}; {REQUIRE} is set: the registry tests must run")
        pytest.skip(problem)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    """One running registry; `stop()` ends it (tests of an unreachable registry call it
    early). `storage` is its filesystem root, for tampering with blobs."""

    def __init__(self, root: Path, users: dict[str, str] | None = None) -> None:
        binary = require(BINARY, BINARY)
        self.root = root
        self.storage = root / "storage"
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        auth = ""
        if users:
            htpasswd = require("htpasswd", "apache2-utils")
            lines = [subprocess.run([htpasswd, "-Bbn", user, password], check=True,
                                    capture_output=True, text=True).stdout.strip()
                     for user, password in users.items()]
            (root / "htpasswd").write_text("\n".join(lines) + "\n")
            auth = (f"auth:\n  htpasswd:\n    realm: aici-test\n"
                    f"    path: {root / 'htpasswd'}\n")
        config = root / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n"
            + auth)
        self.log = open(root / "registry.log", "w")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen([binary, "serve", str(config)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.root / "registry.log").read_text()
                raise RuntimeError(f"docker-registry exited: {log}")
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1)
                return
            except urllib.error.HTTPError as e:  # 401: up, and asking for credentials
                if e.code == 401:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("docker-registry did not start")

    def blob_file(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (distribution's filesystem driver)."""
        hex_ = digest.split(":", 1)[1]
        return (self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / hex_[:2]
                / hex_ / "data")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
