"""Which path a job's policy versions take (`trainer.weightTransfer`): the one place that turns
the value asked for into disk, distributed or ipc, and says why when that is not what was
asked.

    asked        taken
    auto         ipc where a torch engine is known to share the trainer's device (one GPU,
                 or the CPU of one machine), else disk
    ipc          ipc, or disk (with the reason) where the two are not on one device
    disk         disk
    distributed  distributed (which falls back to disk by itself, version by version)

It is applied before any service reads the job, so a job file says what it takes, never
auto: `asyncrl run` knows the GPUs it gave trainer and rollout; the operator's trainer and
rollout are different pods. A service started by hand on a file that still says auto applies
it at load, knowing only its own side (auto is then disk). No torch here: the operator
imports it.
"""

from __future__ import annotations

from asyncrl.spec import RLJob


def ipc_refusal(trainer_device: str | None, rollout_device: str | None,
                apart: str | None = None) -> str | None:
    """Why ipc cannot carry the weights between a trainer on `trainer_device` and an engine
    on `rollout_device` (each "cpu" or a GPU's identity such as "cuda:0" as one process sees
    every GPU; None: not known here), or None when it can: both on one GPU (CUDA IPC) or both
    on the CPU (shared memory). `apart`: why the two never share a device, whatever their
    devices (a cluster's different pods)."""
    if apart:
        return apart
    for side, device in (("trainer", trainer_device), ("rollout engine", rollout_device)):
        if device is not None and not _shareable(device):
            return (f"the {side} computes on {device}, and ipc shares the memory of a CUDA "
                    "GPU or of the CPU")
    if None in (trainer_device, rollout_device) or trainer_device == rollout_device:
        return None
    both = "one GPU" if "cpu" not in (trainer_device, rollout_device) else "one device"
    return (f"the trainer computes on {trainer_device} and the rollout engine on "
            f"{rollout_device}: ipc needs both on {both}")


def _shareable(device: str) -> bool:
    return device == "cpu" or device.startswith("cuda")


def transfer_path(requested: str, trainer_device: str | None = None,
                  rollout_device: str | None = None, engine: str = "torch",
                  apart: str | None = None) -> tuple[str, str]:
    """(the path versions take, why when it is not the requested one) for
    trainer.weightTransfer `requested`, by the table above; the arguments as ipc_refusal's."""
    if requested == "auto":
        shared = (engine == "torch" and None not in (trainer_device, rollout_device)
                  and ipc_refusal(trainer_device, rollout_device, apart) is None)
        return ("ipc" if shared else "disk"), ""
    if requested != "ipc":
        return requested, ""
    reason = ipc_refusal(trainer_device, rollout_device, apart)
    return ("disk", reason) if reason else ("ipc", "")


def with_transfer_path(job: RLJob, trainer_device: str | None = None,
                       rollout_device: str | None = None,
                       apart: str | None = None) -> tuple[RLJob, str]:
    """(`job` with trainer.weightTransfer the path taken, why when it is not the one asked
    for), for what is known here of the two devices (see transfer_path)."""
    trainer = job.spec.trainer
    path, reason = transfer_path(trainer.weight_transfer, trainer_device, rollout_device,
                                 job.spec.rollout.engine, apart)
    if path == trainer.weight_transfer:
        return job, reason
    spec = job.spec.model_copy(update={
        "trainer": trainer.model_copy(update={"weight_transfer": path})})
    return job.model_copy(update={"spec": spec}), reason
