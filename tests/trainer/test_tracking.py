"""Experiment tracking (services/trainer/tracking/): a real trainer on the tiny model logs each
step's record, the job and the rollout side's throughput, read back with each tool's own
reader (TensorBoard's EventAccumulator, wandb's Record protobufs of an offline run, MlflowClient
against a real `mlflow server`); a restarted trainer continues the same run; a tracker that is
down is counted and never stops training; a tracker that is not installed is refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from pathlib import Path

import grpc
import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from asyncrl.buffer.store import JobConfig
from asyncrl.cli import app
from asyncrl.platform.settings import TrainerSettings
from asyncrl.spec import load_manifest
from asyncrl.trainer.metrics import TrainerMetrics
from asyncrl.trainer.service import Trainer
from asyncrl.trainer.tracking import missing_trackers, run_key
from asyncrl.trainer.tracking.rollout import RolloutRate
from asyncrl.trainer.tracking.mlflow_tracker import RUN_KEY_TAG, MlflowTracker
from asyncrl.trainer.tracking.worker import TrackerThread
from asyncrl.v1 import buffer_pb2, buffer_pb2_grpc
from support import ROOT
from support.buffer import BufferThread, make_group
from support.ports import free_port
from support.tracking import MlflowServer, wandb_history, wandb_run

TINY = ROOT / "examples/tiny.yaml"
NAME = "tracked"


def _job_file(tmp_path: Path, tracking: dict, max_steps: int = 5) -> Path:
    manifest = yaml.safe_load(TINY.read_text())
    manifest["metadata"]["name"] = NAME
    manifest["spec"]["algorithm"].update(batchSize=2, groupSize=2, maxStaleness=8,
                                         maxSteps=max_steps)
    manifest["spec"]["trainer"].update(checkpointEvery=2, evalEvery=2, evalPrompts=4)
    manifest["spec"]["tracking"] = tracking
    path = tmp_path / f"job-{max_steps}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


class Stint:
    """The trainer of `job_file` in this process, over a real buffer, for `batches` batches;
    with `stop_after`, stopped (as a pod is) once that step's record is written."""

    def __init__(self, job_file: Path, run_dir: Path, buffer: BufferThread):
        self.job_file, self.run_dir, self.buffer = job_file, run_dir, buffer
        self.filled = 0

    def fill(self, batches: int) -> None:
        with grpc.insecure_channel(self.buffer.address) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            for _ in range(2 * batches):
                slot = stub.AcquireSlot(buffer_pb2.AcquireSlotRequest(job=NAME, worker="w"),
                                        timeout=10)
                assert slot.granted
                group = make_group(f"p{self.filled}#0", 2, tokens=3 + self.filled % 4)
                stub.PutGroup(buffer_pb2.PutGroupRequest(job=NAME, slot_id=slot.slot_id,
                                                         group=group), timeout=10)
                self.filled += 1

    def run(self, batches: int, stop_after: int | None = None) -> Trainer:
        self.fill(batches)
        self.run_dir.mkdir(parents=True, exist_ok=True)  # as `serve trainer` does
        settings = TrainerSettings(job_file=self.job_file, buffer_address=self.buffer.address,
                                   run_dir=self.run_dir, threads=1)
        trainer = Trainer(settings, load_manifest(self.job_file))

        async def run() -> None:
            task = asyncio.create_task(trainer.run())
            while stop_after is not None and not task.done():
                if stop_after in _steps(self.run_dir):
                    task.cancel()
                await asyncio.sleep(0.05)
            with contextlib.suppress(asyncio.CancelledError):
                await task

        asyncio.run(run())
        return trainer


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in _records(run_dir) if r["kind"] == "train"]


def _train_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in _records(run_dir) if r["kind"] == "train"}


@pytest.fixture
def buffer(redis_server, tmp_path):
    job = load_manifest(_job_file(tmp_path, {}))
    thread = BufferThread(redis_server.url, [JobConfig.from_job(job)]).start()
    yield thread
    thread.stop()


def _interrupted_then_resumed(tmp_path: Path, buffer, tracking: dict) -> Path:
    """Steps 1-3 (checkpoint at 2), stopped after recording 3; then a new trainer resumes from
    the checkpoint at 2 and trains 3 (again), 4 and 5."""
    run_dir = tmp_path / "run"
    stint = Stint(_job_file(tmp_path, tracking), run_dir, buffer)
    stint.run(batches=3, stop_after=3)
    assert (run_dir / "checkpoints").exists() and _steps(run_dir) == [1, 2, 3]
    stint.run(batches=3)
    assert _steps(run_dir) == [1, 2, 3, 4, 5]
    return run_dir


# --------------------------------------------------------------------------- TensorBoard, W&B


@pytest.mark.slow  # two trainer stints with evaluations: ~30 s on 2 cores
def test_tensorboard_and_wandb_offline_log_every_step_and_a_resumed_job_continues(
        tmp_path, buffer):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracking = {"tensorboard": {"dir": "tb"},
                "wandb": {"project": "asyncrl-tests", "mode": "offline", "tags": ["t"]}}
    run_dir = _interrupted_then_resumed(tmp_path, buffer, tracking)
    records = _train_records(run_dir)  # step 3: the resumed trainer's record

    # TensorBoard: one folder, appended to; purge_step dropped the first stint's step 3.
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0}).Reload()
    for key in ("reward_mean", "loss", "clip_fraction", "staleness_mean", "trained_tokens",
                "step_seconds", "grad_norm"):
        points = events.Scalars(key)
        assert [p.step for p in points] == [1, 2, 3, 4, 5], key
        assert [p.value for p in points] == pytest.approx(
            [records[s][key] for s in (1, 2, 3, 4, 5)], rel=1e-6), key
    # Evaluations: the baseline at step 0, then every 2 steps and at the last.
    evaluations = {r["step"]: r for r in _records(run_dir) if "eval_accuracy" in r}
    assert [p.step for p in events.Scalars("eval_accuracy")] == sorted(evaluations)
    assert [p.value for p in events.Scalars("eval_stderr")] == pytest.approx(
        [evaluations[s]["eval_stderr"] for s in sorted(evaluations)])
    # Every group was in the buffer before each stint: none produced between steps. Each
    # stint's first step has no rate (nothing to compare with).
    rollout = events.Scalars("rollout/groups_per_second")
    assert [(p.step, p.value) for p in rollout] == [(2, 0.0), (4, 0.0), (5, 0.0)]
    assert [p.value for p in events.Scalars("rollout/accepted_groups_total")][-1] == 12
    assert "learningRate: 0.001" in events.Tensors("job/text_summary")[0].tensor_proto \
        .string_val[0].decode()

    # W&B offline: two stints, one run id (the job's run key), steps going on.
    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2
    key = run_key(load_manifest(_job_file(tmp_path, tracking)), run_dir)
    assert {wandb_run(log).run_id for log in logs} == {key}
    first, second = (wandb_history(log) for log in logs)
    assert sorted(s for s in first if s) == [1, 2, 3] and sorted(second) == [3, 4, 5]
    for step in (4, 5):
        assert second[step]["reward_mean"] == pytest.approx(records[step]["reward_mean"])
        assert second[step]["loss"] == pytest.approx(records[step]["loss"])
    assert second[5]["eval_accuracy"] == records[5]["eval_accuracy"]
    assert "rollout/samples_per_second" in second[5]
    config = {item.key: json.loads(item.value_json) for item in wandb_run(logs[0]).config.update}
    assert config["spec"]["algorithm"]["maxSteps"] == 5
    assert list(wandb_run(logs[0]).tags) == ["t"]


def test_tensorboard_tracker_on_restart_shows_the_steps_trained_again_once(tmp_path):
    """The fast tier's check of the restart marker, without a trainer."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from asyncrl.trainer.tracking.tensorboard_tracker import TensorboardTracker

    for resumed, steps in ((0, (1, 2, 3)), (2, (3, 4))):  # a checkpoint at 2, 3 logged twice
        tracker = TensorboardTracker(tmp_path / "tb")
        tracker.open({"spec": {"algorithm": {"maxSteps": 4}}}, resumed)
        for step in steps:
            tracker.log(step, {"loss": step + resumed / 10})
        tracker.close()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    points = events.Scalars("loss")
    assert [p.step for p in points] == [1, 2, 3, 4]
    assert [p.value for p in points] == pytest.approx([1.0, 2.0, 3.2, 4.2])


def test_wandb_offline_tracker_resumes_the_same_run_id(tmp_path):
    from asyncrl.spec.job import WandbTracking
    from asyncrl.trainer.tracking.wandb_tracker import WandbTracker

    spec = WandbTracking(project="asyncrl-tests", mode="offline", group="g")
    for resumed, steps in ((0, (1, 2)), (2, (3,))):
        tracker = WandbTracker(spec, NAME, "tracked-0123", tmp_path)
        tracker.open({"spec": {"algorithm": {"maxSteps": 3}}}, resumed)
        for step in steps:
            tracker.log(step, {"loss": step / 2, "rollout/groups_per_second": 1.5})
        tracker.close()
        # An offline run's folder is named by the second it starts in: a second stint in the
        # same second would write into the first's.
        time.sleep(1.1)
    logs = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 2
    assert [wandb_run(log).run_id for log in logs] == ["tracked-0123", "tracked-0123"]
    assert wandb_run(logs[0]).run_group == "g" and wandb_run(logs[0]).display_name == NAME
    assert wandb_history(logs[0]) == {1: {"loss": 0.5, "rollout/groups_per_second": 1.5},
                                      2: {"loss": 1.0, "rollout/groups_per_second": 1.5}}
    assert wandb_history(logs[1]) == {3: {"loss": 1.5, "rollout/groups_per_second": 1.5}}


# --------------------------------------------------------------------------- MLflow


@pytest.mark.slow
def test_mlflow_run_is_continued_on_resume_and_a_stopped_server_never_stops_training(
        tmp_path, buffer):
    from mlflow import MlflowClient

    server = MlflowServer(tmp_path / "mlflow").start()
    try:
        tracking = {"mlflow": {"trackingUri": server.uri, "experiment": "asyncrl-tests"}}
        run_dir = _interrupted_then_resumed(tmp_path, buffer, tracking)
        client = MlflowClient(server.uri)
        experiment = client.get_experiment_by_name("asyncrl-tests")
        (run,) = client.search_runs([experiment.experiment_id])  # one run for both stints
        key = run_key(load_manifest(_job_file(tmp_path, tracking)), run_dir)
        assert run.data.tags[RUN_KEY_TAG] == key and run.info.status == "FINISHED"
        records = _train_records(run_dir)
        history = client.get_metric_history(run.info.run_id, "reward_mean")
        # Step 3 twice: once per stint (MLflow keeps every point).
        assert sorted(m.step for m in history) == [1, 2, 3, 3, 4, 5]
        last = {m.step: m.value for m in history}
        assert last[5] == pytest.approx(records[5]["reward_mean"])
        steps = {m.step for m in client.get_metric_history(run.info.run_id, "eval_stderr")}
        assert {0, 2, 4, 5} <= steps
        assert run.data.params["spec.algorithm.learningRate"] == "0.001"
        assert run.data.params["metadata.name"] == NAME

        # The server goes away; the job trains on to its end and counts the failures.
        server.stop()
        stint = Stint(_job_file(tmp_path, tracking, max_steps=6), run_dir, buffer)
        stint.filled = 100
        started = time.monotonic()
        trainer = stint.run(batches=1)
        assert _steps(run_dir) == [1, 2, 3, 4, 5, 6]
        assert time.monotonic() - started < 120
        errors = trainer.metrics.registry.get_sample_value(
            "asyncrl_trainer_tracking_failures_total", {"rljob": NAME, "tracker": "mlflow"})
        assert errors and errors >= 3  # the open, tried three times
    finally:
        server.stop()


def test_a_tracker_that_is_down_is_retried_counted_and_never_blocks_the_caller(tmp_path):
    """MLflow's real client against a loopback port where nothing listens."""
    from asyncrl.spec.job import MlflowTracking

    metrics = TrainerMetrics(NAME)
    tracker = MlflowTracker(MlflowTracking(tracking_uri=f"http://127.0.0.1:{free_port()}"),
                            NAME, "key")
    thread = TrackerThread(tracker, metrics.observe_tracking_failure, pause=0.05)
    thread.start({"spec": {}}, 0)
    started = time.monotonic()
    for step in range(1, 200):
        thread.log(step, {"loss": 0.5})
    assert time.monotonic() - started < 0.5  # queued: the caller never waits for it
    deadline = time.monotonic() + 60
    while metrics.registry.get_sample_value("asyncrl_trainer_tracking_failures_total",
                                            {"rljob": NAME, "tracker": "mlflow"}) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    thread.stop()
    thread.join(10)
    assert not thread.opened
    assert metrics.registry.get_sample_value("asyncrl_trainer_tracking_failures_total",
                                             {"rljob": NAME, "tracker": "mlflow"}) >= 1


# --------------------------------------------------------------------------- not installed


def test_a_tracker_that_is_not_installed_is_refused_with_its_install_command(
        tmp_path, monkeypatch):
    import importlib.util

    path = _job_file(tmp_path, {"wandb": {"project": "p"}, "tensorboard": {}})
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert missing_trackers(load_manifest(path).spec.tracking) == [
        "tracking.wandb: the wandb package is not installed; install it with "
        "pip install 'asyncrl[wandb]'"]
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 1 and "pip install 'asyncrl[wandb]'" in result.output
    # Mode disabled asks for nothing.
    disabled = _job_file(tmp_path, {"wandb": {"project": "p", "mode": "disabled"}})
    assert missing_trackers(load_manifest(disabled).spec.tracking) == []


def test_the_tensorboard_folder_is_inside_the_run_directory(tmp_path):
    from asyncrl.spec import parse_manifest

    manifest = yaml.safe_load(_job_file(tmp_path, {"tensorboard": {"dir": "../elsewhere"}})
                              .read_text())
    with pytest.raises(ValidationError, match="tracking.tensorboard.dir"):
        parse_manifest(manifest)


def test_the_rollout_rate_is_the_groups_produced_between_two_steps():
    rate = RolloutRate(group_size=8)
    first = rate.observe(buffer_pb2.BufferStats(accepted_total=4, depth_groups=3), now=10.0)
    assert "rollout/groups_per_second" not in first  # nothing to compare with yet
    assert first["rollout/buffer_depth_groups"] == 3
    second = rate.observe(buffer_pb2.BufferStats(accepted_total=10, skipped_uniform_total=2),
                          now=12.0)
    # 6 accepted and 2 dropped for equal rewards (generated all the same) in 2 s.
    assert second["rollout/groups_per_second"] == 4.0
    assert second["rollout/samples_per_second"] == 32.0
    assert second["rollout/accepted_groups_total"] == 10
