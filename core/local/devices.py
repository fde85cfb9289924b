"""Which devices the services of `asyncrl run` compute on (`--devices`).

    auto     every GPU this machine shows CUDA (default), else the CPU
    cpu      the CPU, GPUs or not
    0 / 0,1  those GPUs (indices as `nvidia-smi` lists them, or within CUDA_VISIBLE_DEVICES)

The trainer's processes (trainer.processesPerReplica) take the first GPUs, one each; the
rollout worker takes the next one (SGLang every one left), or shares the trainer's last GPU
when none is left: on a workstation with one GPU, trainer and rollout share it. Each service
process sees only its own GPUs (CUDA_VISIBLE_DEVICES) and computes on them because the job as
this run executes it gives it that many (`placement.gpus`, read by
`asyncrl.platform.devices.select_device`); in a cluster the job's placement decides instead.

`plan_devices` is a pure function of the option and the GPUs visible, so it is tested
without one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Sequence

#: The option's name in errors.
OPTION = "--devices"

DevicesOption = Literal["auto", "cpu"] | tuple[int, ...]


class DevicesError(ValueError):
    """A --devices value this machine cannot honour; the message names the option and the fix."""


def parse_devices(text: str) -> DevicesOption:
    """`auto`, `cpu` or a comma-separated list of distinct GPU indices."""
    value = text.strip().lower()
    if value in ("auto", "cpu"):
        return value
    parts = [part.strip() for part in value.split(",")]
    if not all(part.isdigit() for part in parts):
        raise DevicesError(f"{OPTION} {text!r}: use auto, cpu, or GPU indices such as 0 or 0,1")
    indices = tuple(int(part) for part in parts)
    if len(set(indices)) != len(indices):
        raise DevicesError(f"{OPTION} {text!r} names a GPU twice: list each index once")
    return indices


@dataclass(frozen=True)
class ServiceDevices:
    """One service's GPUs (indices among those the runner sees; none: the CPU)."""

    gpus: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # added to its process's environment

    @property
    def device(self) -> str:
        """What the service computes on, as the runner numbers GPUs: "cpu" or "cuda:<i>"."""
        return f"cuda:{self.gpus[0]}" if self.gpus else "cpu"


@dataclass(frozen=True)
class DevicePlan:
    trainer: ServiceDevices
    rollout: ServiceDevices
    #: Why the run computes on the CPU ("" when it uses GPUs).
    cpu_reason: str = ""
    #: The GPUs' names, by index, for the run's first lines.
    names: tuple[str, ...] = ()

    @property
    def shared_gpu(self) -> bool:
        """Whether the rollout engine computes on one of the trainer's GPUs."""
        return bool(self.rollout.gpus) and self.rollout.gpus[0] in self.trainer.gpus

    def lines(self) -> list[str]:
        """What each service computes on, e.g. "trainer: cuda:0 (NVIDIA H200)"."""
        return [f"{name}: {self._describe(name, service)}"
                for name, service in (("trainer", self.trainer), ("rollout", self.rollout))]

    def _describe(self, name: str, service: ServiceDevices) -> str:
        if not service.gpus:
            return f"cpu ({self.cpu_reason})" if self.cpu_reason else "cpu"
        shown = ", ".join(f"cuda:{index}" + (f" ({self.names[index]})"
                                             if index < len(self.names) else "")
                          for index in service.gpus)
        if name == "rollout" and self.shared_gpu:
            shown += ", shared with the trainer"
        return shown


def plan_devices(option: DevicesOption, names: Sequence[str], *, trainer_processes: int = 1,
                 rollout_engine: str = "torch", cuda_visible: str | None = None) -> DevicePlan:
    """The devices of each service for `option`, on a machine whose CUDA shows the GPUs
    `names` (none: no CUDA here). `cuda_visible`: the runner's own CUDA_VISIBLE_DEVICES, if
    set, through which the runner's indices map to the children's. Raises DevicesError."""
    names = tuple(names)
    if option == "cpu":
        return _on_cpu("--devices cpu")
    if option == "auto":
        if not names:
            return _on_cpu("no CUDA here")
        chosen = tuple(range(len(names)))
    else:
        if not names:
            raise DevicesError(f"{OPTION} {','.join(map(str, option))}: CUDA is not available "
                               f"here; use {OPTION} cpu (or auto)")
        absent = [index for index in option if index >= len(names)]
        if absent:
            raise DevicesError(f"{OPTION} names GPU {absent[0]}, but this machine shows "
                               f"{len(names)} ({_listing(names)}); use indices below "
                               f"{len(names)}, or {OPTION} auto")
        chosen = tuple(option)
    if trainer_processes > len(chosen):
        raise DevicesError(
            f"trainer.processesPerReplica {trainer_processes} needs a GPU per process, and "
            f"{OPTION} gives {len(chosen)}: lower processesPerReplica, name more GPUs, or use "
            f"{OPTION} cpu")
    trainer = chosen[:trainer_processes]
    left = chosen[trainer_processes:]
    if not left:
        rollout = (trainer[-1],)
    else:
        rollout = left if rollout_engine == "sglang" else left[:1]
    return DevicePlan(_service(trainer, cuda_visible), _service(rollout, cuda_visible),
                      names=names)


def _on_cpu(reason: str) -> DevicePlan:
    # The CPU for certain: a service that saw a GPU would not use it (placement.gpus 0), and
    # hiding them keeps CUDA from being set up at all.
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    return DevicePlan(ServiceDevices((), hidden), ServiceDevices((), hidden), cpu_reason=reason)


def _service(gpus: tuple[int, ...], cuda_visible: str | None) -> ServiceDevices:
    return ServiceDevices(gpus, {"CUDA_VISIBLE_DEVICES": ",".join(
        _child_id(index, cuda_visible) for index in gpus)})


def _child_id(index: int, cuda_visible: str | None) -> str:
    """GPU `index` of the runner's view as a child names it: within the runner's own
    CUDA_VISIBLE_DEVICES when that is set (it may list indices or UUIDs)."""
    if not cuda_visible:
        return str(index)
    return [entry.strip() for entry in cuda_visible.split(",")][index]


def _listing(names: Sequence[str]) -> str:
    return ", ".join(f"{index}: {name}" for index, name in enumerate(names)) or "none"


def visible_gpus() -> list[str]:
    """The names of the GPUs CUDA shows this process (none without CUDA). Reads device
    properties only: no CUDA context, so no GPU memory, is taken by the runner."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]


def runner_cuda_visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")
