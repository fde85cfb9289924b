"""`asyncrl run` end to end with the tiny model: every service a real process."""

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import redis
import yaml

from asyncrl.local.runner import REDIS_MAX_RESTARTS, LocalJob, RunOptions, ServiceFailed
from asyncrl.spec import load_manifest
from support import ROOT
from support.buffer import group_fates
from support.waiting import wait_for

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
TINY = ROOT / "examples/tiny.yaml"


def run(run_dir, *extra, timeout=600):
    return subprocess.run([ASYNCRL, "run", str(TINY), "--run-dir", str(run_dir), *extra],
                          capture_output=True, text=True, timeout=timeout)


def tiny_with(tmp_path: Path, name: str, change) -> Path:
    """examples/tiny.yaml after `change(spec)`, written as tmp_path/<name>.yaml."""
    manifest = yaml.safe_load(TINY.read_text())
    change(manifest["spec"])
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def metrics(run_dir, kind="train"):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == kind]


# ------------------------------------------------------------ `asyncrl run` as a user starts it
#
# The processes a run started are found as the descendants of its `asyncrl run` process
# (redis-server, each `asyncrl serve ...` and what those started), taken while it runs. A
# psutil.Process remembers its start time, so a pid the system reuses later is not mistaken
# for one of them.


class Run:
    """`asyncrl run JOB --run-dir RUN_DIR ARGS...` (JOB: examples/tiny.yaml unless given) in
    the background, its output in a file (a pipe nobody reads could fill up and stall it)."""

    def __init__(self, run_dir: Path, *args: str, job: Path = TINY):
        self.run_dir = run_dir
        self.output_file = run_dir.parent / f"{run_dir.name}-output-{time.monotonic_ns()}.txt"
        self.process = self._start([ASYNCRL, "run", str(job), "--run-dir", str(run_dir), *args])
        self.runner = psutil.Process(self.process.pid)  # before anyone can reap it
        self.seen: list[psutil.Process] = []

    def _start(self, command: list[str]) -> subprocess.Popen:
        with self.output_file.open("w") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)

    def output(self) -> str:
        return self.output_file.read_text(errors="replace")

    def processes(self) -> list[psutil.Process]:
        """Every process this run has started and that runs now (each also kept in `seen`)."""
        try:
            found = self.runner.children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        self.seen += [p for p in found if p not in self.seen]
        return found

    def service(self, name: str) -> psutil.Process:
        """The running `asyncrl serve <name>` (or redis-server) process of this run."""
        matches = [p for p in self.processes() if _service_name(p) == name]
        assert len(matches) == 1, f"{name}: {matches}\n{self.describe()}"
        return matches[0]

    def wait_until(self, ready, what: str, timeout: float = 600) -> None:
        """Until `ready()`; fails at once if the run exits, and after `timeout` (which only
        catches a hang: a loaded machine may take minutes) naming what runs."""

        def check() -> bool:
            if ready():
                return True
            assert self.process.poll() is None, (
                f"asyncrl run exited ({self.process.returncode}) before {what}\n{self.describe()}")
            self.processes()
            return False

        wait_for(check, timeout, what, self.describe, every=0.5)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 300) -> int:
        self.processes()
        self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)

    def left_running(self) -> list[str]:
        """Every process this run was seen to start that still runs (zombies run nothing)."""
        alive = []
        for process in self.seen:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{process.pid} {' '.join(process.cmdline())}")
            except psutil.NoSuchProcess:
                pass
        return alive

    def kill(self) -> None:
        """Cleanup after a failed test: nothing of the run may outlive it."""
        self.processes()
        for process in [self.runner, *self.seen]:
            try:
                if process.is_running():
                    process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=30)

    def describe(self) -> str:
        running = "\n".join(f"  {p.pid} {_service_name(p)}" for p in self.processes())
        return f"running:\n{running or '  (nothing)'}\noutput:\n{self.output()[-3000:]}"


class RunInTerminal(Run):
    """The same in a terminal of its own, as a user types it: a pseudo-terminal that is the
    runner's controlling terminal (the runner leads its session, as a shell does in a terminal
    window) and its input and output. `close_terminal()` closes it as closing the window
    does: the kernel hangs the terminal up, sends the runner SIGHUP, and from then on every
    write to it fails."""

    #: setsid, then the terminal on stdin as controlling terminal, then the command. A separate
    #: program rather than a preexec_fn: a fork of pytest, which may have imported grpc, can
    #: hang in gRPC's fork handler.
    LAUNCHER = ("import fcntl, os, sys, termios; os.setsid(); "
                "fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.argv[1], sys.argv[1:])")

    def _start(self, command: list[str]) -> subprocess.Popen:
        self.output_file.touch()
        self.terminal, tty = pty.openpty()
        try:
            process = subprocess.Popen([sys.executable, "-c", self.LAUNCHER, *command],
                                       stdin=tty, stdout=tty, stderr=tty)
        finally:
            os.close(tty)
        self.closing = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return process

    def _read(self) -> None:
        """What the runner writes to its terminal, into the output file, until the terminal
        closes (a terminal nobody reads fills up and stalls the writer)."""
        with self.output_file.open("ab") as out:
            while not self.closing.is_set():
                if not select.select([self.terminal], [], [], 0.2)[0]:
                    continue
                try:
                    data = os.read(self.terminal, 65536)
                except OSError:  # EIO: nothing has the terminal open any more
                    return
                if not data:
                    return
                out.write(data)
                out.flush()

    def close_terminal(self) -> None:
        self.processes()
        self.closing.set()
        self.reader.join()
        os.close(self.terminal)

    def kill(self) -> None:
        super().kill()
        if not self.closing.is_set():
            self.close_terminal()


def _service_name(process: psutil.Process) -> str:
    try:
        command = process.cmdline()
    except psutil.NoSuchProcess:
        return "(exited)"
    if command and "redis-server" in command[0]:
        return "redis-server"
    if "serve" in command:
        return command[command.index("serve") + 1]
    return " ".join(command)


def last_checkpoint_step(run_dir: Path) -> int:
    steps = [int(path.name.removeprefix("step-")) for path in (run_dir / "checkpoints").glob("step-*")]
    return max(steps, default=0)


def records_so_far(run_dir: Path, kind: str = "train") -> list[dict]:
    """metrics.jsonl while a run writes it: absent at first, its last line perhaps partial."""
    path = run_dir / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return [r for r in records if r["kind"] == kind]


def flat(text: str) -> str:
    """Whitespace folded: the console wraps long lines at its width."""
    return " ".join(text.split())


@pytest.mark.slow
def test_run_trains_writes_a_complete_run_folder_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    first = run(run_dir, "--steps", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    for path in ["config.yaml", "metrics.jsonl", "report.md", "logs/buffer.log", "logs/trainer.log",
                 "logs/rollout.log", "plots/reward_vs_step.png", "plots/reward_vs_time.png",
                 "plots/throughput.png", "plots/staleness.png", "plots/signals.png"]:
        assert (run_dir / path).is_file(), path
    assert list((run_dir / "checkpoints").glob("step-*"))
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["version"] for r in records] == [1, 2, 3]
    eta = load_manifest(TINY).spec.algorithm.max_staleness
    assert all(s <= eta for r in records for s in r["staleness"])
    evaluated = [r for r in records if "eval_accuracy" in r]
    assert evaluated and all(r["eval_seconds"] > 0 for r in evaluated)  # what it cost
    # ... and how its responses ended: a tiny random model rarely ends before maxNewTokens
    assert all(0 <= r["eval_truncated_fraction"] <= 1 and r["eval_response_length_mean"] > 0
               for r in evaluated)
    assert [r["step"] for r in metrics(run_dir, "eval")] == [0]  # the starting point
    report = (run_dir / "report.md").read_text()
    assert "Run report: tiny" in report
    assert "step 0: " in report and "±" in report  # accuracies with their standard errors
    assert "- policy entropy: " in report and "plots/signals.png" in report

    # The same command with a larger budget continues from the checkpoint at step 3.
    second = run(run_dir, "--steps", "5")
    assert second.returncode == 0, second.stdout + second.stderr
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert "trainer starts at step 3" in (run_dir / "logs/trainer.log").read_text()


@pytest.mark.slow
def test_run_as_the_readme_types_it_relative_file_and_default_run_folder(tmp_path):
    """`asyncrl run examples/<job>.yaml` from a checkout's root: a relative manifest path and
    the default, relative run folder (redis-server changes into its --dir, so a relative log
    path once broke the main command while every test used absolute paths)."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples/tiny.yaml").write_text(TINY.read_text())
    done = subprocess.run([ASYNCRL, "run", "examples/tiny.yaml", "--steps", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = tmp_path / "runs/tiny"
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    # The first lines say what each service computes on (the CPU on the machines tests run on).
    head = flat(done.stdout[:done.stdout.index("asyncrl run: tiny")])
    assert "trainer: " in head and "rollout: " in head, head
    assert (run_dir / "redis/redis.log").is_file()
    # The live table's last frame shows where the run ended, not "starting".
    final_frame = done.stdout[done.stdout.rindex("asyncrl run: tiny"):]
    assert "done" in final_frame and "2 / 2" in final_frame, final_frame
    assert "starting" not in final_frame


@pytest.mark.slow
def test_distributed_weight_transfer_carries_every_version_to_the_rollout_worker(tmp_path):
    job_file = tiny_with(tmp_path, "tiny-distributed",
                         lambda spec: spec["trainer"].update(weightTransfer="distributed"))
    manifest = yaml.safe_load(job_file.read_text())
    run_dir = tmp_path / "run"
    done = subprocess.run([ASYNCRL, "run", str(job_file), "--run-dir", str(run_dir),
                           "--steps", "3"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    records = metrics(run_dir)
    assert [r["weight_transfer"] for r in records] == ["distributed"] * 3
    # The worker generated with each new version (else staleness would exceed the bound and
    # the gate would have stalled the run); no snapshot was written for it.
    eta = manifest["spec"]["algorithm"]["maxStaleness"]
    assert all(s <= eta for r in records for s in r["staleness"])
    assert not list((run_dir / "weights").glob("v*"))
    assert "joined the weight transfer group" in (run_dir / "logs/rollout.log").read_text()


@pytest.mark.slow
def test_rollout_replicas_start_as_many_worker_processes_and_no_prompt_is_used_twice(tmp_path):
    job_file = tiny_with(tmp_path, "tiny-two-workers",
                         lambda spec: spec["rollout"].update(replicas=2))
    manifest = yaml.safe_load(job_file.read_text())
    run_dir = tmp_path / "run"
    done = subprocess.run([ASYNCRL, "run", str(job_file), "--run-dir", str(run_dir),
                           "--steps", "8", "--rollout-threads", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    head = flat(done.stdout[:done.stdout.index("asyncrl run: tiny")])
    assert ("rollout: 2 worker processes (rollout.replicas), 1 thread and up to 2 prompts at "
            "once each (rollout.maxConcurrentRollouts 4 shared)") in head, head
    # Both generated: each worker's own engine counters, recorded while the run went on. Each
    # holds at most its share of the job's 4 slots, so the first worker up cannot take them
    # all and leave the other nothing to do (as it could before the share).
    generated = {}
    for line in (run_dir / "rollout_status.jsonl").read_text().splitlines():
        record = json.loads(line)
        generated[record["worker"]] = int(record["generated_tokens_total"])
    assert set(generated) == {"rollout-0", "rollout-1"}, generated
    assert all(tokens > 0 for tokens in generated.values()), generated
    assert (run_dir / "logs/rollout.log").is_file() and (run_dir / "logs/rollout-1.log").is_file()
    # The prompt cursor's guarantee across workers: no prompt accepted twice in the epoch,
    # and none lost.
    fates = group_fates(run_dir / "redis", "tiny")
    prompts = [group.split("#")[0] for group in fates.accepted]
    assert len(fates.trained) >= 8 * manifest["spec"]["algorithm"]["batchSize"]
    assert len(prompts) == len(set(prompts)), prompts
    fates.assert_each_prompt_used_once()


@pytest.mark.slow
def test_a_run_past_its_active_deadline_stops_resumable_and_says_what_is_the_clusters(tmp_path):
    job_file = tiny_with(tmp_path, "tiny-deadline", lambda spec: spec.update(
        activeDeadlineSeconds=30, ttlSecondsAfterFinished=60))
    run_dir = tmp_path / "run"
    started = time.monotonic()
    done = subprocess.run([ASYNCRL, "run", str(job_file), "--run-dir", str(run_dir),
                           "--steps", "100000"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    output = flat(done.stdout)
    assert ("ttlSecondsAfterFinished: the operator's, in a cluster; here a service that exits "
            "stops the run, and the run folder stays") in output
    assert "activeDeadlineSeconds 30: the run stops (resumable) once it has run that long" \
        in output
    assert "the run passed activeDeadlineSeconds 30; rerun the same command" in output
    assert time.monotonic() - started < 120
    assert metrics(run_dir)  # it trained until then, and wrote its report
    assert (run_dir / "report.md").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ctrl_c_stops_every_process_and_the_same_command_resumes_with_the_buffer_intact(tmp_path):
    run_dir = tmp_path / "run"
    job = load_manifest(TINY)
    services = {"redis-server", "buffer", "reward", "trainer", "rollout"}

    first = Run(run_dir, "--steps", "200")
    try:
        # A checkpoint to resume from; by then every service runs.
        first.wait_until(lambda: last_checkpoint_step(run_dir) > 0, "checkpoint")
        assert services <= {_service_name(p) for p in first.processes()}, first.describe()
        assert first.stop() == 130, first.output()
        assert "rerun the same command to resume" in flat(first.output())
        # Every process it started, redis-server included, stopped before it returned.
        assert first.left_running() == [], first.describe()
    finally:
        first.kill()
    assert (run_dir / "report.md").is_file()

    # What Redis wrote before it stopped, by group id: each accepted group trained on, dropped
    # as stale, or waiting in the run folder for the next run. (The trainer stops after the
    # rollout worker and often trains on what waited first, so none may wait: the checks of
    # the history below hold either way.)
    before = group_fates(run_dir / "redis", job.metadata.name)
    assert len(before.trained) >= last_checkpoint_step(run_dir) * job.spec.algorithm.batch_size
    assert sorted(before.trained + before.dropped + before.waiting) == sorted(before.accepted)
    checkpoint = last_checkpoint_step(run_dir)

    # The same command continues from the checkpoint, over the same buffer.
    again = Run(run_dir, "--steps", "200")
    resumed_at = time.time()
    try:
        trainer_log = run_dir / "logs/trainer.log"
        again.wait_until(lambda: f"trainer starts at step {checkpoint}," in trainer_log.read_text(),
                         "resumed trainer")
        again.wait_until(lambda: any(r["step"] == checkpoint + 1 and r["time"] > resumed_at
                                     for r in records_so_far(run_dir)), "step after the checkpoint")
        assert again.stop() == 130, again.output()
        assert again.left_running() == [], again.describe()
    finally:
        again.kill()
    after = group_fates(run_dir / "redis", job.metadata.name)
    # Redis' history continues (the same files, nothing forgotten), and every group that
    # waited at the stop was then trained on, dropped as stale, or still waits: none lost.
    assert after.accepted[:len(before.accepted)] == before.accepted
    assert after.trained[:len(before.trained)] == before.trained
    assert sorted(after.trained + after.dropped + after.waiting) == sorted(after.accepted)
    assert set(before.waiting) <= set(after.trained + after.dropped + after.waiting)
    # The resumed trainer took its batches from that buffer: it trained on more than before.
    assert len(after.trained) > len(before.trained)


def job_with_trainer_processes(tmp_path: Path, processes: int) -> Path:
    """examples/tiny.yaml, its trainer `processes` processes (more than one: under torchrun)."""
    return tiny_with(tmp_path, f"tiny-{processes}",
                     lambda spec: spec["trainer"].update(processesPerReplica=processes))


def wait_for_every_process(run: Run, trainer_processes: int = 1) -> None:
    """Until redis-server and every service run, the trainer's torchrun and each of its ranks
    too (all named `serve trainer`)."""
    trainers = 1 if trainer_processes == 1 else 1 + trainer_processes

    def up() -> bool:
        names = [_service_name(p) for p in run.processes()]
        return ({"redis-server", "buffer", "reward", "rollout"} <= set(names)
                and names.count("trainer") == trainers)

    run.wait_until(up, "redis-server and every service")


def wait_until_none_left(run: Run, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while run.left_running():
        assert time.monotonic() < deadline, f"still running after {timeout:.0f} s:\n" + \
            "\n".join(run.left_running())
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_hangup_and_terminate_stop_every_process_as_ctrl_c_does(tmp_path, sig):
    """kill -HUP and kill -TERM: the stop of Ctrl-C, its exit code and message, and no process
    of the run left, the redis-server it started included."""
    run = Run(tmp_path / "run", "--steps", "200")
    try:
        wait_for_every_process(run)
        assert run.stop(sig) == 130, run.output()
        assert "rerun the same command to resume" in flat(run.output())
        assert run.left_running() == [], run.describe()
    finally:
        run.kill()


@pytest.mark.slow
def test_closing_the_terminal_stops_every_process_and_still_writes_the_report(tmp_path):
    """`asyncrl run` in a terminal window that is then closed, with a trainer under torchrun:
    the kernel's SIGHUP stops the run as Ctrl-C does, although nothing can be written to the
    terminal any more, and no process is left, torchrun's ranks and redis-server included."""
    run_dir = tmp_path / "run"
    run = RunInTerminal(run_dir, "--steps", "200", job=job_with_trainer_processes(tmp_path, 2))
    try:
        wait_for_every_process(run, trainer_processes=2)
        run.wait_until(lambda: records_so_far(run_dir), "first training step")
        run.close_terminal()
        assert run.process.wait(timeout=300) == 130, run.describe()
        assert run.left_running() == [], run.describe()
    finally:
        run.kill()
    assert (run_dir / "report.md").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("trainer_processes", [1, 2], ids=["trainer", "torchrun"])
def test_a_runner_killed_with_kill_9_leaves_no_process_behind(tmp_path, trainer_processes):
    """Nothing of the runner's own stop runs: the kernel's death signal, which every child
    asked for, ends redis-server and the services (and torchrun its ranks)."""
    run = Run(tmp_path / "run", "--steps", "200",
              job=job_with_trainer_processes(tmp_path, trainer_processes))
    try:
        wait_for_every_process(run, trainer_processes)
        run.processes()
        run.runner.kill()
        assert run.process.wait(timeout=30) == -signal.SIGKILL
        wait_until_none_left(run)
    finally:
        run.kill()


@pytest.mark.slow
def test_killing_the_trainer_mid_step_loses_no_accepted_sample(tmp_path):
    job = load_manifest(TINY)
    options = RunOptions(run_dir=tmp_path / "run", max_steps=6)
    local = LocalJob(job, options)
    try:
        local.start()
        trainer = next(s for s in local.services if s.name == "trainer")
        deadline = time.monotonic() + 300
        while True:  # kill it while an update is being applied, before its ack
            status = local.trainer_status()
            if status is not None and status.step >= 1 and status.phase == "training":
                break
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.kill(trainer.process.pid, signal.SIGKILL)
        trainer.process.wait()
        trainer.start()
        while not local.trainer_done():
            local.check()
            assert time.monotonic() < deadline + 300
            time.sleep(0.5)
        stats = local.buffer_stats()
    finally:
        local.stop()
    assert stats.redelivered_total >= 1
    # The buffer knows how far training went (the step decides completion) even when the
    # restart moved the version past it.
    assert stats.trainer_step == 6 and stats.trainer_version >= 6
    # Every accepted group was trained on, is still waiting, or was dropped as stale (and
    # counted): none vanished. The restarted trainer redid the steps after its checkpoint,
    # so it consumed at least the six batches of its budget.
    assert stats.accepted_total == (stats.consumed_total + stats.depth_groups
                                    + stats.dropped_stale_total)
    assert stats.consumed_total >= 6 * job.spec.algorithm.batch_size
    # The same by group id, from what Redis itself wrote (its append-only file) rather than
    # the buffer's counters: each accepted group once, and then exactly one of trained (in
    # an acknowledged batch), dropped as stale, or still waiting; none twice, none missing.
    fates = group_fates(options.run_dir / "redis", job.metadata.name)
    assert len(set(fates.accepted)) == len(fates.accepted)
    assert sorted(fates.trained + fates.dropped + fates.waiting) == sorted(fates.accepted)
    assert len(fates.trained) >= 6 * job.spec.algorithm.batch_size
    # The buffer's counters, read while the rollout worker still ran, cannot exceed them.
    assert stats.accepted_total <= len(fates.accepted)
    assert stats.consumed_total <= len(fates.trained)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_crashed_service_stops_the_job_with_its_log_tail(tmp_path):
    run_dir = tmp_path / "run"
    run = Run(run_dir, "--steps", "200")
    try:
        run.wait_until(lambda: records_so_far(run_dir), "first training step")
        rollout = run.service("rollout")
        rollout.kill()  # kill -9, by pid
        code = run.process.wait(timeout=300)
        output = run.output()
        assert code == 1, output
        assert "rollout exited with code -9; last lines of its log:" in flat(output)
        log_tail = (run_dir / "logs/rollout.log").read_text().splitlines()[-3:]
        assert flat("\n".join(log_tail)) in flat(output), log_tail
        # Every other process it started, redis-server included, stopped before it returned.
        assert run.left_running() == [], run.describe()
    finally:
        run.kill()


def test_the_runner_restarts_the_redis_it_owns_on_its_files_a_bounded_number_of_times(tmp_path):
    lines = []
    local = LocalJob(load_manifest(TINY), RunOptions(run_dir=tmp_path / "run"),
                     notify=lines.append)
    url = local.start_redis()
    client = redis.Redis.from_url(url)
    try:
        client.set("written-before", "kept")
        for restart in range(1, REDIS_MAX_RESTARTS + 1):
            local.redis.kill()  # kill -9
            local.check()
            # The same port (the services' URL) and files (the AOF): nothing acknowledged lost.
            assert client.get("written-before") == b"kept"
            assert f"redis-server exited with code -9; restarting it on port {local.redis.port}" \
                in lines[-2]
            assert f"(restart {restart} of {REDIS_MAX_RESTARTS})" in lines[-2]
        local.redis.kill()
        with pytest.raises(ServiceFailed) as failed:
            local.check()
        assert "redis-server" in str(failed.value) and "exited with code -9" in str(failed.value)
        assert "Redis is starting" in failed.value.log_tail  # its own log, for the user
    finally:
        client.close()
        local.stop()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_redis_killed_mid_run_is_restarted_and_the_run_completes_losing_nothing(tmp_path):
    run_dir = tmp_path / "run"
    job = load_manifest(TINY)
    steps = 8
    run = Run(run_dir, "--steps", str(steps))
    at_kill = tmp_path / "redis-at-kill"
    try:
        run.wait_until(lambda: records_so_far(run_dir), "first training step")
        redis_server = run.service("redis-server")
        (port,) = {c.laddr.port for c in redis_server.net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN}
        down = f"Redis at 127.0.0.1:{port} is unreachable"
        # The runner is paused while Redis is down: the files copied are what Redis had
        # acknowledged when it was killed, and the outage lasts until the services saw it.
        run.runner.suspend()
        try:
            redis_server.kill()  # kill -9, by pid
            wait_until_dead(redis_server)
            shutil.copytree(run_dir / "redis", at_kill)
            for service in ("buffer", "rollout"):
                run.wait_until(lambda: down in (run_dir / f"logs/{service}.log").read_text(),
                               f"{service} seeing the outage")
        finally:
            run.runner.resume()
        code = run.process.wait(timeout=1500)
        output = flat(run.output())
        assert code == 0, run.describe()
        assert "redis-server exited with code -9; restarting it on port" in output, output
        assert "redis-server is back" in output
        assert run.left_running() == [], run.describe()
    finally:
        run.kill()
    # Every training step recorded once, the run carried on after the restart.
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, steps + 1))
    # Every group accepted before the kill (from what Redis had written then) is still in the
    # history after the run, and was trained on, dropped as stale or still waits: none lost.
    before = group_fates(at_kill, job.metadata.name)
    after = group_fates(run_dir / "redis", job.metadata.name)
    assert before.accepted
    assert after.accepted[:len(before.accepted)] == before.accepted
    assert after.trained[:len(before.trained)] == before.trained
    assert set(before.waiting) <= set(after.trained + after.dropped + after.waiting)
    assert sorted(after.trained + after.dropped + after.waiting) == sorted(after.accepted)
    assert len(after.accepted) > len(before.accepted)  # generation went on after the restart


def wait_until_dead(process: psutil.Process, timeout: float = 60) -> None:
    """Until `process` is gone or a zombie (its parent is paused and cannot reap it): its
    files are closed either way."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"{process.pid} still runs after kill -9"
        time.sleep(0.05)
