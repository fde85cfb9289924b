"""Megatron-Core on a machine without CUDA, and the process groups it needs.

Megatron-Core is written for GPUs. On a CPU, megatron-core MEGATRON_CORE_VERSION needs the
shims below; each names the upstream code it works around. They are pinned to that version:
tests/trainer/test_megatron.py counts the call sites they cover and fails when an upgrade changes them.
Everything else (layers, attention, the optimizer's math) is Megatron-Core's own.

Two more CPU needs are met by how asyncrl.trainer.megatron.policy calls GPTModel, not by
patching it: an explicit boolean causal mask (GPTModel's default mask is built on "cuda"), and
logits gathered across tensor-parallel ranks at run time (`parallel_output=True` with
`runtime_gather_output=True`; gathering in the constructor's way fails in backward on an
in-place view). Its fused kernels are off in the model's config: they are CUDA or Apex kernels.
"""

from __future__ import annotations

import importlib.metadata
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

MEGATRON_CORE_VERSION = "0.16.1"

INSTALL_HINT = ("trainer.backend megatron needs Megatron-Core: install the optional group "
                f"with `pip install 'asyncrl[megatron]'` (megatron-core=={MEGATRON_CORE_VERSION})")


def import_megatron():
    """megatron.core, imported once with a clear error when it is missing or another version
    (the shims below are pinned to one)."""
    try:
        installed = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(INSTALL_HINT) from None
    if installed != MEGATRON_CORE_VERSION:
        raise RuntimeError(f"megatron-core {installed} is installed; asyncrl's CPU shims are "
                           f"pinned to {MEGATRON_CORE_VERSION}. {INSTALL_HINT}")
    chatter = logging.getLogger("megatron.core")
    level = chatter.level
    with warnings.catch_warnings():
        # Importing it warns once per module that Apex / TransformerEngine are absent (the
        # local, pure torch implementations it falls back to are the ones we use on a CPU)
        # and logs which FSDP flavour it would use (we use none of its FSDP).
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed")
        chatter.setLevel(logging.WARNING)
        try:
            import megatron.core
            import megatron.core.models.gpt  # noqa: F401  (the modules that warn)
            import megatron.core.optimizer  # noqa: F401
        finally:
            chatter.setLevel(level)
    # Said on every tensor-parallel forward (tensor_parallel/layers.py): a CUDA stream
    # setting, which means nothing on a CPU and is the launcher's to set on a GPU.
    warnings.filterwarnings("ignore", message="When using async grad allreduce")
    _answer_cpu_for_current_device()
    return megatron.core


def _cpu_device() -> str:
    return "cpu"


def _answer_cpu_for_current_device() -> None:
    """Megatron-Core allocates with `device=torch.cuda.current_device()` (rotary embedding,
    tensor_parallel.layers and .mappings' all-gather buffers, the global memory buffer,
    dot_product_attention). Without CUDA that call raises; answering "cpu" makes those tensors
    CPU tensors. Only done where CUDA is absent, so nothing that could run on a GPU changes."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = _cpu_device


#: The Megatron-Core modules the CPU path runs, with how many `torch.cuda.current_device()`
#: calls each has in MEGATRON_CORE_VERSION (what the shim above covers).
CURRENT_DEVICE_CALL_SITES = {
    "models/common/embeddings/rotary_pos_embedding.py": 3,
    "models/gpt/gpt_model.py": 1,
    "transformer/attention.py": 1,
    "transformer/dot_product_attention.py": 2,
    "tensor_parallel/layers.py": 8,
    "tensor_parallel/mappings.py": 5,
}


def count_current_device_calls() -> dict[str, int]:
    """The installed Megatron-Core's count of the calls CURRENT_DEVICE_CALL_SITES lists."""
    root = Path(import_megatron().__file__).parent
    return {path: (root / path).read_text().count("torch.cuda.current_device()")
            for path in CURRENT_DEVICE_CALL_SITES}


def initialize_parallel(tensor_parallel: int, pipeline_parallel: int, device: torch.device,
                        seed: int = 0) -> None:
    """Megatron's process groups over this process's torch.distributed world (a world of one,
    in memory, when none is up) and its RNG tracker."""
    import_megatron()
    from megatron.core import parallel_state, tensor_parallel as tp

    if not dist.is_initialized():
        # One process outside torchrun: a group of one needs no network.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel)
    if device.type == "cuda":
        tp.model_parallel_cuda_manual_seed(seed)
    else:
        # model_parallel_cuda_manual_seed sets CUDA generators. Dropout is 0 in our config, so
        # the tracker's forks only have to exist: the inference tracker's are no-ops
        # (tensor_parallel/random.py, initialize_rng_tracker).
        tp.random.initialize_rng_tracker(inference_rng_tracker=True)


def destroy_parallel() -> None:
    """Undoes initialize_parallel's Megatron groups (tests build several models)."""
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
