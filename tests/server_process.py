"""Start the installed `ninfer serve` as a real process on a free loopback port (server tests, benchmarks)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: The `ninfer` program of the Python running the tests: the installed package (or, in
#: development, whatever the inherited PYTHONPATH points at, such as an in-place build).
NINFER = [sys.executable, "-m", "ninfer.cli"]


def env_with_tests_dir(environ) -> dict:
    """A copy of `environ` with tests/ (where --core-factory finds fake_core) added to PYTHONPATH;
    the package itself comes from the environment, never from the checkout's python/."""
    env = dict(environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
    return env


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running server; `url` is its base URL. Use as a context manager."""

    def __init__(self, args: list, *, ready_timeout_s: float = 120.0, wait_ready: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = env_with_tests_dir(os.environ)
        self.log_path = ROOT / "tests" / ".cache" / f"server-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*NINFER, "serve", *args, "--port", str(self.port)],
                                     env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        if wait_ready:
            self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        log = self.log()
        self.close()
        raise RuntimeError(f"server not ready after {timeout_s}s: {log}")

    def log(self) -> str:
        """Everything the server printed so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
