"""A service stops promptly on SIGTERM even as PID 1, which is what it is in a pod: the kernel
ignores SIGTERM for PID 1 unless the process installs a handler, and then Kubernetes would wait
out the grace period and SIGKILL every pod it stops."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import ROOT
from support.ports import free_port

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _only_child(pid: int) -> int:
    deadline = time.monotonic() + 60  # catches a hang only
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise AssertionError("unshare started no child")


def test_a_service_as_pid_1_stops_on_sigterm(redis_server, tmp_path):
    if shutil.which("unshare") is None:
        pytest.fail("util-linux `unshare` is needed to run a service as PID 1", pytrace=False)
    port = free_port()
    log = (tmp_path / "buffer.log").open("wb")
    launcher = subprocess.Popen(
        ["unshare", "--pid", "--fork", ASYNCRL, "serve", "buffer",
         "--job-file", str(ROOT / "examples" / "tiny.yaml"), "--redis-url", redis_server.url,
         "--grpc-port", str(port), "--metrics-port", "0"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    service = None
    try:
        service = _only_child(launcher.pid)  # PID 1 inside its namespace
        (ns_pids,) = [line for line in Path(f"/proc/{service}/status").read_text().splitlines()
                      if line.startswith("NSpid:")]
        assert ns_pids.split()[-1] == "1", ns_pids  # its pid in the innermost namespace
        deadline = time.monotonic() + 60
        while not _listening(port):
            assert launcher.poll() is None, (tmp_path / "buffer.log").read_text()
            assert time.monotonic() < deadline, "the buffer never listened"
            time.sleep(0.1)
        os.kill(service, signal.SIGTERM)
        # Ignored, it would never stop (nothing here sends the SIGKILL a kubelet would): the
        # limit only catches that hang. How fast it stops is not asserted.
        returncode = launcher.wait(timeout=120)
        # 130: it stopped as on Ctrl-C, through its handler (as PID 1 nothing else stops it).
        assert returncode == 130, (tmp_path / "buffer.log").read_text()
        assert not _listening(port)
    finally:
        if launcher.poll() is None:
            if service is not None:  # killing unshare alone would leave its child running
                os.kill(service, signal.SIGKILL)
            launcher.kill()
            launcher.wait()
        log.close()
