"""Which path a job's versions take (asyncrl.weights.paths): auto and ipc resolved from what
is known of the trainer's and the engine's devices, every other value as asked, and the job
with the path taken, as the runner, the operator and a service started by hand apply it."""

from __future__ import annotations

import pytest

from asyncrl.spec import parse_manifest
from asyncrl.weights.paths import transfer_path, with_transfer_path

PODS = "in a cluster trainer and rollout are different pods"


@pytest.mark.parametrize(("trainer", "rollout", "path", "why"), [
    ("cuda:0", "cuda:0", "ipc", ""),
    ("cuda:0", None, "ipc", ""),  # the trainer alone: the runner placed the rollout
    (None, None, "ipc", ""),  # a rollout worker by hand: the reader names a buffer elsewhere
    ("cuda:0", "cuda:1", "disk", "the trainer computes on cuda:0 and the rollout engine on "
                                 "cuda:1: ipc needs both on one GPU"),
    ("cuda:0", "cpu", "disk", "the trainer computes on cuda:0 and the rollout engine on cpu: "
                              "ipc needs both on one device"),
    ("cpu", "cuda:0", "disk", "ipc needs both on one device"),
    ("cpu", "cpu", "ipc", ""),  # shared memory
    ("cpu", None, "ipc", ""),
    ("mps", "mps", "disk", "the trainer computes on mps, and ipc shares the memory of a CUDA "
                           "GPU or of the CPU"),
    (None, "mps", "disk", "the rollout engine computes on mps"),
])
def test_ipc_is_taken_on_one_gpu_or_the_cpu_else_disk_with_the_reason(trainer, rollout, path,
                                                                      why):
    taken, reason = transfer_path("ipc", trainer, rollout)
    assert taken == path
    assert (why in reason) if why else reason == ""


@pytest.mark.parametrize(("trainer", "rollout", "engine", "path"), [
    ("cuda:0", "cuda:0", "torch", "ipc"),
    ("cuda:0", None, "torch", "disk"),  # the rollout not known here
    (None, "cuda:0", "torch", "disk"),  # the trainer not known here
    (None, None, "torch", "disk"),
    ("cuda:0", "cuda:0", "sglang", "disk"),
    ("cuda:0", "cuda:1", "torch", "disk"),
    ("cpu", "cpu", "torch", "ipc"),
    ("cpu", "cpu", "sglang", "disk"),
    ("cpu", "cuda:0", "torch", "disk"),
])
def test_auto_is_ipc_only_where_a_torch_engine_is_known_to_share_the_device(trainer, rollout,
                                                                          engine, path):
    assert transfer_path("auto", trainer, rollout, engine) == (path, "")


@pytest.mark.parametrize("requested", ["disk", "distributed"])
def test_other_transfers_are_taken_as_requested(requested):
    assert transfer_path(requested, "cpu", "cuda:0") == (requested, "")
    assert transfer_path(requested, apart=PODS) == (requested, "")


def test_trainer_and_engine_apart_never_take_ipc_whatever_their_devices():
    assert transfer_path("auto", "cuda:0", "cuda:0", apart=PODS) == ("disk", "")
    assert transfer_path("ipc", "cuda:0", "cuda:0", apart=PODS) == ("disk", PODS)


def job(**trainer):
    return parse_manifest({"apiVersion": "asyncrl.io/v1alpha1", "kind": "RLJob",
                           "metadata": {"name": "job"}, "spec": {"trainer": trainer}})


def test_the_job_gets_the_path_taken_and_the_rest_stays():
    asked = job(weightTransfer="auto", sharding="fsdp")
    shared, reason = with_transfer_path(asked, "cuda:0", "cuda:0")
    assert (shared.spec.trainer.weight_transfer, reason) == ("ipc", "")
    assert shared.spec.trainer.sharding == "fsdp"
    assert asked.spec.trainer.weight_transfer == "auto"  # the job given is left as it was
    alone, reason = with_transfer_path(asked)
    assert (alone.spec.trainer.weight_transfer, reason) == ("disk", "")
    # What a service reads back is the same job.
    assert parse_manifest(alone.resolved()) == alone

    on_cpu, reason = with_transfer_path(job(weightTransfer="ipc"), "cpu")
    assert (on_cpu.spec.trainer.weight_transfer, reason) == ("ipc", "")
    on_mps, reason = with_transfer_path(job(weightTransfer="ipc"), "mps")
    assert on_mps.spec.trainer.weight_transfer == "disk"
    assert reason == "the trainer computes on mps, and ipc shares the memory of a CUDA GPU or " \
                     "of the CPU"
    distributed = job(weightTransfer="distributed")
    assert with_transfer_path(distributed, apart=PODS) == (distributed, "")
