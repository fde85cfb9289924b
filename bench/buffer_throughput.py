"""Buffer throughput under many rollout workers: samples/s through the buffer against
redis-benchmark's SET rate at the same value size and concurrency, measured in one run.

Each cell (N workers, sample length) starts a private redis-server with AOF as
asyncrl.platform.redis_server runs it (appendfsync always), `asyncrl serve buffer` over it, N
rollout-worker processes and one trainer process, all real gRPC clients (BufferClient). A
worker has one group of 8 samples under way at a time (like redis-benchmark's clients, one
request each; --in-flight for more, as the rollout workflow runs several, whose puts that
meet go as one message): it waits at the staleness gate for a slot and puts the group on its
PutGroups stream, asking for its next slot in the same round trip. The trainer does what the
trainer service does per step but train: GetBatch (receiving every part, not decoding the
groups), AckBatch, SetVersion. Samples/s is counted from
Redis' own totals (samples acknowledged by the trainer) over a window after a warm-up.
redis-benchmark runs SET with N clients and values of one sample's stored size against a
fresh, like-configured redis-server just before and just after the buffer (their mean is the
baseline: the machine is shared); the ratio is the buffer's samples/s to it. Every cell ends
by checking that each group a worker put was trained, dropped as stale or is still waiting.
Between the two, the same workers put into a server with the buffer's gRPC handlers that
does no work at all ("gRPC only"): the ceiling of any buffer written as a Python gRPC service
with these clients sharing these cores. Each process' own CPU counters over the window give
the CPU per group put of the buffer, Redis and the workers (and of the gRPC-only server and
its workers): steadier than the rates on a shared machine, and they say where a put's cost is.

The buffer also runs with N Go workers (bench/go_worker, built by its build.sh when Go is
installed; --no-go skips them) in place of the Python ones: separate processes making the same
calls, one thread each, as redis-benchmark's clients are one C process. A Python worker
process costs more CPU per put than the buffer itself, and on two shared cores that CPU is
taken from the buffer and Redis; in a cluster the workers run on their own machines.

    .venv/bin/python bench/buffer_throughput.py [--seconds 10] [--workers 32 128]
        [--tokens 1024 8192] [--in-flight 1] [--replicas 1] [--profile DIR] [--no-go]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import itertools
import math
import mmap
import multiprocessing
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import yaml

from asyncrl.platform import grpc_service
from asyncrl.clients.buffer import BufferClient
from asyncrl.buffer.server import BufferServicer, add_servicer
from asyncrl.platform.heap import reuse_large_blocks
from asyncrl.platform.redis_keys import key
from asyncrl.platform.redis_server import RedisServer, free_port
from asyncrl.v1 import buffer_pb2, common_pb2

ROOT = Path(__file__).resolve().parents[1]
JOB = "bench"
GROUP_SIZE = 8
BATCH_GROUPS = 512  # AReaL trains on 512 prompts a step ...
BATCH_BYTES = 64 << 20  # ... here at most 64 MB of groups (Redis holds up to 9 batches)
MAX_STALENESS = 8   # AReaL's for math
VOCAB = 151_936   # Qwen's: most token ids take 3 bytes on the wire, as in real records
WARMUP_SECONDS = 1.0

# AReaL's effective training throughput (tokens used by a training step / its time) on 512
# GPUs, read off the scaling figure of its paper (arXiv 2505.24298; also AReaL's
# benchmark/verl_v0_3_0_post1_76084d3/scaling_trend_vs_verl.png): about 90k tokens/s for the
# 7B model (16k and 32k context) and 35k for 32B; the 1.5B model reaches about 150k on 256
# GPUs, which scaled linearly to 512 would be 300k. The buffer also carries the generated
# tokens that are never trained (too stale), so it should sustain twice the highest figure.
AREAL_512_GPU_TOKENS_PER_S = {"7B": 90_000, "32B": 35_000}
AREAL_HIGHEST_TOKENS_PER_S = 300_000
MARGIN = 2


def make_group(tokens: int, seed: int) -> buffer_pb2.EncodedGroup:
    """A group of GROUP_SIZE samples of `tokens` tokens (a quarter prompt), as a worker puts it,
    read as an EncodedGroup so that its ids and token versions can be set without re-encoding
    every token."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(tokens // 4)]
    response = tokens - len(prompt)
    samples = [
        common_pb2.Trajectory(
            prompt_ids=prompt, response_ids=[rng.randrange(VOCAB) for _ in range(response)],
            behaviour_logprobs=[-rng.expovariate(2.0) for _ in range(response)],
            token_versions=[0] * response, reward=float(i % 2), finish_reason="stop",
            generate_seconds=30.0, reward_seconds=0.1,
        )
        for i in range(GROUP_SIZE)
    ]
    group = common_pb2.Group(group_id="g", prompt_id=f"p{seed}", samples=samples,
                             started_unix_ms=int(time.time() * 1000))
    return buffer_pb2.EncodedGroup.FromString(group.SerializeToString())


def stamp(group: buffer_pb2.EncodedGroup, version: int) -> None:
    """Every response token generated by `version` (one packed varint per token)."""
    for sample in group.samples:
        tokens = len(sample.behaviour_logprobs[0]) // 4
        sample.token_versions[:] = [_varint(version) * tokens]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def sample_bytes(group: buffer_pb2.EncodedGroup) -> int:
    """Bytes of one sample as the buffer stores it (in its group's protobuf)."""
    return len(group.SerializeToString()) // len(group.samples)


# ---------------------------------------------------------------- the processes of a cell


class SharedVersion:
    """The trainer's newest version, which workers stamp their groups with: an int64 in a
    mapped file, which the forked Python workers share and the Go workers map too."""

    def __init__(self, path: Path):
        path.write_bytes(bytes(8))
        self.path = path
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), 8)

    @property
    def value(self) -> int:
        return struct.unpack_from("<q", self._map)[0]

    @value.setter
    def value(self, version: int) -> None:
        struct.pack_into("<q", self._map, 0, version)


def _worker(address: str, name: str, group: buffer_pb2.EncodedGroup, in_flight: int,
            seconds: float, version: SharedVersion, start: multiprocessing.Barrier,
            results: multiprocessing.Queue) -> None:
    """A rollout worker with `in_flight` groups under way, as the rollout workflow runs
    several: each waits at the gate for a slot, is generated with the newest weights
    (`version`, as the trainer announced it) and is put, asking for the next slot in the same
    round trip. Generation itself takes no time here."""
    async def rollouts(client: BufferClient, slot, deadline: float, count) -> None:
        stamped = None
        while time.monotonic() < deadline:
            if slot is None:
                try:  # the gate may stay shut once the trainer has stopped
                    slot = await asyncio.wait_for(client.acquire(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    break
            if stamped != version.value:
                stamped = version.value
                stamp(group, stamped)
            group.group_id = f"{name}-{next(count)}"
            slot = await client.put(slot, group.SerializeToString(), acquire_next=True)
        if slot is not None:
            await client.release(slot, "stopping")

    async def run() -> int:
        client = BufferClient(address, JOB, name)
        while not await client.healthy():
            await asyncio.sleep(0.1)
        # Each rollout holds its first slot before the clock starts: a server busy with the
        # others' puts answers a new call late (the gRPC-only server's acquires ran past
        # their deadline), which is a start-up effect, not the steady rate measured here.
        slots = [await client.acquire() for _ in range(in_flight)]
        start.wait()
        deadline, count = time.monotonic() + seconds, itertools.count()
        await asyncio.gather(*(rollouts(client, slot, deadline, count) for slot in slots))
        await client.close()
        return next(count)

    results.put(("put", asyncio.run(run())))


def _trainer(address: str, batch_groups: int, seconds: float, version: SharedVersion,
             start: multiprocessing.Barrier, results: multiprocessing.Queue) -> None:
    """The trainer's loop without the training: a batch, its ack, the next version. The
    batch's parts are received whole with their groups left encoded: decoding them into
    samples is the trainer's own work, like the training, done on its own cores in a cluster
    (here it would take a third of a core from the buffer at 8k tokens)."""
    async def run() -> int:
        client = BufferClient(address, JOB, "trainer")
        channel = grpc_service.channel(address)
        batch_parts = channel.unary_stream(
            f"/{buffer_pb2.DESCRIPTOR.services_by_name['Buffer'].full_name}/GetBatch",
            request_serializer=buffer_pb2.GetBatchRequest.SerializeToString,
            response_deserializer=buffer_pb2.EncodedBatch.FromString)
        request = buffer_pb2.GetBatchRequest(job=JOB, consumer="trainer-0",
                                             num_groups=batch_groups, wait_ms=200)
        while not await client.healthy():
            await asyncio.sleep(0.1)
        start.wait()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            parts = [part async for part in batch_parts(request, timeout=30)]
            if not parts[0].batch_id:
                continue
            assert sum(len(part.groups) for part in parts) == batch_groups
            await client.ack(parts[0].batch_id)
            step = version.value + 1
            await client.set_version(step, f"file:///weights/{step}", step=step)
            version.value = step
        await client.close()
        await channel.close()
        return version.value

    results.put(("steps", asyncio.run(run())))


def _write_job(path: Path, workers: int, in_flight: int, batch_groups: int) -> Path:
    manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    manifest["metadata"]["name"] = JOB
    spec = manifest["spec"]
    # The staleness gate binds as in a real job: workers wait for slots once the trainer is
    # MAX_STALENESS batches behind, which keeps the buffer's depth bounded.
    spec["algorithm"].update(groupSize=GROUP_SIZE, batchSize=batch_groups,
                             maxStaleness=MAX_STALENESS)
    spec["rollout"]["maxConcurrentRollouts"] = workers * in_flight
    path.write_text(yaml.safe_dump(manifest))
    return path


def _buffer_command(job_file: Path, redis_url: str, port: int, profile: Path | None) -> list[str]:
    serve = ["serve", "buffer", "--job-file", str(job_file), "--redis-url", redis_url,
             "--grpc-port", str(port), "--metrics-port", "0"]
    if profile is None:
        return [str(Path(sys.executable).parent / "asyncrl"), *serve]
    return [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "asyncrl.cli", *serve]


@dataclass
class BufferRun:
    put_per_s: float       # samples
    trained_per_s: float   # samples acknowledged by the trainer
    stale: int             # groups dropped as stale
    lost: int              # put groups that went missing
    cores: dict[str, float]  # cores used by the buffer replicas, Redis and the workers

    def cpu_us_per_group(self) -> dict[str, float]:
        """Microseconds of CPU per group put of each process kind in `cores`."""
        return _us_per_group(self.cores, self.put_per_s)


def _us_per_group(cores: dict[str, float], put_samples_per_s: float) -> dict[str, float]:
    """Each of `cores` (cores used) as microseconds of CPU per group put."""
    return {name: used / (put_samples_per_s / GROUP_SIZE) * 1e6 for name, used in cores.items()}


@dataclass
class Cell:
    workers: int
    tokens: int
    bytes_per_sample: int
    batch_groups: int
    buffer: BufferRun      # with Python workers
    go: BufferRun | None   # with Go workers
    redis_set_per_s: float
    grpc_only_per_s: float
    grpc_only_cores: dict[str, float]

    @property
    def samples_per_s(self) -> float:
        return self.buffer.trained_per_s

    @property
    def tokens_per_s(self) -> float:
        return self.samples_per_s * self.tokens

    @property
    def ratio(self) -> float:
        return self.samples_per_s / self.redis_set_per_s

    @property
    def go_ratio(self) -> float:
        return self.go.trained_per_s / self.redis_set_per_s

    @property
    def grpc_only_ratio(self) -> float:
        return self.grpc_only_per_s / self.redis_set_per_s

    def cpu_us_per_group(self) -> dict[str, float]:
        """Microseconds of CPU per group put: the buffer's, Redis', the workers'; with the
        gRPC-only server its own and its workers'; and with Go workers the buffer's, Redis'
        and theirs."""
        grpc_only = _us_per_group(self.grpc_only_cores, self.grpc_only_per_s)
        go = self.go.cpu_us_per_group() if self.go else {}
        return {**self.buffer.cpu_us_per_group(),
                **{f"gRPC-only {name}": us for name, us in grpc_only.items()},
                **{f"Go {name}": us for name, us in go.items()}}


def _totals(client: redis.Redis) -> dict[str, int]:
    """The job's totals as Redis holds them (groups)."""
    names = ("accepted", "consumed", "dropped_stale")
    return dict(zip(names, (int(v or 0) for v in client.hmget(key(JOB, "state"), *names))))


def batch_groups(group: buffer_pb2.EncodedGroup) -> int:
    return min(BATCH_GROUPS, BATCH_BYTES // len(group.SerializeToString()))


def _cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes `pids` have used so far (Linux' /proc)."""
    ticks = 0
    for pid in pids:
        # The fields after the command's name, which may hold spaces: utime, stime are the
        # 12th and 13th.
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _drive(addresses: list[str], workers: int, in_flight: int, group: buffer_pb2.EncodedGroup,
           seconds: float, totals, servers: dict[str, list[int]], with_trainer: bool = True,
           go_worker: Path | None = None) -> tuple[dict[str, float], dict[str, float], list]:
    """Runs `workers` worker processes (spread over `addresses`; Python ones, or `go_worker`'s)
    and, `with_trainer`, the trainer process; once all are connected and warmed up, the rate
    per second of each of `totals()`'s counts over `seconds`, the cores each of `servers`
    (name: pids) and the workers ("worker") used meanwhile, and what the processes reported
    when they ended."""
    # fork: the children share the built group and import nothing again (128 interpreters
    # starting from scratch would take longer than the measurement on 2 cores).
    context = multiprocessing.get_context("fork")
    run_for = WARMUP_SECONDS + seconds + 0.5
    python_workers = 0 if go_worker else workers
    start = context.Barrier(python_workers + 1 + with_trainer)
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        version = SharedVersion(Path(tmp) / "version")
        children = [context.Process(target=_trainer, args=(
            addresses[0], batch_groups(group), run_for, version, start, results))
            for _ in range(with_trainer)]
        children += [context.Process(target=_worker, args=(
            addresses[i % len(addresses)], f"w{i}", group, in_flight, run_for, version, start,
            results))
            for i in range(python_workers)]
        go_workers: list[subprocess.Popen] = []
        try:
            for child in children:
                child.start()
            if go_worker:
                go_workers = _start_go_workers(go_worker, addresses, workers, in_flight, group,
                                               run_for, version, Path(tmp))
            start.wait(timeout=120)
            for process in go_workers:
                process.stdin.write("go\n")
                process.stdin.flush()
            time.sleep(WARMUP_SECONDS)
            worker_pids = ([process.pid for process in go_workers]
                           + [child.pid for child in children[with_trainer:]])
            watched = {**servers, "worker": worker_pids}
            cpu_before = {name: _cpu_seconds(pids) for name, pids in watched.items()}
            began, before = time.monotonic(), totals()
            time.sleep(seconds)
            ended, after = time.monotonic(), totals()
            cpu_after = {name: _cpu_seconds(pids) for name, pids in watched.items()}
            reported = [results.get(timeout=60) for _ in children]
            reported += [_go_worker_result(process) for process in go_workers]
            for child in children:
                child.join(timeout=30)
        finally:
            for child in children:
                if child.is_alive():
                    child.kill()
            for process in go_workers:
                if process.poll() is None:
                    process.kill()
                process.wait()
    rates = {name: (after[name] - before[name]) / (ended - began) for name in after}
    cores = {name: (cpu_after[name] - cpu_before[name]) / (ended - began) for name in watched}
    return rates, cores, reported


def _start_go_workers(binary: Path, addresses: list[str], workers: int, in_flight: int,
                      group: buffer_pb2.EncodedGroup, seconds: float, version: SharedVersion,
                      tmp: Path) -> list[subprocess.Popen]:
    """`workers` Go worker processes, each holding its first slots and waiting for a line on
    stdin to start."""
    group_file = tmp / "group.bin"
    group_file.write_bytes(group.SerializeToString())
    processes = []
    try:
        for i in range(workers):
            processes.append(subprocess.Popen(
                [str(binary), "-address", addresses[i % len(addresses)], "-job", JOB,
                 "-name", f"w{i}", "-group", str(group_file), "-version", str(version.path),
                 "-seconds", str(seconds), "-in-flight", str(in_flight)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for process in processes:
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a Go worker did not start (exit code {process.wait()})")
    except BaseException:
        for process in processes:
            process.kill()
        raise
    return processes


def _go_worker_result(process: subprocess.Popen) -> tuple[str, int]:
    """("put", groups put) as a Go worker printed it when done (within a minute)."""
    out, _ = process.communicate(timeout=60)
    if process.returncode != 0 or not out.startswith("put "):
        raise RuntimeError(f"a Go worker failed (exit code {process.returncode}): {out!r}")
    return "put", int(out.split()[1])


GO_WORKER_DIR = ROOT / "bench" / "go_worker"


def build_go_worker() -> Path | None:
    """bench/go_worker's binary, built now (None, and why, if Go is not installed)."""
    if shutil.which("go") is None:
        print("go is not installed: no column for the Go workers", file=sys.stderr)
        return None
    subprocess.run(["bash", str(GO_WORKER_DIR / "build.sh")], check=True)
    return GO_WORKER_DIR / "go-worker"


def run_buffer(workers: int, in_flight: int, tokens: int, seconds: float, replicas: int,
               profile: Path | None, go_worker: Path | None = None) -> BufferRun:
    """The buffer with `workers` Python worker processes, or `go_worker`'s."""
    group = make_group(tokens, seed=tokens)
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        job_file = _write_job(Path(tmp) / "job.yaml", workers, in_flight, batch_groups(group))
        ports = [free_port() for _ in range(replicas)]
        buffers = [subprocess.Popen(_buffer_command(
            job_file, server.url, port,
            profile / f"buffer-{workers}w-{tokens}t-{'go-' if go_worker else ''}{i}.prof"
            if profile else None))
            for i, port in enumerate(ports)]
        client = redis.Redis(port=server.port)
        try:
            servers = {"buffer": [buffer.pid for buffer in buffers],
                       "redis": [client.info("server")["process_id"]]}
            rates, cores, reported = _drive([f"127.0.0.1:{port}" for port in ports], workers,
                                            in_flight, group, seconds, lambda: _totals(client),
                                            servers, go_worker=go_worker)
            final = _totals(client)
            put = sum(count for kind, count in reported if kind == "put")
            waiting = client.xlen(key(JOB, "groups"))
            # Every group a worker was told was put is accepted once, and then trained,
            # dropped as stale or still waiting in the stream.
            lost = abs(put - final["accepted"]) + (
                final["accepted"] - final["consumed"] - final["dropped_stale"] - waiting)
        finally:
            client.close()
            for buffer in buffers:
                buffer.send_signal(signal.SIGINT)  # a clean exit writes the profile
            for buffer in buffers:
                buffer.wait(timeout=30)
    return BufferRun(rates["accepted"] * GROUP_SIZE, rates["consumed"] * GROUP_SIZE,
                     final["dropped_stale"], lost, cores)


class _GrpcOnly(BufferServicer):
    """The buffer's gRPC face without its work: the same handlers (puts read as
    EncodedPutGroupRequest), every slot granted and every put accepted and counted, nothing
    checked or stored and no Redis. Its rate is the most a buffer written as a Python gRPC
    service could reach here, with these clients on the same cores."""

    def __init__(self, puts: multiprocessing.Value):
        self._puts, self._ids = puts, itertools.count()

    async def AcquireSlot(self, request, context):
        return buffer_pb2.AcquireSlotResponse(granted=True, slot_id=f"slot-{next(self._ids)}",
                                              lease_expires_unix_ms=_an_hour_from_now())

    async def Heartbeat(self, request, context):
        return buffer_pb2.HeartbeatResponse(alive=True, lease_expires_unix_ms=_an_hour_from_now())

    async def ReleaseSlot(self, request, context):
        return buffer_pb2.ReleaseSlotResponse(released=True)

    async def PutGroup(self, request, context):
        self._puts.value += 1
        return buffer_pb2.PutGroupResponse(
            accepted=True, accepted_total=self._puts.value,
            next_slot=await self.AcquireSlot(request, context) if request.acquire_next else None)

    async def PutGroups(self, requests, context):  # a worker's stream of puts
        async for request in requests:
            yield buffer_pb2.PutGroupsResponse(results=[
                buffer_pb2.PutGroupResult(response=await self.PutGroup(put, context))
                for put in request.puts])


def _an_hour_from_now() -> int:
    return int(time.time() * 1000) + 3_600_000


def _serve_grpc_only(port: int, puts: multiprocessing.Value, stop) -> None:
    async def run() -> None:
        reuse_large_blocks()  # as `asyncrl serve buffer` does

        async def can_work() -> bool:
            return True

        server = await grpc_service.start_server(
            "gRPC-only buffer", f"127.0.0.1:{port}",
            lambda server: add_servicer(_GrpcOnly(puts), server), can_work)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop(grace=None)

    asyncio.run(run())


def run_grpc_only(workers: int, in_flight: int, tokens: int,
                  seconds: float) -> tuple[float, dict[str, float]]:
    """Samples/s the workers put into a `_GrpcOnly` server (one process, no trainer), and the
    cores the server and the workers used."""
    context = multiprocessing.get_context("fork")
    puts, stop, port = context.Value("q", 0, lock=False), context.Event(), free_port()
    server = context.Process(target=_serve_grpc_only, args=(port, puts, stop))
    server.start()
    try:
        rates, cores, _ = _drive([f"127.0.0.1:{port}"], workers, in_flight,
                          make_group(tokens, seed=tokens), seconds,
                          lambda: {"put": puts.value}, {"server": [server.pid]},
                          with_trainer=False)
    finally:
        stop.set()
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
    return rates["put"] * GROUP_SIZE, cores


def redis_set_rate(workers: int, value_bytes: int, seconds: float) -> float:
    """redis-benchmark SET/s with `workers` clients and `value_bytes` values, for about
    `seconds`, against a fresh redis-server configured as the buffer's."""
    def run(requests: int) -> float:
        out = subprocess.run(
            ["redis-benchmark", "-p", str(server.port), "-t", "set", "-c", str(workers),
             "-d", str(value_bytes), "-n", str(requests), "--csv"],
            capture_output=True, text=True, check=True,
        ).stdout
        rows = [row for row in csv.reader(io.StringIO(out)) if row and row[0] == "SET"]
        return float(rows[0][1])

    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        pilot = run(max(20 * workers, 1000))
        return run(max(int(pilot * seconds), 1000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # A trained batch is hundreds of groups: the window must hold several for a steady rate.
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per cell")
    parser.add_argument("--workers", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192],
                        help="tokens per sample (prompt + response)")
    parser.add_argument("--in-flight", type=int, default=1, help="groups under way per worker")
    parser.add_argument("--replicas", type=int, default=1, help="buffer processes")
    parser.add_argument("--profile", type=Path, help="write each buffer's cProfile here")
    parser.add_argument("--no-go", action="store_true",
                        help="only Python workers (no run with bench/go_worker's)")
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    go_worker = None if args.no_go else build_go_worker()

    cells = []
    for workers in args.workers:
        for tokens in args.tokens:
            group = make_group(tokens, seed=tokens)
            size = sample_bytes(group)
            before = redis_set_rate(workers, size, args.seconds / 2)
            buffer = run_buffer(workers, args.in_flight, tokens, args.seconds, args.replicas,
                                args.profile)
            go = go_worker and run_buffer(workers, args.in_flight, tokens, args.seconds,
                                          args.replicas, args.profile, go_worker)
            grpc_only, grpc_only_cores = run_grpc_only(workers, args.in_flight, tokens,
                                                       args.seconds)
            after = redis_set_rate(workers, size, args.seconds / 2)
            cells.append(Cell(workers, tokens, size, batch_groups(group), buffer, go,
                              (before + after) / 2, grpc_only, grpc_only_cores))

    print(f"buffer ({args.replicas} replica(s)) vs redis-benchmark SET, Redis AOF appendfsync "
          f"always; groups of {GROUP_SIZE} samples, {args.in_flight} under way per worker, "
          f"{args.seconds:g} s per cell")
    print("samples/s: put by the workers / trained (acknowledged); tokens/s and the ratio to "
          "redis-benchmark's SET/s from the trained ones; gRPC only: samples/s the same workers "
          "put into a server with the buffer's gRPC handlers that does no work (no trainer, no "
          "Redis), and its ratio: the ceiling of a Python gRPC buffer with these clients on "
          "these cores; Go workers: trained samples/s and ratio with the same number of "
          "bench/go_worker processes (the same calls, a fraction of the client CPU) in place "
          "of the Python ones; stale and lost: groups dropped as stale and gone missing, "
          "Python / Go workers")
    print(f"{'workers':>7} {'tokens':>6} {'B/sample':>8} {'batch':>5} {'put/s':>7} "
          f"{'samples/s':>10} {'tokens/s':>11} {'redis SET/s':>11} {'ratio':>6} "
          f"{'gRPC only':>9} {'ratio':>6} {'Go workers':>10} {'ratio':>6} {'stale':>9} "
          f"{'lost':>5}")
    for c in cells:
        go = (f"{c.go.trained_per_s:>10,.0f} {c.go_ratio:>6.0%}" if c.go
              else f"{'-':>10} {'-':>6}")
        print(f"{c.workers:>7} {c.tokens:>6} {c.bytes_per_sample:>8,} {c.batch_groups:>5} "
              f"{c.buffer.put_per_s:>7,.0f} {c.samples_per_s:>10,.0f} "
              f"{c.tokens_per_s:>11,.0f} {c.redis_set_per_s:>11,.0f} {c.ratio:>6.0%} "
              f"{c.grpc_only_per_s:>9,.0f} {c.grpc_only_ratio:>6.0%} {go} "
              f"{c.buffer.stale:>4}/{c.go.stale if c.go else '-':<4} "
              f"{c.buffer.lost:>2}/{c.go.lost if c.go else '-':<2}")
    print("CPU per group put (us; user + system, from each process' own counters): the buffer "
          "(all replicas), Redis, the worker processes; with the gRPC-only server, the server "
          "and its workers; with the Go workers, the buffer, Redis and the workers")
    names = list(cells[0].cpu_us_per_group())
    print(f"{'workers':>7} {'tokens':>6} " + " ".join(f"{name:>{max(len(name), 6)}}"
                                                       for name in names))
    for c in cells:
        cpu = c.cpu_us_per_group()
        print(f"{c.workers:>7} {c.tokens:>6} " + " ".join(
            f"{cpu[name]:>{max(len(name), 6)},.0f}" for name in names))
    best = max(cells, key=lambda c: c.tokens_per_s)
    per_replica = best.tokens_per_s / args.replicas
    print(f"one buffer replica sustains {per_replica:,.0f} tokens/s "
          f"({best.tokens}-token samples, {best.workers} workers)")
    need = MARGIN * AREAL_HIGHEST_TOKENS_PER_S
    print("AReaL on 512 GPUs trains on about "
          + ", ".join(f"{v / 1000:.0f}k tokens/s ({k})" for k, v in
                      AREAL_512_GPU_TOKENS_PER_S.items())
          + f", 1.5B scaled to 512 GPUs {AREAL_HIGHEST_TOKENS_PER_S / 1000:.0f}k; with {MARGIN}x "
          f"for untrained tokens a job needs {need / 1000:.0f}k tokens/s through the buffer: "
          + (f"one replica sustains {per_replica / need:.1f}x that" if per_replica >= need
             else f"{math.ceil(need / per_replica)} replicas"))


if __name__ == "__main__":
    main()
