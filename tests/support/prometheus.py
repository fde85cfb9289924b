"""A real Prometheus for the dashboard tests (tests/chart, tests/e2e): its binary, a client for
its query API, stopping the processes a test started, and what a run must show before every
dashboard panel has data (READY)."""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support import ROOT

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
TINY = ROOT / "examples/tiny.yaml"
JOB = "tiny"
# Enough for every panel: a few steps (step time, throughput, staleness), weight updates
# applied by the rollout worker (latency), and the trainer's first evaluation (accuracy).
READY = {
    'asyncrl_trainer_steps_total{rljob="tiny"} >= 3': "three trainer steps",
    'asyncrl_rollout_weight_updates_total{rljob="tiny",result="success"} >= 2':
        "two weight updates applied by the rollout worker",
    'asyncrl_trainer_eval_accuracy_ratio{rljob="tiny"}': "an evaluation",
}


def prometheus_binary() -> str:
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not os.access(binary, os.X_OK):
        pytest.fail("prometheus is not installed (Debian package prometheus); install it with: "
                    "bash scripts/setup.sh", pytrace=False)
    return binary


def stop(process: subprocess.Popen | None, sig: int, timeout: float) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


def tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return "(no output)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Prometheus:
    def __init__(self, base: str):
        self.http = httpx.Client(base_url=base, timeout=10)

    def query(self, expr: str) -> list[dict]:
        reply = self.http.get("/api/v1/query", params={"query": expr}).json()
        if reply["status"] != "success":
            raise AssertionError(f"Prometheus rejected {expr!r}: {reply.get('error')}")
        return reply["data"]["result"]

    def failure(self, expr: str) -> str | None:
        """Why `expr` has no data yet, or None."""
        result = self.query(expr)
        if not result:
            return "empty result"
        if all(math.isnan(float(series["value"][1])) for series in result):
            return f"only NaN ({len(result)} series)"
        return None
