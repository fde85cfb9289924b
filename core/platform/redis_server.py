"""Runs a private redis-server process: the local runner's embedded Redis and the tests'.

Each instance gets its own port and data directory, so several jobs (or test sessions) never
share state by accident. With `append_only=True` every write is in the AOF before Redis
answers (appendfsync always), so a kill -9 loses nothing that was acknowledged.

With `supervised=True` (the local runner's) the process that starts it alone stops it: it
runs in its own session, so Ctrl-C in a terminal or the terminal closing reaches only that
process, which stops Redis after the services that use it; and if that process dies without
stopping it, even by kill -9, the kernel sends Redis SIGTERM (asyncrl.platform.children).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from asyncrl.platform.children import die_with_parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    def __init__(self, data_dir: Path, *, port: int | None = None, append_only: bool = True,
                 supervised: bool = False):
        # Absolute: redis-server changes into --dir before it opens --logfile.
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.append_only = append_only
        self.supervised = supervised
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server is not installed: run scripts/setup.sh (Debian package redis-server)"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
            "--save", "", "--daemonize", "no", "--protected-mode", "yes",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        if self.append_only:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        self._process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=self.supervised,
            preexec_fn=die_with_parent() if self.supervised else None)
        deadline = time.monotonic() + timeout
        while not self._answers_ping():
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)
        return self

    @property
    def returncode(self) -> int | None:
        """None while it runs (or before it started); its exit code once it ended."""
        return self._process.poll() if self._process else None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Redis finishes its AOF and exits), then SIGKILL after `timeout`."""
        if self._process and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """kill -9: what a crash looks like."""
        if self._process and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=10)

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        log = self.data_dir / "redis.log"
        if not log.exists():
            return "(no log)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()
