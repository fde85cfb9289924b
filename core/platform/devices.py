"""Which device a trainer or rollout process computes on.

One rule for every service: the process runs on `cuda:<local rank>` when the job gives its pod
GPUs (`placement.gpus > 0`) and CUDA is available here, on the CPU otherwise. Under torchrun the
local rank is the process's index on its node, so each process of a pod gets its own GPU.
"""

from __future__ import annotations

import logging
import os

from pathlib import Path

import torch

log = logging.getLogger(__name__)


def local_rank() -> int:
    """This process's index on its node: torchrun's LOCAL_RANK, 0 outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def select_device(gpus_requested: int, local_rank: int = 0) -> torch.device:
    """`cuda:<local_rank>` when GPUs were requested and CUDA is available (made the current
    CUDA device), else the CPU.

    Raises ValueError when GPUs are in use but this process's GPU does not exist (more
    processes per pod than visible GPUs).
    """
    if gpus_requested < 0 or local_rank < 0:
        raise ValueError(f"gpus_requested and local_rank must be >= 0, got {gpus_requested}, "
                         f"{local_rank}")
    if gpus_requested == 0:
        log.info("device: cpu (the job requests no GPUs)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        log.warning("device: cpu (%d GPUs requested, but CUDA is not available here)",
                    gpus_requested)
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise ValueError(
            f"process {local_rank} of this pod needs GPU {local_rank}, but {visible} are "
            "visible; run at most one process per GPU (trainer.processesPerReplica <= "
            "trainer.placement.gpus)"
        )
    device = make_current(torch.device("cuda", local_rank))
    log.info("device: %s (%s)", device, torch.cuda.get_device_name(device))
    return device


def with_index(device: torch.device | str) -> torch.device:
    """`device` with its index: a bare `cuda` names the current CUDA device, as tensors placed
    on it do; other devices unchanged. `torch.cuda.set_device` refuses a device without one
    (PyTorch 2.11 and later)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def make_current(device: torch.device | str) -> torch.device:
    """`device` with its index; a CUDA device is made the current one (which NCCL, FSDP and
    tensors placed on a bare `cuda` use) and keeps attention off cuDNN
    (use_planless_attention)."""
    device = with_index(device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index)
        use_planless_attention()
    return device


def use_planless_attention() -> None:
    """Keeps this process's scaled-dot-product attention off the cuDNN backend: cuDNN builds
    an execution plan for each new shape (2.57 ms of host time per call, measured on an
    H200), and packed micro-batches and a growing decode batch bring a new shape nearly
    every call. SDPA then picks its flash or memory-efficient kernels, which plan nothing.
    Every CUDA service process (trainer, rollout worker) comes through select_device, and a
    torch engine built on a GPU elsewhere (a bench) calls it too."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def distributed_backend(device: torch.device) -> str:
    """torch.distributed backend for tensors on `device`: NCCL on GPU, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 matmuls natively (a CUDA GPU; a CPU with AVX-512 BF16 or
    AMX). Elsewhere bf16 autocast is emulated and slower than float32."""
    if device.type == "cuda":
        return True
    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN (or without this probe)
        return False
    # oneDNN "supports" bf16 on any AVX-512 CPU, emulating it where the instructions are
    # missing: on an Ice Lake Xeon a bf16 matmul took 3.3x as long as float32. The CPU's own
    # flags say whether it has them (Linux; elsewhere oneDNN's answer stands).
    flags = cpu_flags()
    return supported and (flags is None or bool(flags & _BF16_CPU_FLAGS))


#: CPU flags (Linux /proc/cpuinfo) of instructions that compute bf16 natively: AVX-512 BF16,
#: AMX, Arm's BF16 extension.
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The first processor's feature flags ("flags" on x86, "Features" on Arm); None where
    the file is not there or has none."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return None


#: The devices bf16 autocast trains a transformers model on.
AUTOCAST_DEVICES = ("cpu", "cuda")


def auto_compute_dtype(device: torch.device,
                       autocast_devices: tuple[str, ...] = AUTOCAST_DEVICES) -> str:
    """What trainer.computeDtype `auto` computes in on `device`: bfloat16 where the device
    computes it natively and the model autocasts on that kind of device (`autocast_devices`),
    float32 elsewhere."""
    native = device.type in autocast_devices and native_bf16(device)
    return "bfloat16" if native else "float32"
