"""The ipc weight transfer (asyncrl.weights.ipc) on the CPU: the announcement, the manifest,
and the buffer shared for real with an unrelated process (a file in shared memory here; a CUDA
IPC handle on a GPU, the one difference), read into a torch engine's weights, under the lock
that keeps the trainer from writing while an engine copies."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.model.policy import tied_aliases
from asyncrl.rollout.weights_receiver import IpcReceiver, VersionSkipped
from asyncrl.weights.announcements import WeightVersion
from asyncrl.model.lora import adapter_state
from asyncrl.spec.job import RLJobSpec
from asyncrl.weights import ipc
from asyncrl.weights.distributed import model_manifest, version_manifest
from asyncrl.weights.ipc import (
    IpcManifest,
    IpcReader,
    IpcUnavailable,
    NotThisVersion,
    SharedWeights,
    announcement_uri,
    is_ipc_uri,
    manifest_path,
    open_handle,
    remove_memory_files,
    shared_memory_shortfall,
)
from support.lora import trained_adapter
from support.tiny_model import tiny_model

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def shared_memory(tmp_path, monkeypatch):
    """CPU buffers in a folder of the test's own, not the machine's /dev/shm (the one test of
    the real one removes what it makes)."""
    memory = tmp_path / "shm"
    memory.mkdir()
    monkeypatch.setattr(ipc, "SHM_DIRECTORY", memory)
    return memory


def test_an_ipc_announcement_names_the_manifest(tmp_path):
    uri = announcement_uri(tmp_path / "manifest.json")
    assert uri.startswith("torch-ipc:///") and is_ipc_uri(uri)
    assert manifest_path(uri) == tmp_path / "manifest.json"
    assert not is_ipc_uri(str(tmp_path)) and not is_ipc_uri("torch-distributed://g")


# ------------------------------------------------------------------ the manifest


def test_the_manifest_places_each_tensor_of_the_snapshot_layout_once_and_round_trips(tmp_path):
    model = tiny_model(0)
    metas = model_manifest(model, torch.bfloat16)
    shared = SharedWeights(tmp_path, metas, torch.bfloat16, CPU)
    manifest = IpcManifest.from_json(shared.manifest_path.read_text())
    assert manifest == shared.manifest
    assert manifest.dtype == torch.bfloat16 and manifest.device == "cpu"
    names = [t.name for t in manifest.tensors]
    assert names == sorted(set(model.state_dict()) - set(tied_aliases(model)))
    # Back to back, in order: the buffer holds exactly the model's tensors.
    for before, after in zip(manifest.tensors, manifest.tensors[1:]):
        assert after.offset == before.offset + before.numel
    last = manifest.tensors[-1]
    assert shared.flat.numel() == last.offset + last.numel


def test_a_handle_opens_only_what_tensor_sharing_pickles():
    with pytest.raises(pickle.UnpicklingError, match="not part of a shared tensor's handle"):
        open_handle(pickle.dumps(subprocess.run))


# ------------------------------------------------------------------ across processes

READER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from safetensors.torch import save_file
    from asyncrl.weights.ipc import IpcReader, NotThisVersion

    manifest, version, out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    reader = IpcReader(torch.device("cpu"))
    try:
        copied = reader.read(manifest, version,
                             lambda tensors: {n: t.clone() for n, t in tensors.items()})
    except NotThisVersion as exc:
        print("not this version:", exc)
        sys.exit(3)
    save_file(copied, out)
""")


def read_in_another_process(manifest, version: int, out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", READER, str(manifest), str(version), str(out)],
                          capture_output=True, text=True, timeout=120)


def test_an_unrelated_process_reads_each_version_from_the_shared_buffer(tmp_path):
    torch.manual_seed(0)
    shared = SharedWeights(tmp_path / "ipc", model_manifest(tiny_model(0), torch.bfloat16),
                           torch.bfloat16, CPU)
    for version, seed in ((1, 1), (2, 2)):
        state = tiny_model(seed).state_dict()  # float32: written in the buffer's bfloat16
        shared.write(state, version)
        done = read_in_another_process(shared.manifest_path, version, tmp_path / "read.st")
        assert done.returncode == 0, done.stdout + done.stderr
        read = load_file(tmp_path / "read.st")
        assert set(read) == set(shared.views)
        for name, tensor in read.items():
            assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    # A version the buffer no longer holds is not copied (the newer one is announced next).
    stale = read_in_another_process(shared.manifest_path, 1, tmp_path / "stale.st")
    assert stale.returncode == 3, stale.stdout + stale.stderr
    assert "holds version 2, not the announced 1" in stale.stdout


def test_the_trainer_waits_to_write_while_an_engine_copies(tmp_path):
    shared = SharedWeights(tmp_path, model_manifest(tiny_model(0), torch.float32),
                           torch.float32, CPU)
    shared.write(tiny_model(1).state_dict(), 1)
    copying, release = threading.Event(), threading.Event()
    seen = {}

    def slow_copy(tensors):
        copying.set()
        release.wait(10)
        seen.update({n: t.clone() for n, t in tensors.items()})

    reader = threading.Thread(target=IpcReader(CPU).read,
                              args=(shared.manifest_path, 1, slow_copy))
    reader.start()
    assert copying.wait(10)
    writer = threading.Thread(target=shared.write, args=(tiny_model(2).state_dict(), 2))
    writer.start()
    time.sleep(0.3)
    assert writer.is_alive()  # blocked on the engine's shared lock
    release.set()
    reader.join(10)
    writer.join(10)
    assert not writer.is_alive()
    first = tiny_model(1).state_dict()
    assert all(torch.equal(seen[n], first[n]) for n in seen)  # version 1 whole, untorn


def test_a_torch_engine_takes_a_version_from_the_buffer_and_refuses_another_device(tmp_path):
    import asyncio

    shared = SharedWeights(tmp_path, model_manifest(tiny_model(0), torch.float32),
                           torch.float32, CPU)
    engine = TorchEngine(tiny_model(0), max_running_requests=2, max_sequence_length=32)
    receiver = IpcReceiver(engine, CPU)
    new = tiny_model(5).state_dict()
    shared.write(new, 3)
    uri = announcement_uri(shared.manifest_path)
    update = asyncio.run(receiver.receive(WeightVersion(3, uri)))
    assert update.version == 3 == engine.version
    weights = engine._model.state_dict()
    assert all(torch.equal(weights[n], new[n]) for n in new)
    with pytest.raises(VersionSkipped, match="holds version 3, not the announced 4"):
        asyncio.run(receiver.receive(WeightVersion(4, uri)))

    # A buffer on a GPU this engine does not compute on: refused, naming the field and fix.
    elsewhere = IpcManifest(shared.manifest.tensors, torch.float32, "GPU-1234", b"")
    with pytest.raises(IpcUnavailable, match="trainer.weightTransfer: disk"):
        IpcReader(CPU).tensors(elsewhere)


def test_a_bf16_engine_takes_a_float32_version_cast_to_its_dtype(tmp_path):
    """rollout.computeDtype bfloat16 beside float32 master weights: the buffer stays float32
    and the engine holds each tensor cast, the bf16 weights a bf16 trainer computes with."""
    import asyncio

    shared = SharedWeights(tmp_path, model_manifest(tiny_model(0), torch.float32),
                           torch.float32, CPU)
    engine = TorchEngine(tiny_model(0).to(torch.bfloat16), max_running_requests=2,
                         max_sequence_length=32)
    new = tiny_model(5).state_dict()
    shared.write(new, 1)
    asyncio.run(IpcReceiver(engine, CPU).receive(
        WeightVersion(1, announcement_uri(shared.manifest_path))))
    weights = engine._model.state_dict()
    assert all(weights[n].dtype == torch.bfloat16 for n in new)
    assert all(torch.equal(weights[n], new[n].to(torch.bfloat16)) for n in new)
    assert not all(torch.equal(weights[n].float(), new[n]) for n in new)  # cast, not copied
    result = engine.start().submit([1, 2, 3], SamplingParams(max_new_tokens=3)).result(60)
    engine.stop()
    assert len(result.output_ids) == 3 and all(lp <= 0 for lp in result.output_logprobs)


def test_a_lora_engine_takes_the_adapter_from_the_buffer(tmp_path):
    """model.lora: the buffer holds the adapter's tensors (version_manifest) and the engine
    merges them into its weights."""
    import asyncio

    spec = RLJobSpec.model_validate({"model": {"source": "tiny-random",
                                               "lora": {"rank": 4, "alpha": 8}}})
    metas = version_manifest(tiny_model(1), spec.model)
    shared = SharedWeights(tmp_path, metas, metas[0].dtype, CPU)
    engine = TorchEngine(tiny_model(1), max_running_requests=2, max_sequence_length=32,
                         lora=spec.model.lora)
    trained = trained_adapter(seed=2, base_seed=1, lora=spec.model.lora)
    shared.write(adapter_state(trained), 1)
    update = asyncio.run(IpcReceiver(engine, CPU).receive(
        WeightVersion(1, announcement_uri(shared.manifest_path))))
    assert update.version == 1
    merged = trained.merge_and_unload().state_dict()
    for name, tensor in engine._model.state_dict().items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0)


def test_a_cpu_buffer_larger_than_the_free_shared_memory_is_named_before_it_is_made(tmp_path):
    """Writing past a full /dev/shm (a container's is 64 MiB unless given more) kills the
    writer with SIGBUS: the trainer asks first and sends versions to disk instead."""
    free = shutil.disk_usage(tmp_path).free
    assert shared_memory_shortfall(1024, tmp_path) is None
    shortfall = shared_memory_shortfall(free + 2**30, tmp_path)
    assert shortfall is not None and str(tmp_path) in shortfall and "MiB free" in shortfall
    assert shared_memory_shortfall(2**40, tmp_path / "absent") is None  # nothing to ask


def test_a_trainer_on_the_cpu_sends_versions_to_disk_where_shared_memory_is_short(
        tmp_path, monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    from asyncrl.trainer import publication

    spec = RLJobSpec.model_validate({"model": {"source": "tiny-random"},
                                     "trainer": {"weightTransfer": "ipc"}})
    metas = model_manifest(tiny_model(0), torch.float32)

    def publisher():
        return publication.Publisher(SimpleNamespace(run_dir=tmp_path), spec, tiny_model(0),
                                     CPU, metas, on_compute=None, metrics=None, status=None)

    assert isinstance(publisher().shared_weights, SharedWeights)
    monkeypatch.setattr(publication, "shared_memory_shortfall",
                        lambda nbytes: f"/dev/shm has 64 MiB free and a version needs {nbytes}")
    with caplog.at_level(logging.WARNING, logger=publication.__name__):
        assert publisher().shared_weights is None
    assert "weights go to disk, not by ipc: /dev/shm has 64 MiB free" in caplog.text
    assert "docker run --shm-size" in caplog.text


def test_a_cpu_buffer_is_a_file_in_shared_memory_of_its_own_per_trainer(tmp_path, monkeypatch):
    """The machine's /dev/shm: the buffer is a file there, read by name; a restarted trainer
    of the same run makes a new one and removes its predecessor's, which an engine still
    mapping it keeps reading until it lets it go; closing removes it and the lock then holds
    no version."""
    monkeypatch.setattr(ipc, "SHM_DIRECTORY", Path("/dev/shm"))
    if not ipc.SHM_DIRECTORY.is_dir():  # pragma: no cover - Linux has it
        pytest.skip("no /dev/shm here")
    metas = model_manifest(tiny_model(0), torch.float32)
    first = SharedWeights(tmp_path, metas, torch.float32, CPU)
    try:
        assert first.file.parent == ipc.SHM_DIRECTORY
        assert first.manifest.handle == str(first.file).encode()
        first.write(tiny_model(1).state_dict(), 1)
        reader = IpcReader(CPU)
        old = reader.read(first.manifest_path, 1, lambda tensors: tensors)
        monkeypatch.setattr(ipc.os, "getpid", lambda: 1)  # another trainer process
        second = SharedWeights(tmp_path, metas, torch.float32, CPU)
        assert not first.file.exists() and second.file.exists()
        expected = tiny_model(1).state_dict()
        assert all(torch.equal(old[name], expected[name]) for name in old)  # still mapped
        second.write(tiny_model(2).state_dict(), 2)
        new = reader.read(second.manifest_path, 2, lambda tensors: tensors)
        expected = tiny_model(2).state_dict()
        assert all(torch.equal(new[name], expected[name]) for name in new)
        second.close()
        assert not second.file.exists()
        # What a stopped trainer leaves holds no version: an engine waits for the next one.
        with pytest.raises(NotThisVersion, match="holds version none"):
            reader.read(second.manifest_path, 2, lambda tensors: tensors)
    finally:
        remove_memory_files(tmp_path)
