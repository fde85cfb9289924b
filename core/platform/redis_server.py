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

import random
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from asyncrl.platform.children import die_with_parent


#: Where free ports are picked: below the kernel's ephemeral range (whose ports it also gives
#: outgoing connections, so one could take a port between its pick and the server's bind:
#: EADDRINUSE) and below Kubernetes' NodePort range (30000-32767).
PORT_RANGE = (20000, 30000)
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A TCP port nothing is bound to, never the same twice in one process (the caller binds it
    later, maybe in another process)."""
    low, high = PORT_RANGE[0], min(PORT_RANGE[1], _ephemeral_low())
    if high - low >= 1000:
        picker = random.Random()
        for _ in range(200):
            port = picker.randrange(low, high)
            with _handed_out_lock:
                if port not in _handed_out and _bindable(port):
                    _handed_out.add(port)
                    return port
    # A machine whose ephemeral range starts below ours: the kernel's pick, as a last resort.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """Where the kernel's range for port 0 and outgoing connections begins."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    """Free on every interface (the trainer's weights store listens on all of them)."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


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
