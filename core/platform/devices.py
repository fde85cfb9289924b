"""Which device a trainer or rollout process computes on.

One rule for every service: the process runs on `cuda:<local rank>` when the job gives its pod
GPUs (`placement.gpus > 0`) and CUDA is available here, on the CPU otherwise. Under torchrun the
local rank is the process's index on its node, so each process of a pod gets its own GPU.
"""

from __future__ import annotations

import functools
import logging
import os
import time

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


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run faster than float32 on `device`: on a CUDA GPU always; on a
    CPU, where it has bf16 instructions and a bf16 matrix multiply measured here beats float32
    by BF16_SPEEDUP_NEEDED (once per process: cpu_bf16_speedup)."""
    if device.type == "cuda":
        return True
    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN (or without this probe)
        return False
    # oneDNN "supports" bf16 on any AVX-512 CPU, emulating it where the instructions are
    # missing: on an Ice Lake Xeon a bf16 matmul took 3.3x as long as float32. The CPU's own
    # flags say whether they are there (Linux; elsewhere the measurement alone decides).
    flags = cpu_flags()
    if not supported or (flags is not None and not flags & _BF16_CPU_FLAGS):
        return False
    # The instructions are not enough: AVX-512 BF16 made a SmolLM2 trainer step 1.78x faster
    # than float32 on a 2-core AMD EPYC, and 1.39x slower on a 2-core Xeon VM with the same
    # flag and no AMX (2026-11-29, bench/trainer_step.py). So measure.
    return cpu_bf16_speedup() >= BF16_SPEEDUP_NEEDED


#: CPU flags (Linux /proc/cpuinfo) of instructions that compute bf16: AVX-512 BF16, AMX,
#: Arm's BF16 extension.
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})

#: How much faster than float32 a bf16 matmul must measure for bf16 to pay on a CPU (its
#: autocast also casts the weights every pass); the machines measured so far sat at 0.4-0.6x
#: and about 2x, far from it on either side.
BF16_SPEEDUP_NEEDED = 1.2


@functools.cache
def cpu_bf16_speedup(rounds: int = 3, repeats: int = 4) -> float:
    """float32 time / bf16 time of a transformer-sized matrix multiply (512 x 576 by
    576 x 1536, SmolLM2's MLP) on this CPU at the process's thread count: the best of
    `rounds` interleaved timings of `repeats` products each, so a busy machine slows both
    alike. About half a second where bf16 is slow, once per process (logged)."""
    generator = torch.Generator().manual_seed(0)
    inputs = {dtype: (torch.randn(512, 576, generator=generator).to(dtype),
                      torch.randn(576, 1536, generator=generator).to(dtype))
              for dtype in (torch.float32, torch.bfloat16)}
    for a, b in inputs.values():  # oneDNN's first call of a shape plans it: not counted
        torch.mm(a, b)
    best = dict.fromkeys(inputs, float("inf"))
    for _ in range(rounds):
        for dtype, (a, b) in inputs.items():
            started = time.perf_counter()
            for _ in range(repeats):
                torch.mm(a, b)
            best[dtype] = min(best[dtype], time.perf_counter() - started)
    speedup = best[torch.float32] / best[torch.bfloat16]
    log.info("a bf16 matrix multiply runs %.2fx as fast as float32 on this CPU", speedup)
    return speedup


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
    computes it faster than float32 and the model autocasts on that kind of device
    (`autocast_devices`), float32 elsewhere."""
    fast = device.type in autocast_devices and fast_bf16(device)
    return "bfloat16" if fast else "float32"


def resolve_dtype(setting: str, device: torch.device | str) -> str:
    """A dtype setting of a job (float32, bfloat16 or auto) on `device`: auto is bfloat16
    where the device computes it faster than float32 (fast_bf16), float32 elsewhere."""
    if setting != "auto":
        return setting
    device = torch.device(device)
    return auto_compute_dtype(device, autocast_devices=(device.type,))
