"""`asyncrl run`: the whole job on one machine, as separate service processes on loopback.

    redis-server (unless the job names one) -> buffer -> trainer -> rollout workers

Each service is the same `asyncrl serve ...` command the operator runs in a pod, and there are
as many rollout worker processes as the job's `rollout.replicas` (pods in a cluster). The runner
splits the CPU cores between the trainer and the rollout workers, waits for each to be healthy,
shows live progress, and stops everything cleanly on completion, on Ctrl-C, `kill` or the
terminal closing (SIGINT, SIGTERM, SIGHUP: one and the same stop), or on a crash (with the
crashed service's log tail). Every child, redis-server included, also gets SIGTERM from the
kernel if the runner dies without stopping it (kill -9), so a run never leaves one behind.
A redis-server it started that dies is started again on the same port and files (its AOF
holds every acknowledged write) while the services wait for it, as a StatefulSet brings a
Redis pod back, up to REDIS_MAX_RESTARTS times. The run folder holds everything needed to
resume.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

# Children are started with a preexec_fn: the package itself turns gRPC's fork support off
# before grpc is imported (asyncrl/__init__.py).
import grpc
import yaml
from google.protobuf.json_format import MessageToDict

from asyncrl.platform.children import die_with_parent
from asyncrl.platform.core_lending import (
    MOST_THREADS, create_lending_file, threads_adjustable,
)
from asyncrl.platform.grpc_health import is_serving_at
from asyncrl.platform.outage import DEFAULT_OUTAGE_SECONDS
from asyncrl.platform.redis_server import RedisServer, free_port
from asyncrl.model.hub import hub_model
from asyncrl.platform.settings import environment_name, serve_command
from asyncrl.launch.sglang import groups_per_replica
from asyncrl.launch.torchrun import LOCAL_MAX_RESTARTS, torchrun_arguments
from asyncrl.local.devices import (
    DevicePlan,
    DevicesError,
    DevicesOption,
    plan_devices,
    runner_cuda_visible,
    visible_gpus,
)
from asyncrl.spec import RLJob, parse_manifest
from asyncrl.weights.ipc import release_buffer
from asyncrl.weights.paths import transfer_path
from asyncrl.v1 import (
    buffer_pb2,
    buffer_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)


#: How often a run restarts the redis-server it owns before it gives up (a Redis that keeps
#: dying, e.g. on a full disk, is not going to recover by itself).
REDIS_MAX_RESTARTS = 5
#: A restarted Redis reloads its whole AOF before it answers; the services wait as long.
REDIS_RESTART_SECONDS = DEFAULT_OUTAGE_SECONDS


class ServiceFailed(RuntimeError):
    def __init__(self, name: str, returncode: int | None, log_tail: str):
        super().__init__(f"{name} exited with code {returncode}")
        self.name, self.returncode, self.log_tail = name, returncode, log_tail


#: What stops a run, all three alike: Ctrl-C, `kill`, and the terminal closing.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_on_signals() -> None:
    """Each of STOP_SIGNALS raises KeyboardInterrupt in the main thread, where `asyncrl run`
    stops every service in order, then redis-server, and leaves the folder resumable. Without
    this, SIGHUP (a closed terminal) would end the runner at once, before any clean-up. Also
    makes Ctrl-C work when the shell started the run in the background with SIGINT ignored.

    Only the first signal interrupts: the later ones are ignored, so that a second Ctrl-C, or
    the SIGHUP that the kernel and then the shell each send when a terminal closes, cannot cut
    the stop short and leave children to end out of order (each service's stop is bounded).
    Once the terminal has closed, every write to it fails (EIO), which would end the stop and
    the report early too: its output goes to /dev/null instead."""
    terminals = [fd for fd in (1, 2) if os.isatty(fd)]

    def interrupt(*_):
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        # A terminal that hung up is no longer a tty (its ioctls fail), whatever the signal.
        gone = [fd for fd in terminals if not os.isatty(fd)]
        if gone:
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in gone:
                os.dup2(devnull, fd)
            os.close(devnull)
        raise KeyboardInterrupt

    for sig in STOP_SIGNALS:
        signal.signal(sig, interrupt)


@dataclass
class ServiceProcess:
    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen | None = None

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("a")
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.args)}\n")
        log.flush()
        # Own session: Ctrl-C in the terminal, or the terminal closing, reaches the runner only,
        # which then stops each service in order. SIGTERM if the runner dies without doing so.
        self.process = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        return self

    @property
    def component(self) -> str:
        """The service it is an instance of: "rollout" for every rollout worker."""
        return self.name.partition("-")[0]

    @property
    def index(self) -> int:
        """Its replica index (rollout-<index>; 0 for a service's first or only process)."""
        _, _, index = self.name.partition("-")
        return int(index) if index else 0

    def check(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise ServiceFailed(self.name, self.process.returncode, self.log_tail())

    def stop(self, timeout: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass(frozen=True)
class RunOptions:
    run_dir: Path
    sync: bool = False
    max_steps: int | None = None
    trainer_threads: int | None = None
    rollout_threads: int | None = None
    metrics: bool = False  # each service serves /metrics; Prometheus files in <run_dir>/prometheus
    # Trainer and rollout worker lend each other their threads while they wait
    # (asyncrl.platform.core_lending), where the job has one of each on the CPU.
    lend_cores: bool = True
    devices: DevicesOption = "auto"  # --devices: auto, cpu or GPU indices (asyncrl.local.devices)


#: The node selector the job as run locally carries where the runner gives a service GPUs:
#: the spec asks one of every pod with GPUs (to pick a cluster's GPU pool); here no scheduler
#: reads it.
LOCAL_NODE_SELECTOR = {"asyncrl.io/run": "local"}


def resolve_manifest(manifest: Mapping | RLJob, options: RunOptions,
                     plan: DevicePlan | None = None) -> RLJob:
    """The job as this run executes it: the manifest validated as an RLJob, with this run's
    overrides (--sync means η = 0, generation waits for training; --steps sets maxSteps), its
    file paths absolute and, given a device `plan`, each service's GPUs (placement.gpus; the
    job's own placement is the cluster's) and the weight transfer the plan allows
    (ipc only where trainer and rollout share a GPU). Its `resolved()` is what the services
    read, the same form as the operator's ConfigMap: every default filled in."""
    job = manifest if isinstance(manifest, RLJob) else parse_manifest(manifest)
    spec = job.spec
    algorithm = {}
    if options.sync:
        algorithm["max_staleness"] = 0
    if options.max_steps:
        algorithm["max_steps"] = options.max_steps
    # Data and reward code are named relative to where `asyncrl run` was started; the
    # services run elsewhere (the run folder), so they get absolute paths.
    dataset = {key: _absolute(getattr(spec.dataset, key)) for key in ("path", "eval_path")}
    sections = {"algorithm": spec.algorithm.model_copy(update=algorithm),
                "dataset": spec.dataset.model_copy(update=dataset)}
    if spec.reward.python is not None:
        python = spec.reward.python.model_copy(update={"path": _absolute(spec.reward.python.path)})
        sections["reward"] = spec.reward.model_copy(update={"python": python})
    if plan is not None:
        # SGLang without a GPU here is a command of one's own (run_devices refuses it
        # otherwise): the job's placement stays, since the spec asks GPUs of SGLang workers.
        if spec.rollout.engine != "sglang" or plan.rollout.gpus:
            sections["rollout"] = spec.rollout.model_copy(update={
                "placement": _placed(spec.rollout.placement, len(plan.rollout.gpus))})
        transfer, _ = transfer_path(spec.trainer.weight_transfer, plan.trainer.device,
                                    plan.rollout.device, spec.rollout.engine)
        sections["trainer"] = spec.trainer.model_copy(update={
            "placement": _placed(spec.trainer.placement, len(plan.trainer.gpus)),
            "weight_transfer": transfer})
    # Validated again as a whole: the rules between fields hold for the job as run too.
    return parse_manifest(job.model_copy(update={"spec": spec.model_copy(update=sections)})
                          .to_manifest())


def _placed(placement, gpus: int):
    """`placement` with the GPUs this run gives the service (and, with some, a node selector
    if it has none, which the spec requires of a pod with GPUs)."""
    update = {"gpus": gpus}
    if gpus and not placement.node_selector:
        update["node_selector"] = dict(LOCAL_NODE_SELECTOR)
    return placement.model_copy(update=update)


def run_devices(job: RLJob, option: DevicesOption) -> DevicePlan:
    """The devices of this run's services for --devices `option`, on this machine's GPUs.
    Raises DevicesError."""
    spec = job.spec
    plan = plan_devices(option, visible_gpus(),
                        trainer_processes=spec.trainer.processes_per_replica,
                        rollout_engine=spec.rollout.engine, cuda_visible=runner_cuda_visible())
    # A command of one's own in place of SGLang (RolloutSettings.sglang_command, from the
    # environment) may need no GPU: SGLang's HTTP API served by something else.
    own_server = bool(os.environ.get(environment_name("sglang_command")))
    if spec.rollout.engine == "sglang" and not plan.rollout.gpus and not own_server:
        raise DevicesError(f"rollout.engine sglang needs a GPU, and this run computes on the "
                           f"CPU ({plan.cpu_reason}): use --devices auto or GPU indices on a "
                           "machine with CUDA, or rollout.engine torch")
    return plan


def _absolute(value: str | None) -> str | None:
    if isinstance(value, str) and "://" not in value:
        return os.path.abspath(value)
    return value


def thread_split(options: RunOptions) -> tuple[int, int]:
    """(trainer, rollout) torch threads. Async: the cores are shared, half each. Sync: the two
    alternate, so each may use every core."""
    cores = os.cpu_count() or 1
    if options.sync:
        default = (cores, cores)
    else:
        rollout = max(1, cores // 2)
        default = (max(1, cores - rollout), rollout)
    return options.trainer_threads or default[0], options.rollout_threads or default[1]


class LocalJob:
    def __init__(self, job: RLJob, options: RunOptions, notify: Callable[[str], None] = print):
        """Raises DevicesError when --devices (options.devices) cannot be honoured here."""
        requested = job if isinstance(job, RLJob) else parse_manifest(job)
        self.devices = run_devices(requested, options.devices)
        self.job = resolve_manifest(requested, options, self.devices)  # as this run executes it
        self.options = options
        self.notify = notify  # one line of the run's output, for events worth telling the user
        # Absolute from here on: services (redis-server above all, which changes into its
        # --dir before opening its log) must not read a relative path against their own cwd.
        self.run_dir = options.run_dir.resolve()
        self.config_path = self.run_dir / "config.yaml"
        self.services: list[ServiceProcess] = []
        self.redis: RedisServer | None = None
        self.redis_restarts = 0
        self.ports = {name: free_port() for name in (
            "buffer", "reward", "trainer", "trainer_weights")}
        #: Each rollout worker's (HTTP, gRPC) ports, by replica index; a worker started again
        #: (a local scale out after a scale in) gets its index's ports again.
        self.rollout_ports = {index: (free_port(), free_port())
                              for index in range(self.job.spec.rollout.replicas)}
        # /metrics of each service (the rollout worker serves it on its HTTP port), and with
        # rollout.autoscale the runner's own autoscaler as "operator"; 0 = off.
        served = ("buffer", "reward", "trainer") + (
            ("operator",) if self.job.spec.rollout.autoscale is not None else ())
        self.metrics_ports = {name: free_port() if options.metrics else 0 for name in served}
        self.prometheus_dir = self.run_dir / "prometheus"
        self.trainer_threads, self.rollout_threads = thread_split(options)
        self._env: dict[str, str] = {}
        self._addresses: dict[str, str | None] = {}
        self._requested_transfer = requested.spec.trainer.weight_transfer
        self._requested_fields = requested.spec.model_fields_set  # what the manifest sets

    def device_lines(self) -> list[str]:
        """The run's first lines: what each service computes on, and how weights travel when
        that is not what the job asks (ipc without a shared device)."""
        lines = self.devices.lines()
        devices = self.devices
        path, reason = transfer_path(self._requested_transfer, devices.trainer.device,
                                     devices.rollout.device, self.job.spec.rollout.engine)
        if reason:
            lines.append(f"weights: {path}, not {self._requested_transfer} ({reason})")
        elif path == "ipc":
            how = ("shared memory" if devices.trainer.device == "cpu"
                   else f"CUDA IPC on {devices.trainer.device}")
            lines.append(f"weights: ipc ({how})")
        return lines

    def lifetime_lines(self) -> list[str]:
        """A line for the lifetime rules the job sets that only a cluster applies; the run's
        deadline (activeDeadlineSeconds) `asyncrl run` applies itself."""
        spec = self.job.spec
        cluster_only = [name for name, field in (("backoffLimit", "backoff_limit"),
                                                 ("ttlSecondsAfterFinished",
                                                  "ttl_seconds_after_finished"),
                                                 ("keepRunVolume", "keep_run_volume"))
                        if field in self._requested_fields]
        lines = []
        if cluster_only:
            lines.append(f"{', '.join(cluster_only)}: the operator's, in a cluster; here a "
                         "service that exits stops the run, and the run folder stays")
        if spec.active_deadline_seconds:
            lines.append(f"activeDeadlineSeconds {spec.active_deadline_seconds}: the run stops "
                         "(resumable) once it has run that long")
        return lines

    @functools.cached_property
    def lending_file(self) -> Path | None:
        """The file through which the trainer and the rollout worker lend each other their
        threads (asyncrl.platform.core_lending), or None where they do not: with --sync (each
        has every core already), --no-lend-cores, a GPU, several trainer processes or
        rollout workers (lending is between two processes), a torch whose thread count is
        fixed once it has computed (no OpenMP)."""
        spec = self.job.spec
        lends = (self.options.lend_cores and not self.options.sync
                 and not self.devices.trainer.gpus and not self.devices.rollout.gpus
                 and spec.trainer.processes_per_replica == 1
                 and self.most_rollout_workers == 1 and spec.rollout.engine == "torch"
                 and max(self.trainer_threads, self.rollout_threads) <= MOST_THREADS
                 and threads_adjustable())
        return self.run_dir / "cores" if lends else None

    def lending_lines(self) -> list[str]:
        """A line saying that the two lend each other their cores, where they do."""
        if self.lending_file is None:
            return []
        return [f"cores: the trainer ({self.trainer_threads}) and the rollout worker "
                f"({self.rollout_threads}) compute with each other's threads while the other "
                f"waits (--no-lend-cores: each keeps its own)"]

    def gate_lines(self) -> list[str]:
        """A line when the job will wait on its own gate: at η = 0 (--sync) a group skipped as
        uniform is replaced only once it has finished, one round of generation after another."""
        algorithm = self.job.spec.algorithm
        if algorithm.max_staleness or not algorithm.skip_uniform_groups \
                or algorithm.oversample_groups:
            return []
        room = self.job.spec.rollout.max_concurrent_rollouts - algorithm.batch_size
        return [f"η = 0 with skipUniformGroups: each skipped group is generated again after it, "
                f"so a step may wait for several rounds; algorithm.oversampleGroups: {room} "
                f"would generate them beside the batch"] if room > 0 else []

    # ------------------------------------------------------------------ lifecycle

    def write_job_file(self) -> None:
        """The job as this run executes it, where every service reads it (config.yaml)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.job.resolved(), sort_keys=False))

    def start(self) -> None:
        self.write_job_file()
        if self.options.metrics:
            self.write_prometheus_config()
        redis_url = self.start_redis()
        exe = str(Path(sys.executable).parent / "asyncrl")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if hub_model(self.job.spec.model.source) is not None:
            # `asyncrl run` has just downloaded it: every service loads that snapshot from the
            # cache, and none asks the Hub again (its branch may have moved meanwhile).
            env["HF_HUB_OFFLINE"] = "1"
        job_file = self.config_path
        if self.lending_file is not None:
            create_lending_file(self.lending_file)
        buffer_address = f"127.0.0.1:{self.ports['buffer']}"
        self._launch("buffer", [exe, *serve_command(
            "buffer", job_file=job_file, redis_url=redis_url, grpc_port=self.ports["buffer"],
            metrics_port=self.metrics_ports["buffer"])], env)
        self._wait(lambda: is_serving_at(buffer_address), "buffer")
        reward_address = f"127.0.0.1:{self.ports['reward']}"
        self._launch("reward", [exe, *serve_command(
            "reward", job_file=job_file, grpc_port=self.ports["reward"],
            metrics_port=self.metrics_ports["reward"], workers=1)], env)
        self._wait(lambda: is_serving_at(reward_address), "reward")
        self._launch("trainer", self._trainer_command(exe, buffer_address, reward_address),
                     {**env, **self.devices.trainer.env})
        self._env = env
        self._addresses = {"buffer": buffer_address, "reward": reward_address,
                           "redis": redis_url, "weights": self._weights_address()}
        for index in range(self.job.spec.rollout.replicas):
            self.start_rollout_worker(index)
        self._wait(lambda: self.trainer_status() is not None, "trainer", timeout=600)

    # ------------------------------------------------------------------ rollout workers

    @property
    def rollout_workers(self) -> list[ServiceProcess]:
        """The rollout worker processes running now, by replica index."""
        return sorted((s for s in self.services if s.component == "rollout"),
                      key=lambda s: s.index)

    @property
    def most_rollout_workers(self) -> int:
        """rollout.replicas, or with rollout.autoscale its maxReplicas."""
        rollout = self.job.spec.rollout
        return rollout.autoscale.max_replicas if rollout.autoscale else rollout.replicas

    def worker_threads(self) -> int:
        """torch threads of each rollout worker: the rollout's share of the cores split between
        as many workers as may run at once, at least one each."""
        return max(1, self.rollout_threads // self.most_rollout_workers)

    def rollout_lines(self) -> list[str]:
        """With more than one rollout worker, or autoscaling, a line saying how many and what
        each gets."""
        rollout = self.job.spec.rollout
        replicas, most = rollout.replicas, self.most_rollout_workers
        if most == 1:
            return []
        threads = self.worker_threads()
        plural = "es" if replicas > 1 else ""
        if rollout.autoscale:
            line = (f"rollout: {replicas} worker process{plural} to start, autoscaled between "
                    f"{rollout.autoscale.min_replicas} and {most} (rollout.autoscale)")
        else:
            line = f"rollout: {replicas} worker process{plural} (rollout.replicas)"
        groups = groups_per_replica(self.job.spec)
        line += (f", {threads} thread{'s' if threads > 1 else ''} and up to {groups} "
                 f"prompt{'s' if groups > 1 else ''} at once each (rollout.maxConcurrentRollouts "
                 f"{rollout.max_concurrent_rollouts} shared)")
        if most * threads > self.rollout_threads:
            line += (f", more than the rollout's {self.rollout_threads} of "
                     f"{os.cpu_count()} cores: they take turns")
        if self.devices.rollout.gpus:
            line += f", all on {self.devices.rollout.device}"
        return [line]

    def start_rollout_worker(self, index: int) -> None:
        """Starts rollout worker `index` (worker name rollout-<index>, its own ports), with the
        threads of the job's replica count."""
        http_port, grpc_port = self.rollout_ports.setdefault(index, (free_port(), free_port()))
        extra = {}
        if self.job.spec.rollout.engine == "sglang":
            extra["sglang_port"] = free_port()  # each worker's own SGLang server
        exe = str(Path(sys.executable).parent / "asyncrl")
        args = [exe, *serve_command(
            "rollout", job_file=self.config_path, buffer_address=self._addresses["buffer"],
            reward_address=self._addresses["reward"], redis_url=self._addresses["redis"],
            http_port=http_port, grpc_port=grpc_port, worker=f"rollout-{index}",
            weights_address=self._addresses["weights"], threads=self.worker_threads(),
            lend_cores_file=self.lending_file, **extra)]
        if self.options.metrics:
            self.write_prometheus_config()  # Prometheus reads the targets again by itself
        self.services.append(ServiceProcess(
            rollout_name(index), args, self.run_dir / "logs" / f"{rollout_name(index)}.log",
            {**self._env, **self.devices.rollout.env}).start())

    def stop_rollout_worker(self, index: int) -> None:
        """Stops rollout worker `index` as a pod scaled away stops (SIGTERM): it hands the
        prompts it holds back to the buffer, which gives them out again."""
        worker = next(s for s in self.rollout_workers if s.index == index)
        worker.stop()
        self.services.remove(worker)

    def start_redis(self) -> str:
        """The job's Redis URL: the one the job names, else that of a redis-server this run
        starts (and owns) with its files in <run_dir>/redis, every write in its AOF."""
        if self.job.spec.buffer.redis.url is not None:
            return self.job.spec.buffer.redis.url
        self.redis = RedisServer(self.run_dir / "redis", append_only=True,
                                 supervised=True).start()
        return self.redis.url

    def _weights_address(self) -> str | None:
        """Where the rollout worker joins the trainer's weight transfer group, if it does."""
        if self.job.spec.trainer.weight_transfer != "distributed":
            return None
        return f"127.0.0.1:{self.ports['trainer_weights']}"

    def _trainer_command(self, exe: str, buffer_address: str, reward_address: str) -> list[str]:
        """`asyncrl serve trainer ...`; with trainer.processesPerReplica > 1 the same command
        under torchrun, one process per replica slot, the trainer threads split between them.
        A rank that dies makes torchrun stop the others and start them all again (at most
        LOCAL_MAX_RESTARTS times), resuming from the last checkpoint; the runner sees one
        process that exits 0 once every rank is done."""
        processes = self.job.spec.trainer.processes_per_replica
        serve = serve_command(
            "trainer", job_file=self.config_path, buffer_address=buffer_address,
            reward_address=reward_address, run_dir=self.run_dir, grpc_port=self.ports["trainer"],
            metrics_port=self.metrics_ports["trainer"], weights_port=self.ports["trainer_weights"],
            threads=max(1, self.trainer_threads // processes), lend_cores_file=self.lending_file)
        if processes == 1:
            return [exe, *serve]
        return [sys.executable, "-m", "torch.distributed.run",
                *torchrun_arguments(processes, max_restarts=LOCAL_MAX_RESTARTS), *serve]

    def write_prometheus_config(self) -> Path:
        """<run_dir>/prometheus/targets.json (Prometheus file_sd: one entry per service, labelled
        `service` and `rljob`) and prometheus.yml, which scrapes them: run
        `prometheus --config.file=<run_dir>/prometheus/prometheus.yml`. Returns the latter."""
        job = self.job.metadata.name
        targets = {**self.metrics_ports,
                   **{rollout_name(index): http for index, (http, _) in self.rollout_ports.items()}}
        groups = [{"targets": [f"127.0.0.1:{port}"],
                   "labels": {"service": name.partition("-")[0], "process": name,
                              "rljob": job}}
                  for name, port in targets.items()]
        config = {
            "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
            "scrape_configs": [{
                "job_name": "asyncrl",
                # The services' own `rljob` label wins over the target's (the same value), rather
                # than being renamed to exported_rljob.
                "honor_labels": True,
                # Relative to this file's folder: the run folder may be moved.
                "file_sd_configs": [{"files": ["targets.json"], "refresh_interval": "5s"}],
            }],
        }
        self.prometheus_dir.mkdir(parents=True, exist_ok=True)
        # Written whole and renamed: Prometheus watches the file and must never read half of it.
        for name, text in (("targets.json", json.dumps(groups, indent=2) + "\n"),
                           ("prometheus.yml", yaml.safe_dump(config, sort_keys=False))):
            partial = self.prometheus_dir / f".{name}.partial"
            partial.write_text(text)
            partial.replace(self.prometheus_dir / name)
        return self.prometheus_dir / "prometheus.yml"

    def _launch(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.services.append(ServiceProcess(name, args, self.run_dir / "logs" / f"{name}.log", env).start())

    def _wait(self, ready, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not become ready within {timeout:.0f}s; "
                                   f"see {self.run_dir / 'logs'}")
            time.sleep(0.2)

    def check(self) -> None:
        """Raises ServiceFailed for the first service that exited, the trainer excepted once it
        finished its steps; restarts the run's own redis-server if it died."""
        self._check_redis()
        for service in self.services:
            if service.name == "trainer" and service.process.poll() == 0:
                continue
            service.check()

    def _check_redis(self) -> None:
        """A redis-server of this run that exited (only stop() ends it on purpose) is started
        again on the same port and data folder, where it reloads its AOF; the services ride
        through meanwhile. After REDIS_MAX_RESTARTS restarts, the run fails as for a crashed
        service."""
        if self.redis is None or self.redis.returncode is None:
            return
        code = self.redis.returncode
        if self.redis_restarts >= REDIS_MAX_RESTARTS:
            raise ServiceFailed(f"redis-server (restarted {self.redis_restarts} times already)",
                                code, self.redis.log_tail())
        self.redis_restarts += 1
        self.notify(f"redis-server exited with code {code}; restarting it on port "
                    f"{self.redis.port} from {self.redis.data_dir} (restart "
                    f"{self.redis_restarts} of {REDIS_MAX_RESTARTS}); the services wait for it")
        try:
            self.redis.start(timeout=REDIS_RESTART_SECONDS)
        except (RuntimeError, TimeoutError) as exc:  # it exited again, or never answered
            raise ServiceFailed("redis-server", self.redis.returncode,
                                self.redis.log_tail()) from exc
        self.notify(f"redis-server is back on port {self.redis.port}")

    def trainer_done(self) -> bool:
        trainer = next(s for s in self.services if s.name == "trainer")
        return trainer.process.poll() == 0

    def stop(self) -> None:
        # The rollout side first (it writes into the buffer), then trainer, buffer, Redis.
        order = ["rollout", "trainer", "reward", "buffer"]
        for service in sorted(self.services, key=lambda s: order.index(s.component)):
            service.stop()
        if self.redis is not None:
            self.redis.stop()
        # The weights buffer of a trainer that could not release it itself (killed).
        release_buffer(self.run_dir / "weights" / "ipc")

    # ------------------------------------------------------------------ observation

    def trainer_status(self) -> trainer_pb2.TrainerStatus | None:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{self.ports['trainer']}") as channel:
                stub = trainer_pb2_grpc.TrainerStatusServiceStub(channel)
                return stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=2)
        except grpc.RpcError:
            return None

    def buffer_stats(self) -> buffer_pb2.BufferStats | None:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{self.ports['buffer']}") as channel:
                stub = buffer_pb2_grpc.BufferStub(channel)
                return stub.GetStats(buffer_pb2.GetStatsRequest(job=self.job.metadata.name), timeout=2)
        except grpc.RpcError:
            return None

    def record_rollout_status(self) -> None:
        """Appends each rollout engine's counters to rollout_status.jsonl, one line per worker
        (occupancy, idle time, interruptions over the run: what the async-vs-sync comparison
        is explained with)."""
        for worker in self.rollout_workers:
            status = self.rollout_status(worker.index)
            if status is None:
                continue
            record = {"time": time.time(), "worker": f"rollout-{worker.index}",
                      **MessageToDict(status, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True)}
            with (self.run_dir / "rollout_status.jsonl").open("a") as out:
                out.write(json.dumps(record) + "\n")

    def rollout_status(self, index: int) -> rollout_pb2.RolloutStatus | None:
        """Rollout worker `index`'s engine counters (None while it does not answer)."""
        try:
            with grpc.insecure_channel(f"127.0.0.1:{self.rollout_ports[index][1]}") as channel:
                stub = rollout_pb2_grpc.RolloutControlStub(channel)
                return stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=2)
        except grpc.RpcError:
            return None


def rollout_name(index: int) -> str:
    """A rollout worker's service name (and log file's): "rollout" for the first, as with one
    worker, "rollout-<index>" for the others."""
    return "rollout" if index == 0 else f"rollout-{index}"
