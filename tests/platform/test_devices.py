"""The one device rule: cuda:<local rank> when the job requests GPUs and CUDA is here, else CPU.

The GPU branches are exercised on a CPU-only machine by pretending CUDA is available."""

import pytest
import torch

from torch.cuda._utils import _get_device_index

from asyncrl.platform.devices import (distributed_backend, local_rank, make_current,
                                      select_device, with_index)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA with two GPUs, GPU 1 current; records the indices made current. Its set_device
    reads its argument as torch's does, refusing a device without an index."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: current.append(_get_device_index(device)))
    cudnn_attention = torch.backends.cuda.cudnn_sdp_enabled()
    yield current
    torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)


def test_no_gpus_requested_is_cpu_even_with_cuda(fake_cuda):
    assert select_device(0) == torch.device("cpu")
    assert select_device(0, local_rank=1) == torch.device("cpu")
    assert fake_cuda == []


def test_gpus_requested_with_cuda_is_the_local_ranks_gpu_made_current(fake_cuda):
    assert select_device(1) == torch.device("cuda", 0)
    assert select_device(2, local_rank=1) == torch.device("cuda", 1)
    assert fake_cuda == [0, 1]


def test_a_bare_cuda_device_is_made_current_by_its_index(fake_cuda):
    # As a bench's --device cuda: torch.cuda.set_device(torch.device("cuda")) raises.
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))
    assert make_current("cuda") == torch.device("cuda", 1)
    assert make_current(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert fake_cuda == [1, 0]
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_other_devices_are_unchanged_and_not_made_current(fake_cuda):
    assert with_index("cpu") == torch.device("cpu")
    assert make_current("cpu") == torch.device("cpu")
    assert with_index("cuda:0") == torch.device("cuda", 0)
    assert fake_cuda == []


def test_more_processes_than_gpus_is_refused_with_the_fix(fake_cuda):
    with pytest.raises(ValueError, match="processesPerReplica"):
        select_device(2, local_rank=2)


def test_gpus_requested_without_cuda_falls_back_to_cpu(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("WARNING"):
        assert select_device(4, local_rank=3) == torch.device("cpu")
    assert "CUDA is not available" in caplog.text


def test_negative_arguments_are_refused():
    with pytest.raises(ValueError):
        select_device(-1)


def test_backend_and_local_rank(monkeypatch):
    assert distributed_backend(torch.device("cpu")) == "gloo"
    assert distributed_backend(torch.device("cuda", 1)) == "nccl"
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_rank() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank() == 3


@pytest.fixture
def cudnn_sdp():
    """cuDNN attention's global switch, restored after the test."""
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(enabled)


def test_a_cuda_process_attends_without_cudnn_and_a_cpu_one_is_left_alone(fake_cuda, cudnn_sdp):
    """cuDNN's SDPA plans per shape (milliseconds of host time a call): every CUDA process,
    trainer or engine, gets the planless backends from select_device."""
    select_device(0)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    select_device(1)
    assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("flags, speedup, fast", [
    ("fpu avx512f avx512bw avx512_vnni", None, False),   # Ice Lake: oneDNN emulates bf16
    ("fpu avx512f avx512_bf16", 0.7, False),             # measured slower than float32
    ("fpu avx512f avx512_bf16", 1.8, True),              # measured faster
    ("fpu avx512f avx512_bf16 amx_bf16 amx_tile", 1.19, False),  # not enough faster
    ("fp asimd bf16 i8mm", 2.5, True),                   # Arm with the BF16 extension
])
def test_a_cpu_computes_in_bf16_where_it_has_the_instructions_and_they_pay(
        tmp_path, monkeypatch, flags, speedup, fast):
    from asyncrl.platform import devices

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: a CPU\nflags\t\t: {flags}\n\n"
                       f"processor\t: 1\nflags\t\t: {flags}\n")
    real = devices.cpu_flags
    monkeypatch.setattr(devices, "cpu_flags", lambda: real(cpuinfo))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True,
                        raising=False)
    measured = []

    def speedup_here():
        measured.append(speedup)
        return speedup

    monkeypatch.setattr(devices, "cpu_bf16_speedup", speedup_here)
    assert devices.fast_bf16(torch.device("cpu")) is fast
    assert measured == ([] if speedup is None else [speedup])  # no bf16 instructions: no timing


@pytest.mark.parametrize("fast", [True, False])
def test_auto_resolves_to_bf16_only_where_the_device_computes_it_faster(monkeypatch, fast):
    from asyncrl.platform import devices

    monkeypatch.setattr(devices, "fast_bf16", lambda device: fast)
    cpu = torch.device("cpu")
    assert devices.resolve_dtype("auto", cpu) == ("bfloat16" if fast else "float32")
    # A dtype named is kept, fast or not.
    assert devices.resolve_dtype("bfloat16", cpu) == "bfloat16"
    assert devices.resolve_dtype("float32", cpu) == "float32"


def test_the_bf16_speedup_is_measured_once_per_process():
    from asyncrl.platform.devices import cpu_bf16_speedup

    first = cpu_bf16_speedup(rounds=1, repeats=1)
    assert first > 0
    # cached: a second trainer in the process pays nothing
    assert cpu_bf16_speedup(rounds=1, repeats=1) == first


def test_cpu_flags_are_none_without_cpuinfo(tmp_path):
    from asyncrl.platform.devices import cpu_flags

    assert cpu_flags(tmp_path / "missing") is None
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(arm) == frozenset({"fp", "asimd", "bf16"})
