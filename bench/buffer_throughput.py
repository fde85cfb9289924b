"""Buffer throughput: samples/s through AcquireSlot + PutGroup + GetBatch + AckBatch, against
redis-benchmark's SET/GET rate on the same Redis, measured in one run.

Both the buffer (a separate `asyncrl serve buffer` process, as deployed) and redis-benchmark
talk to one private redis-server with AOF (appendfsync always, the durable setting the buffer
uses). Records are whole groups of 8 samples with 1k or 8k tokens each.

    .venv/bin/python bench/buffer_throughput.py [--groups 200]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from asyncrl.buffer.client import BufferClient
from asyncrl.redis_server import RedisServer, free_port
from asyncrl.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[1]
GROUP_SIZE = 8
BATCH_GROUPS = 8


def group(index: int, tokens: int) -> common_pb2.Group:
    prompt = tokens // 4
    response = tokens - prompt
    sample = common_pb2.Trajectory(
        prompt_ids=list(range(prompt)), response_ids=list(range(response)),
        behaviour_logprobs=[-1.25] * response, token_versions=[0] * response, reward=1.0,
        finish_reason="stop",
    )
    return common_pb2.Group(group_id=f"g{index}", prompt_id=f"p{index}", samples=[sample] * GROUP_SIZE)


async def run_buffer(address: str, groups: int, tokens: int, producers: int = 4) -> float:
    records = [group(i, tokens) for i in range(groups)]
    client = BufferClient(address, "bench", "bench")
    while not await client.healthy():
        await asyncio.sleep(0.1)
    queue = iter(records)

    async def produce():
        for record in queue:
            slot = await client.acquire()
            await client.put(slot, record)

    async def consume():
        done = 0
        while done < groups:
            batch = await client.get_batch("trainer", min(BATCH_GROUPS, groups - done), wait_ms=5000)
            await client.ack(batch.batch_id)
            done += len(batch.groups)

    started = time.perf_counter()
    await asyncio.gather(consume(), *(produce() for _ in range(producers)))
    elapsed = time.perf_counter() - started
    await client.close()
    return groups * GROUP_SIZE / elapsed


def redis_benchmark(port: int, requests: int = 100_000) -> float:
    out = subprocess.run(
        ["redis-benchmark", "-p", str(port), "-t", "set,get", "-n", str(requests), "-q"],
        capture_output=True, text=True, check=True,
    ).stdout
    rates = [float(r) for r in re.findall(r"([\d.]+) requests per second", out)]
    return sum(rates) / len(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200, help="groups per record size")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as redis_server:
        manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
        manifest["metadata"]["name"] = "bench"
        spec = manifest["spec"]
        spec["algorithm"].update(groupSize=GROUP_SIZE, batchSize=BATCH_GROUPS, maxStaleness=10_000)
        spec["rollout"]["maxConcurrentRollouts"] = 64
        spec["rollout"]["maxNewTokens"] = 16
        job_file = Path(tmp) / "job.yaml"
        job_file.write_text(yaml.safe_dump(manifest))
        port = free_port()
        buffer = subprocess.Popen(
            [str(Path(sys.executable).parent / "asyncrl"), "serve", "buffer", "--job-file",
             str(job_file), "--redis-url", redis_server.url, "--grpc-port", str(port),
             "--metrics-port", "0"],
        )
        try:
            results = {tokens: asyncio.run(run_buffer(f"127.0.0.1:{port}", args.groups, tokens))
                       for tokens in (1024, 8192)}
        finally:
            buffer.terminate()
            buffer.wait()
        baseline = redis_benchmark(redis_server.port)
    print(f"redis-benchmark SET/GET (same Redis, AOF always): {baseline:,.0f} ops/s")
    for tokens, rate in results.items():
        print(f"buffer put+get+ack, {tokens}-token samples: {rate:,.0f} samples/s "
              f"= {rate / baseline:.0%} of redis-benchmark ops/s")


if __name__ == "__main__":
    main()
