"""Real pods on the one-node cluster: the images built from this checkout, base images, waiting."""

from __future__ import annotations
import json
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path
import httpx
import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from asyncrl.platform.redis_server import free_port
from support.buffer import group_fates
from support.dashboard import expressions, load_dashboard, substitute
from test_dashboard_prometheus import READY, Prometheus, prometheus_binary, stop, tail


from support import ROOT
CLUSTER = ROOT / "tests" / "cluster"
JOB = "e2e"
# More steps than the suite needs to act on mid-run (a step takes 1 to 7 s here): the scale
# test suspends the job and resumes it with maxSteps a few steps ahead (`Job.max_steps`).
MAX_STEPS = 1000
RELEASE = "asyncrl"
OPERATOR_NAMESPACE = "asyncrl-system"


# --------------------------------------------------------------------------- helpers


def wait_for(predicate, timeout: float, what: str, describe=None):
    """Poll `predicate` until it returns something truthy; a generous deadline that only
    catches hangs. On timeout the failure shows `describe()` (cluster state for the reader)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{describe()}" if describe else ""
            pytest.fail(f"timed out after {timeout}s waiting for {what}{detail}")
        time.sleep(1)


def images() -> dict[str, tuple[str, str]]:
    """{target: (reference, tar)} of the images built from docker/Dockerfile (cached)."""
    out = subprocess.run(["bash", str(CLUSTER / "images.sh")], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"tests/cluster/images.sh failed ({out.returncode}):\n{out.stderr[-3000:]}")
    found = {}
    for line in out.stdout.splitlines():
        target, reference, tar = line.split()
        found[target] = (reference, tar)
    return found


def base_image(flavour: str) -> str:
    return subprocess.run(["bash", str(CLUSTER / "base_image.sh"), flavour], check=True,
                          capture_output=True, text=True).stdout.strip()
