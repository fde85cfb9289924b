"""`asyncrl run --devices`: the option, the plan of each service's devices (a pure function of
the option and the GPUs visible, so tested without one), the job as run with it, and the
run's first lines on this machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.local import runner
from asyncrl.local.devices import DevicesError, parse_devices, plan_devices
from asyncrl.local.runner import LOCAL_NODE_SELECTOR, LocalJob, RunOptions, resolve_manifest
from asyncrl.spec import load_manifest, parse_manifest
from support import ROOT

TINY = ROOT / "examples/tiny.yaml"
H200 = "NVIDIA H200"


@pytest.mark.parametrize(("text", "value"), [
    ("auto", "auto"), ("cpu", "cpu"), ("CPU", "cpu"), ("0", (0,)), ("0,1", (0, 1)),
    (" 2, 0 ", (2, 0)),
])
def test_the_option_reads_auto_cpu_or_gpu_indices(text, value):
    assert parse_devices(text) == value


@pytest.mark.parametrize(("text", "message"), [
    ("cuda", "use auto, cpu, or GPU indices"), ("0,,1", "use auto, cpu"),
    ("-1", "use auto, cpu"), ("0,0", "names a GPU twice"),
])
def test_the_option_refuses_anything_else_naming_itself(text, message):
    with pytest.raises(DevicesError, match=message) as refused:
        parse_devices(text)
    assert str(refused.value).startswith("--devices")


def test_one_gpu_is_shared_by_trainer_and_rollout():
    plan = plan_devices("auto", [H200])
    assert plan.trainer.device == plan.rollout.device == "cuda:0" and plan.shared_gpu
    assert plan.trainer.env == plan.rollout.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert plan.lines() == ["trainer: cuda:0 (NVIDIA H200)",
                            "rollout: cuda:0 (NVIDIA H200), shared with the trainer"]


def test_more_gpus_give_the_rollout_its_own():
    plan = plan_devices("auto", [H200] * 4)
    assert plan.trainer.gpus == (0,) and plan.rollout.gpus == (1,) and not plan.shared_gpu
    assert plan.rollout.env == {"CUDA_VISIBLE_DEVICES": "1"}
    # SGLang takes every GPU left; torchrun's processes one each.
    assert plan_devices("auto", [H200] * 4, rollout_engine="sglang").rollout.gpus == (1, 2, 3)
    two = plan_devices((2, 3), [H200] * 4, trainer_processes=2)
    assert two.trainer.gpus == (2, 3) and two.rollout.gpus == (3,) and two.shared_gpu
    assert two.trainer.env == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_indices_go_through_the_runners_own_cuda_visible_devices():
    plan = plan_devices((1,), [H200] * 2, cuda_visible="3,GPU-abc")
    assert plan.trainer.env == {"CUDA_VISIBLE_DEVICES": "GPU-abc"}


def test_the_cpu_when_asked_or_without_cuda_and_the_lines_say_why():
    assert plan_devices("auto", []).lines() == ["trainer: cpu (no CUDA here)",
                                                "rollout: cpu (no CUDA here)"]
    plan = plan_devices("cpu", [H200])
    assert plan.trainer.gpus == plan.rollout.gpus == ()
    assert plan.trainer.env == {"CUDA_VISIBLE_DEVICES": ""}
    assert plan.lines()[0] == "trainer: cpu (--devices cpu)"


@pytest.mark.parametrize(("option", "names", "message"), [
    ((3,), [H200], "--devices names GPU 3, but this machine shows 1 (0: NVIDIA H200); use "
                   "indices below 1, or --devices auto"),
    ((0,), [], "--devices 0: CUDA is not available here; use --devices cpu"),
])
def test_gpus_this_machine_lacks_are_refused_with_the_fix(option, names, message):
    with pytest.raises(DevicesError) as refused:
        plan_devices(option, names)
    assert str(refused.value) == message + ("" if names else " (or auto)")


def test_a_trainer_with_more_processes_than_gpus_is_refused():
    with pytest.raises(DevicesError, match="processesPerReplica 2 needs a GPU per process"):
        plan_devices((0,), [H200], trainer_processes=2)


def ipc_tiny() -> dict:
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["trainer"]["weightTransfer"] = "ipc"
    return manifest


def test_the_job_as_run_gives_each_service_its_gpus_and_keeps_ipc_on_a_shared_one(tmp_path):
    options = RunOptions(run_dir=tmp_path)
    job = resolve_manifest(ipc_tiny(), options, plan_devices("auto", [H200]))
    for section in (job.spec.trainer, job.spec.rollout):
        assert section.placement.gpus == 1
        assert section.placement.node_selector == LOCAL_NODE_SELECTOR
    assert job.spec.trainer.weight_transfer == "ipc"
    # What the services read validates as it is (no nodeSelector asked of the user).
    assert parse_manifest(job.to_manifest()) == job

    apart = resolve_manifest(ipc_tiny(), options, plan_devices("auto", [H200] * 2))
    assert apart.spec.trainer.weight_transfer == "disk"
    on_cpu = resolve_manifest(ipc_tiny(), options, plan_devices("cpu", [H200]))
    assert on_cpu.spec.trainer.placement.gpus == on_cpu.spec.rollout.placement.gpus == 0
    assert on_cpu.spec.trainer.weight_transfer == "ipc"  # shared memory


def test_the_default_transfer_is_ipc_on_a_shared_gpu_or_the_cpu_and_disk_elsewhere(tmp_path):
    options = RunOptions(run_dir=tmp_path)
    manifest = yaml.safe_load(TINY.read_text())
    assert "weightTransfer" not in manifest["spec"]["trainer"]
    assert parse_manifest(manifest).spec.trainer.weight_transfer == "auto"
    shared = resolve_manifest(manifest, options, plan_devices("auto", [H200]))
    assert shared.spec.trainer.weight_transfer == "ipc"
    two_gpus = plan_devices("auto", [H200] * 2)
    assert resolve_manifest(manifest, options, two_gpus).spec.trainer.weight_transfer == "disk"
    on_cpu = plan_devices("cpu", [H200])
    assert resolve_manifest(manifest, options, on_cpu).spec.trainer.weight_transfer == "ipc"
    local = LocalJob(parse_manifest(manifest), RunOptions(run_dir=tmp_path / "run",
                                                          devices="cpu"))
    assert [line for line in local.device_lines() if line.startswith("weights:")] == [
        "weights: ipc (shared memory)"]


def test_a_cluster_placement_is_replaced_locally(tmp_path):
    manifest = yaml.safe_load(TINY.read_text())
    pool = {"gpus": 1, "nodeSelector": {"pool": "gpu"}}
    manifest["spec"]["trainer"]["placement"] = dict(pool)
    manifest["spec"]["rollout"]["placement"] = dict(pool)
    job = resolve_manifest(manifest, RunOptions(run_dir=tmp_path), plan_devices("cpu", []))
    assert job.spec.trainer.placement.gpus == 0 == job.spec.rollout.placement.gpus


def test_the_runs_first_lines_on_this_machine(tmp_path):
    import torch

    local = LocalJob(parse_manifest(ipc_tiny()), RunOptions(run_dir=tmp_path / "run"))
    if torch.cuda.is_available():  # pragma: no cover - the CPU machines tests run on
        pytest.skip("this machine has CUDA")
    assert local.device_lines() == [
        "trainer: cpu (no CUDA here)", "rollout: cpu (no CUDA here)",
        "weights: ipc (shared memory)"]
    assert local.job.spec.trainer.weight_transfer == "ipc"


@pytest.mark.parametrize(("gpus", "asked", "taken", "line"), [
    ([H200], "auto", "ipc", "weights: ipc (CUDA IPC on cuda:0)"),
    ([H200] * 2, "auto", "disk", None),
    ([H200] * 2, "ipc", "disk", "weights: disk, not ipc (the trainer computes on cuda:0 and "
                                "the rollout engine on cuda:1: ipc needs both on one GPU)"),
    ([], "auto", "ipc", "weights: ipc (shared memory)"),
    ([], "disk", "disk", None),
    ([], "distributed", "distributed", None),
])
def test_the_job_file_says_the_path_taken_as_the_first_lines_do(tmp_path, monkeypatch, gpus,
                                                                asked, taken, line):
    """What every service reads is a path, never auto: the runner resolves it with the GPUs
    it placed the services on, before it writes the file."""
    monkeypatch.setattr(runner, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(runner, "runner_cuda_visible", lambda: None)
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["trainer"]["weightTransfer"] = asked
    local = LocalJob(parse_manifest(manifest), RunOptions(run_dir=tmp_path / "run"))
    local.write_job_file()
    written = yaml.safe_load(local.config_path.read_text())
    assert written["spec"]["trainer"]["weightTransfer"] == taken
    assert load_manifest(local.config_path) == local.job
    assert [text for text in local.device_lines() if text.startswith("weights:")] == \
        ([line] if line else [])


def test_a_sync_run_that_skips_uniform_groups_is_told_to_oversample(tmp_path):
    manifest = yaml.safe_load((ROOT / "examples/arith.yaml").read_text())
    assert manifest["spec"]["algorithm"]["skipUniformGroups"]

    def lines(sync, **algorithm):
        job = {**manifest, "spec": {**manifest["spec"],
                                    "algorithm": {**manifest["spec"]["algorithm"], **algorithm}}}
        return LocalJob(parse_manifest(job), RunOptions(run_dir=tmp_path, sync=sync)).gate_lines()

    # maxConcurrentRollouts 8, batchSize 4: four groups can run beside the batch
    assert lines(True, oversampleGroups=0) == [
        "η = 0 with skipUniformGroups: each skipped group is generated again after it, so a "
        "step may wait for several rounds; algorithm.oversampleGroups: 4 would generate them "
        "beside the batch"]
    assert lines(False, oversampleGroups=0) == lines(True, oversampleGroups=2) == []
    assert lines(True) == []  # as shipped, it oversamples
    assert lines(True, oversampleGroups=0, skipUniformGroups=False) == []


def test_asyncrl_run_refuses_gpus_it_does_not_have_before_starting_anything(tmp_path):
    import torch

    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("this machine has CUDA")
    asyncrl = str(Path(sys.executable).parent / "asyncrl")
    done = subprocess.run([asyncrl, "run", str(TINY), "--run-dir", str(tmp_path / "run"),
                           "--devices", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--devices 0: CUDA is not available here; use --devices cpu" in " ".join(
        done.stdout.split())
    assert not (tmp_path / "run").exists()


def test_trainer_and_rollout_lend_each_other_cores_where_they_are_two_on_the_cpu(tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setattr(runner, "visible_gpus", lambda: [])
    manifest = yaml.safe_load(TINY.read_text())

    def local(options: dict, **rollout) -> LocalJob:
        job = {**manifest, "spec": {**manifest["spec"],
                                    "rollout": {**manifest["spec"]["rollout"], **rollout}}}
        return LocalJob(parse_manifest(job), RunOptions(run_dir=tmp_path / "run", **options))

    lending = local({})
    assert lending.lending_file == (tmp_path / "run").resolve() / "cores"
    assert lending.lending_lines() == [
        f"cores: the trainer ({lending.trainer_threads}) and the rollout worker "
        f"({lending.rollout_threads}) compute with each other's threads while the other "
        "waits (--no-lend-cores: each keeps its own)"]
    for apart in (local({"sync": True}), local({"lend_cores": False}), local({}, replicas=2)):
        assert apart.lending_file is None and apart.lending_lines() == []
    monkeypatch.setattr(runner, "visible_gpus", lambda: [H200])
    monkeypatch.setattr(runner, "runner_cuda_visible", lambda: None)
    assert local({}).lending_file is None  # a GPU's work is not the CPU's threads
