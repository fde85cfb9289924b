"""Real pods on the one-node cluster (tests/e2e): the images built from this checkout, base
images, the job's names, and waiting at a real cluster's pace."""

from __future__ import annotations

import subprocess

import pytest

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
