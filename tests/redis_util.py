"""A real ``redis-server`` for tests: loopback only, a free port, a temp dir, no snapshots.

CI installs the server (.ci/system-deps.sh); without it the remote tests skip, saying so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SKIP_REASON = ("redis-server is not on PATH: install it (bash .ci/system-deps.sh, or "
               "apt-get install redis-server) to run the remote-tier tests")


def server_exe() -> str | None:
    """The redis-server on PATH, or None: a test that only adds a check with it asks here."""
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A test server's process: ``kill()`` it (SIGKILL) to simulate a crash, ``stop()`` it.
    A subclass starts its process (logging to ``log_file``), then ``wait_up(probe)``."""

    def __init__(self, workdir: Path, name: str, log_name: str) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_file = self.dir / log_name
        self.name = name

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_file.read_text(errors="replace")
        return ""

    def wait_up(self, probe: Callable[[], bool], timeout: float) -> None:
        """Until ``probe()`` says the server answers (an OSError from it: not yet); the
        server's log in the error if it exits or never answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log()[-2000:]}")
            try:
                if probe():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not come up in {timeout:.0f} s: {self.log()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: the crash case (no goodbye to clients, no final save)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


class RedisServer(ServerProcess):
    """One redis-server process; ``kill()`` it to simulate a crash, ``start()`` it again."""

    def __init__(self, workdir: Path, *, appendonly: bool = False,
                 maxmemory: str | None = None) -> None:
        exe = server_exe()
        if exe is None:
            pytest.skip(SKIP_REASON)
        super().__init__(workdir, "redis-server", "redis.log")
        self.exe = exe
        self.appendonly = appendonly
        self.maxmemory = maxmemory

    def url(self, db: int = 0, **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"redis://127.0.0.1:{self.port}/{db}" + (f"?{query}" if query else "")

    def start(self) -> RedisServer:
        args = [self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir),
                "--save", "", "--protected-mode", "yes", "--daemonize", "no",
                "--logfile", str(self.log_file)]
        if self.appendonly:
            # Every write on disk before it is acknowledged: a kill -9 loses nothing acked,
            # so a restarted server shows exactly what a crashed upload left behind.
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def pong() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        self.wait_up(pong, timeout=10)
        return self

    def client(self) -> object:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)


@contextlib.contextmanager
def running(workdir: Path, **kw: object) -> Iterator[RedisServer]:
    srv = RedisServer(workdir, **kw)  # type: ignore[arg-type]
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
