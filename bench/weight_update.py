"""Weight update latency, trainer to rollout engine, the three ways (trainer.weightTransfer):
disk (the trainer writes a safetensors snapshot, the engine loads it in place), distributed
(the trainer broadcasts every tensor over torch.distributed, the engine receives straight into
its weights) and ipc (the trainer copies into its shared buffer, in shared memory on the CPU,
and the engine copies from it). SmolLM2-135M; the engine runs in its own process, as a
rollout worker does.

    .venv/bin/python bench/weight_update.py [--dtype float32|bfloat16] [--trials 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch

from asyncrl.model.policy import SMOLLM2, load_model
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.api import TorchInferenceEngine
from asyncrl.rollout.weights_receiver import IpcReceiver, TransferMember
from asyncrl.trainer.checkpoints import publish_weights
from asyncrl.trainer.weights_broadcast import WeightBroadcaster
from asyncrl.weights.announcements import WeightVersion
from asyncrl.weights.distributed import model_manifest
from asyncrl.weights.ipc import SharedWeights, announcement_uri
from asyncrl.platform.redis_server import free_port


def engine_process(dtype: str, port: int, commands, answers) -> None:
    """The rollout side: a started engine that joins the group, then applies each command
    (("disk", path, version), ("distributed", version) or ("ipc", uri, version)) and answers
    its engine-side seconds."""
    torch.set_num_threads(1)
    engine = TorchEngine(load_model(SMOLLM2, dtype=dtype).eval(), max_running_requests=8,
                         max_sequence_length=256, seed=0).start()
    wrapped = TorchInferenceEngine(engine)
    tensors = model_manifest(engine._model, getattr(torch, dtype))
    member = TransferMember(wrapped, f"127.0.0.1:{port}", ranks=1, backend="gloo",
                            tensors=tensors)
    ipc = IpcReceiver(engine, torch.device("cpu"))
    asyncio.run(member.join())
    answers.put("joined")
    while (command := commands.get()) is not None:
        if command[0] == "disk":
            update = engine.update_weights(command[1], command[2])
        elif command[0] == "ipc":
            update = asyncio.run(ipc.receive(WeightVersion(command[2], command[1])))
        else:
            update = asyncio.run(member.receive(command[1], member.group_name))
        answers.put(update.seconds)
    engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    model = load_model(SMOLLM2)  # the trainer's float32 master weights
    state = model.state_dict()
    tensors = model_manifest(model, dtype)
    port = free_port()
    broadcaster = WeightBroadcaster(port, world_size=2, backend="gloo", tensors=tensors)
    context = multiprocessing.get_context("spawn")
    commands, answers = context.Queue(), context.Queue()
    child = context.Process(target=engine_process, args=(args.dtype, port, commands, answers))
    child.start()
    # The trainer forms the group's generation while the engine joins it (it loads first).
    assert broadcaster.ready(wait=600) and answers.get(timeout=600) == "joined"

    disk, distributed, ipc, version = [], [], [], 0
    with tempfile.TemporaryDirectory() as run_dir:
        shared = SharedWeights(Path(run_dir) / "ipc", tensors, dtype, torch.device("cpu"))
        uri = announcement_uri(shared.manifest_path)
        try:  # the shared-memory file goes even when a trial fails
            for _ in range(args.trials):
                version += 1
                started = time.perf_counter()
                shared.write(state, version)
                written = time.perf_counter() - started
                commands.put(("ipc", uri, version))
                copied = answers.get()
                ipc.append((time.perf_counter() - started, written, copied))

                version += 1
                started = time.perf_counter()
                path = publish_weights(model, state, Path(run_dir), version, dtype)
                written = time.perf_counter() - started
                commands.put(("disk", str(path), version))
                loaded = answers.get()
                disk.append((time.perf_counter() - started, written, loaded))

                version += 1
                started = time.perf_counter()
                commands.put(("distributed", version))
                sent = broadcaster.send(state)
                received = answers.get()
                distributed.append((time.perf_counter() - started, sent, received))
        finally:
            shared.close()
    commands.put(None)
    child.join()

    def median(rows, i):
        return statistics.median(r[i] for r in rows) * 1000

    size = sum(t.bytes for t in tensors) / 1e6
    print(f"SmolLM2-135M, {args.dtype} ({size:.0f} MB, {len(tensors)} tensors), "
          f"median of {args.trials}, trainer -> engine in another process:")
    print(f"disk:        {median(disk, 0):6.0f} ms = write snapshot {median(disk, 1):.0f} ms "
          f"+ engine loads it in place {median(disk, 2):.0f} ms")
    print(f"distributed: {median(distributed, 0):6.0f} ms (gloo broadcast; trainer sends "
          f"{median(distributed, 1):.0f} ms, engine receives {median(distributed, 2):.0f} ms)")
    print(f"ipc:         {median(ipc, 0):6.0f} ms = trainer copies into shared memory "
          f"{median(ipc, 1):.0f} ms + engine copies from it {median(ipc, 2):.0f} ms")
    print(f"distributed / disk: {median(distributed, 0) / median(disk, 0):.2f}; "
          f"ipc / disk: {median(ipc, 0) / median(disk, 0):.2f}")


if __name__ == "__main__":
    main()
