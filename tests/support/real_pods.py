"""Real pods on the one-node cluster (tests/e2e): the images built from this checkout, base
images, the job's names, and waiting at a real cluster's pace."""

from __future__ import annotations

import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import ROOT, waiting

CLUSTER = ROOT / "tests" / "cluster"
JOB = "e2e"
# More steps than the suite needs to act on mid-run (a step takes 1 to 7 s here): the scale
# test suspends the job and resumes it with maxSteps a few steps ahead (`Job.max_steps`).
MAX_STEPS = 1000
RELEASE = "asyncrl"
OPERATOR_NAMESPACE = "asyncrl-system"


# --------------------------------------------------------------------------- helpers


def wait_for(predicate, timeout: float, what: str, describe=None):
    """support.waiting.wait_for at a real cluster's pace, once a second (each look is API calls
    or a kubectl); on timeout the failure shows `describe()` (cluster state for the reader)."""
    return waiting.wait_for(predicate, timeout, what, describe, every=1)


def pod_metrics(address: str, timeout: float = 30) -> dict[str, float]:
    """A pod's Prometheus samples by name, each summed over its labels, read from its own
    endpoint `address` (host:port; the node's pod network is routed from the host, so no proxy
    is asked: one would not reach it). OSError (URLError among them) when it does not answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = opener.open(f"http://{address}/metrics", timeout=timeout).read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


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
