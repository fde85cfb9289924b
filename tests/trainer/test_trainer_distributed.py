"""The trainer across processes: batches split by tokens, FSDP2 sharding, the command loop's
timeout, bf16 autocast, Hugging Face snapshots, and `serve trainer` under torchrun (one
process and two publish the same weights; a rank killed mid-run loses nothing)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from safetensors.torch import load_file

from asyncrl.buffer.store import JobConfig
from asyncrl.platform.devices import select_device
from asyncrl.model.policy import TinyModelConfig, load_model, packed_token_logprobs, tied_aliases
from asyncrl.local.runner import LocalJob, RunOptions
from asyncrl.spec import load_manifest
from asyncrl.trainer.checkpoints import (
    TrainerState,
    latest_checkpoint,
    publish_weights,
    read_checkpoint,
    save_checkpoint,
)
from asyncrl.trainer.distributed import (
    Command,
    TrainerGroup,
    full_model_state,
    full_optimizer_state,
    load_full_state,
    shard_model,
    split_by_tokens,
)
from asyncrl.launch.torchrun import torchrun_arguments
from asyncrl.trainer.service import forget_records_after
from asyncrl.trainer.step import PolicyUpdater, UpdateConfig
from asyncrl.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from support import ROOT
from support.buffer import BufferThread
from support.ports import free_port
from support.trainer import make_groups, make_samples, tiny_model

TINY = ROOT / "examples/tiny.yaml"
ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
# The tests' device: the job's GPUs when CUDA is here (a GPU runner), the CPU otherwise.
DEVICE = select_device(1 if torch.cuda.is_available() else 0)


# --------------------------------------------------------------------------- splitting


def test_split_by_tokens_keeps_every_sample_once_and_balances_tokens():
    samples = make_samples(9, seed=3)
    shares = split_by_tokens(samples, 2)
    assert sorted(id(s) for share in shares for s in share) == sorted(id(s) for s in samples)
    loads = [sum(s.input_ids.numel() for s in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= max(s.input_ids.numel() for s in samples)
    # Each share keeps the batch's order.
    order = {id(s): i for i, s in enumerate(samples)}
    assert all([order[id(s)] for s in share] == sorted(order[id(s)] for s in share)
               for share in shares)


def test_split_by_tokens_gives_empty_shares_when_samples_run_out():
    shares = split_by_tokens(make_samples(2), 4)
    assert len(shares) == 4 and sorted(len(s) for s in shares) == [0, 0, 1, 1]
    assert split_by_tokens([], 2) == [[], []]


def test_a_rank_with_no_samples_takes_part_and_changes_nothing_alone():
    """An empty share is a valid step: zero gradients, finite stats."""
    model = tiny_model().to(DEVICE)
    before = [p.detach().clone() for p in model.parameters()]
    stats = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          UpdateConfig()).step([])
    assert stats["trained_tokens"] == 0 and stats["grad_norm"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --------------------------------------------------------------------------- precision


def test_bf16_autocast_step_is_close_to_the_fp32_step_and_keeps_fp32_weights():
    initial = torch.nn.utils.parameters_to_vector(tiny_model().parameters()).to(DEVICE)
    results = {}
    for dtype in ("float32", "bfloat16"):
        model = tiny_model().to(DEVICE)
        updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                UpdateConfig(compute_dtype=dtype, micro_batch_max_tokens=24))
        stats = updater.step(make_samples(8))
        assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights
        delta = torch.nn.utils.parameters_to_vector(model.parameters()) - initial
        results[dtype] = stats, delta.detach()
    (fp32, fp32_delta), (bf16, bf16_delta) = results["float32"], results["bfloat16"]
    assert bf16["trained_tokens"] == fp32["trained_tokens"]
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.05)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=0.1)
    # The same update, up to bf16 rounding: the two weight changes point the same way.
    assert torch.nn.functional.cosine_similarity(fp32_delta, bf16_delta, dim=0) > 0.99


def test_unknown_compute_dtype_is_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="compute_dtype"):
        PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      UpdateConfig(compute_dtype="float16"))


# --------------------------------------------------------------------------- snapshots


def test_snapshot_is_a_hugging_face_directory_in_the_models_dtype(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model().to(DEVICE)
    path = publish_weights(model, full_model_state(model), tmp_path, 7, torch.bfloat16)
    assert path == tmp_path / "weights/v000007"
    tensors = load_file(path / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    # Tied weights stored once, as save_pretrained does.
    assert tied_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in tensors
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert loaded.dtype == torch.bfloat16
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value.to("cpu", torch.bfloat16)), name
    # Only the newest three are kept.
    for version in range(8, 11):
        publish_weights(model, full_model_state(model), tmp_path, version, torch.float32)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
        "v000008", "v000009", "v000010"]


def test_checkpoint_round_trip_restores_weights_and_optimizer(tmp_path):
    model = tiny_model().to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    PolicyUpdater(model, optimizer, UpdateConfig()).step(make_samples(4))
    save_checkpoint(model, full_model_state(model), full_optimizer_state(model, optimizer),
                    tmp_path, TrainerState(step=4, version=5))
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints/step-000004"

    fresh = tiny_model().to(DEVICE)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    checkpoint = read_checkpoint(latest_checkpoint(tmp_path), fresh)
    assert checkpoint.state == TrainerState(4, 5)
    load_full_state(fresh, fresh_optimizer, checkpoint.model, checkpoint.optimizer)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied
    # The same next step from both.
    samples = make_samples(4, seed=1)
    PolicyUpdater(model, optimizer, UpdateConfig()).step(samples)
    PolicyUpdater(fresh, fresh_optimizer, UpdateConfig()).step(samples)
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b)


def test_metrics_of_steps_after_the_restored_checkpoint_are_forgotten(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "eval", "step": 0}] + [{"kind": "train", "step": s} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tr')
    forget_records_after(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    forget_records_after(path, None)  # no checkpoint: everything is redone
    assert path.read_text() == ""
    forget_records_after(tmp_path / "absent.jsonl", 3)  # nothing to do


# --------------------------------------------------------------------------- spec and launch


def test_trainer_sharding_is_none_by_default_and_fsdp_or_none_only():
    from pydantic import ValidationError

    from asyncrl.spec import parse_manifest

    manifest = yaml.safe_load(TINY.read_text())
    assert parse_manifest(manifest).spec.trainer.sharding == "none"
    manifest["spec"]["trainer"]["sharding"] = "fsdp"
    assert parse_manifest(manifest).spec.trainer.sharding == "fsdp"
    manifest["spec"]["trainer"]["sharding"] = "zero3"
    with pytest.raises(ValidationError, match="sharding"):
        parse_manifest(manifest)


def test_torchrun_arguments_for_one_node_and_for_a_rendezvous():
    assert torchrun_arguments(2, max_restarts=3) == [
        "--nnodes=1", "--nproc-per-node=2", "--standalone", "--max-restarts=3",
        "-m", "asyncrl.cli"]
    assert torchrun_arguments(8, nnodes=2, rendezvous_endpoint="t-0.t:29400",
                              rendezvous_id="job") == [
        "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=t-0.t:29400", "--rdzv-id=job", "--rdzv-conf=read_timeout=600",
        "-m", "asyncrl.cli"]
    with pytest.raises(ValueError):
        torchrun_arguments(2, nnodes=2)


def test_local_run_starts_more_than_one_trainer_process_under_torchrun(tmp_path):
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["trainer"]["processesPerReplica"] = 2
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    local = LocalJob(load_manifest(path), RunOptions(run_dir=tmp_path / "run",
                                                     trainer_threads=4))
    command = local._trainer_command("asyncrl", "b:1", "r:2")
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in command and "--standalone" in command
    assert command[command.index("-m", 3):][:4] == ["-m", "asyncrl.cli", "serve", "trainer"]
    assert command[command.index("--threads") + 1] == "2"  # 4 threads, 2 each
    single = LocalJob(load_manifest(TINY), RunOptions(run_dir=tmp_path / "run"))
    assert single._trainer_command("asyncrl", "b:1", "r:2")[:3] == [
        "asyncrl", "serve", "trainer"]


# --------------------------------------------------------------------------- processes


def _join(rank: int, world_size: int, port: int, timeout: float = 60.0) -> TrainerGroup:
    """What torchrun's environment gives a rank."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    return TrainerGroup.from_environment(torch.device("cpu"), timeout)


def _sgd_steps(model, batches, rank=0, world_size=1, activation_checkpointing=False):
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.5),
                            UpdateConfig(micro_batch_max_tokens=24,
                                         activation_checkpointing=activation_checkpointing))
    return [updater.step(split_by_tokens(batch, world_size)[rank]) for batch in batches]


def _fsdp_rank(rank, world_size, port, out_dir):
    group = _join(rank, world_size, port)
    batches = [make_groups(2, 4, seed=0), make_samples(8, seed=1)]  # prompts shared, not
    model = tiny_model()
    shard_model(model, torch.device("cpu"), world_size)
    # Checkpointed layers recompute inside FSDP's hooks: the same update as one process.
    stats = _sgd_steps(model, batches, rank, world_size, activation_checkpointing=True)
    state = full_model_state(model)  # a collective: every rank calls it, rank 0 gets it

    # A checkpoint written by rank 0 alone, read by every rank into a fresh sharded model.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = UpdateConfig(micro_batch_max_tokens=24)
    PolicyUpdater(model, optimizer, config).step(split_by_tokens(batches[0], world_size)[rank])
    model_state, optimizer_state = full_model_state(model), full_optimizer_state(model, optimizer)
    if group.leader:
        save_checkpoint(model, model_state, optimizer_state, out_dir, TrainerState(3, 3))
    dist.barrier()
    fresh = tiny_model()
    shard_model(fresh, torch.device("cpu"), world_size)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    checkpoint = read_checkpoint(latest_checkpoint(out_dir), fresh)
    load_full_state(fresh, fresh_optimizer, checkpoint.model, checkpoint.optimizer)
    share = split_by_tokens(batches[1], world_size)[rank]
    PolicyUpdater(model, optimizer, config).step(share)
    PolicyUpdater(fresh, fresh_optimizer, config).step(share)
    continued, resumed = full_model_state(model), full_model_state(fresh)
    if group.leader:
        torch.save({"state": state, "stats": stats, "continued": continued,
                    "resumed": resumed}, out_dir / "fsdp.pt")
    group.close()


@pytest.mark.slow
def test_fsdp_on_two_gloo_ranks_matches_one_process_and_resumes_from_its_checkpoint(tmp_path):
    mp.spawn(_fsdp_rank, args=(2, free_port(), tmp_path), nprocs=2, join=True)
    result = torch.load(tmp_path / "fsdp.pt")
    model = tiny_model()
    single_stats = _sgd_steps(model, [make_groups(2, 4, seed=0), make_samples(8, seed=1)])
    assert sorted(result["state"]) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(result["state"][name], value, atol=1e-6, rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    for ours, theirs in zip(result["stats"], single_stats):
        assert ours["trained_tokens"] == theirs["trained_tokens"]
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    # Resumed from the checkpoint, the next step is the same as continuing.
    for name, value in result["continued"].items():
        torch.testing.assert_close(result["resumed"][name], value, msg=lambda m: f"{name}: {m}")


def _silent_leader_rank(rank, world_size, port, out_dir):
    group = _join(rank, world_size, port, timeout=3.0)
    if group.leader:
        group.send(Command("wait"))
        deadline = time.monotonic() + 60
        while not (out_dir / "follower.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)  # alive but silent: no heartbeat, no command
        (out_dir / "leader.json").write_text(json.dumps({"left": time.monotonic()}))
        return
    assert group.receive().kind == "wait"
    started = time.monotonic()
    try:
        group.receive()
        outcome = "received"
    except Exception as exc:  # noqa: BLE001 - whatever gloo raises on a timeout
        outcome = f"raised {type(exc).__name__}"
    (out_dir / "follower.json").write_text(json.dumps(
        {"outcome": outcome, "waited": time.monotonic() - started, "at": time.monotonic()}))
    # Its group is left with a timed-out receive whose gloo thread may still run: tearing
    # that down at interpreter exit can abort the process in C++ ("terminate called without
    # an active exception"), which is not what this test checks. Its outcome is written.
    os._exit(0)


@pytest.mark.slow
def test_a_rank_blocked_in_the_command_loop_gives_up_after_the_collective_timeout(tmp_path):
    mp.spawn(_silent_leader_rank, args=(2, free_port(), tmp_path), nprocs=2, join=True)
    result = json.loads((tmp_path / "follower.json").read_text())
    leader = json.loads((tmp_path / "leader.json").read_text())
    assert result["outcome"].startswith("raised")
    # By its own timeout (3 s; never before it), while the silent leader was still there
    # (it waits up to 60 s): not because the leader went away. No upper bound on the time.
    assert result["waited"] > 2.5 and result["at"] < leader["left"]


# --------------------------------------------------------------------------- the service


def _job(tmp_path, name, **trainer) -> Path:
    manifest = yaml.safe_load(TINY.read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"]["algorithm"].update(batchSize=2, groupSize=2, maxStaleness=4, maxSteps=3)
    manifest["spec"]["trainer"].update(trainer)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def _groups(count: int) -> list[common_pb2.Group]:
    """Groups of two responses of different lengths, rewarded 1 and 0, with behaviour
    log-probs from the initial policy itself (as a rollout at version 0 would give)."""
    model = load_model("tiny-random", tiny=TinyModelConfig(seed=0))
    generator = torch.Generator().manual_seed(0)
    groups = []
    for index in range(count):
        prompt = torch.randint(0, 1000, (3 + index % 3,), generator=generator).tolist()
        samples = []
        for answer in range(2):
            response = torch.randint(0, 1000, (2 + 5 * index + answer,), generator=generator)
            ids = torch.tensor(prompt + response.tolist())
            with torch.no_grad():
                logprobs = packed_token_logprobs(model, ids, torch.arange(len(ids)),
                                                 torch.tensor([0, len(ids)]))
            samples.append(common_pb2.Trajectory(
                prompt_ids=prompt, response_ids=response.tolist(),
                behaviour_logprobs=logprobs[len(prompt):].tolist(),
                token_versions=[0] * len(response), reward=float((index + answer) % 2),
                finish_reason="stop"))
        groups.append(common_pb2.Group(group_id=f"p{index}#0", prompt_id=f"p{index}",
                                       samples=samples))
    return groups


def _fill(address, job, groups):
    with grpc.insecure_channel(address) as channel:
        stub = buffer_pb2_grpc.BufferStub(channel)
        for group in groups:
            slot = stub.AcquireSlot(buffer_pb2.AcquireSlotRequest(job=job, worker="w"), timeout=10)
            assert slot.granted
            stub.PutGroup(buffer_pb2.PutGroupRequest(job=job, slot_id=slot.slot_id, group=group),
                          timeout=10)


def _stats(address, job):
    with grpc.insecure_channel(address) as channel:
        return buffer_pb2_grpc.BufferStub(channel).GetStats(
            buffer_pb2.GetStatsRequest(job=job), timeout=10)


def _serve_trainer(job_file, address, run_dir, processes):
    serve = ["serve", "trainer", "--job-file", str(job_file), "--buffer-address", address,
             "--run-dir", str(run_dir), "--grpc-port", str(free_port()), "--threads", "1"]
    if processes == 1:
        command = [ASYNCRL, *serve]
    else:
        command = [sys.executable, "-m", "torch.distributed.run",
                   *torchrun_arguments(processes), *serve]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ASYNCRL_EVAL_PROMPTS": "0"})


@pytest.mark.slow
def test_serve_trainer_on_two_processes_publishes_what_one_process_does(tmp_path, redis_server):
    variants = {"dp-one": (1, "none"), "dp-two": (2, "none"), "dp-fsdp": (2, "fsdp")}
    jobs = {name: _job(tmp_path, name, sharding=sharding)
            for name, (_, sharding) in variants.items()}
    buffer = BufferThread(redis_server.url, [JobConfig.from_job(load_manifest(path))
                                             for path in jobs.values()]).start()
    try:
        weights, stats, groups = {}, {}, _groups(6)  # three batches of two groups
        for name, (processes, _) in variants.items():
            _fill(buffer.address, name, groups)
            done = _serve_trainer(jobs[name], buffer.address, tmp_path / name, processes)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            weights[name] = load_file(tmp_path / name / "weights/v000003/model.safetensors")
            stats[name] = _stats(buffer.address, name)
            records = [json.loads(line) for line in
                       (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records] == [1, 2, 3]
            assert all(r["trained_samples"] == 4 for r in records)
    finally:
        buffer.stop()
    for name, (processes, _) in variants.items():
        # Each batch consumed and acknowledged once, by rank 0 alone.
        assert stats[name].consumed_total == 6 and stats[name].depth_groups == 0, name
        assert stats[name].redelivered_total == 0, name
    # The service's optimizer is AdamW, which turns rounding noise in gradients near zero
    # (|g| of the order of its eps, 1e-8) into updates of up to ~lr/10, so a few elements
    # (17 of 3.2M when written) differ by more than test_trainer_data_parallel's 1e-6, which
    # holds for SGD there and in the FSDP test above. The updates (published minus initial
    # weights) agree to 1e-4 of their size, elementwise at 1e-6 but for one in 10^4 at most.
    one = weights["dp-one"]
    initial = load_model("tiny-random", tiny=TinyModelConfig(seed=0)).state_dict()
    update = torch.cat([(value - initial[name]).flatten() for name, value in one.items()])
    assert update.norm() > 0
    for name in ("dp-two", "dp-fsdp"):
        assert sorted(weights[name]) == sorted(one)
        difference = torch.cat([(weights[name][t] - value).flatten() for t, value in one.items()])
        close = torch.isclose(difference + update, update, atol=1e-6, rtol=1e-5)
        print(f"{name}: update norm {update.norm():.4g}, difference norm "
              f"{difference.norm():.3g}, max {difference.abs().max():.3g}, "
              f"{(~close).sum()} of {close.numel()} elements beyond 1e-6")
        assert difference.norm() < 1e-4 * update.norm(), name
        assert (~close).sum() < 1e-4 * close.numel(), name
        assert difference.abs().max() < 0.1 * load_manifest(jobs[name]).spec.algorithm.learning_rate


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in environ if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


@pytest.mark.slow
def test_killing_a_trainer_rank_restarts_the_group_and_loses_nothing(tmp_path):
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["trainer"]["processesPerReplica"] = 2
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    job = load_manifest(path)
    local = LocalJob(job, RunOptions(run_dir=tmp_path / "run", max_steps=6))
    try:
        local.start()
        trainer = next(s for s in local.services if s.name == "trainer")
        deadline = time.monotonic() + 300
        while True:  # kill rank 1 while an update is being applied, before rank 0's ack
            status = local.trainer_status()
            if status is not None and status.step >= 1 and status.phase == "training":
                break
            assert time.monotonic() < deadline
            time.sleep(0.005)
        follower = next(p for p in _children(trainer.process.pid) if _rank_of(p) == 1)
        os.kill(follower, signal.SIGKILL)
        while not local.trainer_done():
            local.check()  # torchrun restarts the group itself: the runner sees no failure
            assert time.monotonic() < deadline + 300
            time.sleep(0.5)
        stats = local.buffer_stats()
    finally:
        local.stop()
    log = (tmp_path / "run/logs/trainer.log").read_text()
    assert log.count("trainer starts at step") == 2, log[-3000:]
    # Every accepted group was trained on, is still waiting, or was dropped as stale.
    assert stats.accepted_total == (stats.consumed_total + stats.depth_groups
                                    + stats.dropped_stale_total)
    assert stats.consumed_total >= 6 * job.spec.algorithm.batch_size
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0]
