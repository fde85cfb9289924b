"""Reward sandbox throughput: sandboxed runs per second for a trivial program and for a typical
unit-test set, against running the same programs with plain `python`, measured in one run.

"Plain" starts the same interpreter the sandbox uses (`python -I`) as an ordinary child
process, with the same stdin and tests, no isolation. "Sandbox" is `Sandbox.run` /
`CodeScorer.score`: new network, mount and PID namespaces, rlimits, a dedicated uid, a fresh
scratch tmpfs. Both run sequentially (latency) and with one run in flight per CPU
(throughput), alternating in chunks so that both see the same machine load.

    .venv/bin/python bench/reward_sandbox.py [--runs 100] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from asyncrl.scoring.code_reward import CodeScorer
from asyncrl.scoring.sandbox import Sandbox, SandboxLimits
from asyncrl.scoring.types import CodeReference, IoCase

TRIVIAL = "print(int(input()) * 2)\n"

# A typical small task: a function, five stdin/stdout cases and eight assert-style tests.
SOLUTION = '''import sys

def longest_run(xs):
    best = cur = 0
    prev = None
    for x in xs:
        cur = cur + 1 if x == prev else 1
        best = max(best, cur)
        prev = x
    return best

if __name__ == "__main__":
    data = sys.stdin.read().split()
    print(longest_run(data[1:]))
'''
TESTS = "\n".join(
    f"def test_{i}():\n    assert longest_run({xs!r}) == {want}\n"
    for i, (xs, want) in enumerate([
        ([], 0), ([1], 1), ([1, 1], 2), ([1, 2, 2, 3], 2), ([5] * 50, 50),
        (list(range(100)), 1), ([1, 1, 2, 2, 2, 1], 3), (["a", "a", "b"], 2),
    ])
)
IO_CASES = tuple(IoCase(f"{len(xs)} {' '.join(xs)}\n", f"{want}\n") for xs, want in [
    ("1 1 2".split(), 2), ("3".split(), 1), ("4 4 4 4".split(), 4), ("1 2 3 3".split(), 2),
    ("9 9 8 8 8".split(), 3)])
UNIT_TESTS = CodeReference(io_cases=IO_CASES, test_code=TESTS)


async def plain_run(python: str, workdir: Path, argv: list[str], stdin: bytes) -> bytes:
    process = await asyncio.create_subprocess_exec(
        python, *argv, cwd=workdir, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, _ = await process.communicate(stdin)
    assert process.returncode == 0, process.returncode
    return out


async def plain_unit_tests(python: str, workdir: Path) -> None:
    """What the sandbox does for UNIT_TESTS, without it: one process per case, then the tests."""
    for case in IO_CASES:
        out = await plain_run(python, workdir, ["-I", "main.py"], case.stdin.encode())
        assert out.decode() == case.expected_stdout
    calls = "\n".join(f"test_{i}()" for i in range(8))
    await plain_run(python, workdir, ["-I", "-c", f"{SOLUTION}\n{TESTS}\n{calls}\n"], b"")


async def rates(plain, sandboxed, runs: int, concurrency: int, rounds: int = 5):
    """Runs per second and median seconds per run, each as (plain, sandboxed), with
    `concurrency` runs in flight. The two alternate in `rounds` chunks so both see the same
    load on a shared machine; the medians are robust to other work's bursts."""
    elapsed = {plain: 0.0, sandboxed: 0.0}
    each = {plain: [], sandboxed: []}
    per_round = max(runs // rounds, concurrency)
    for _ in range(rounds):
        for make_run in (plain, sandboxed):
            queue = iter(range(per_round))

            async def lane():
                for _ in queue:
                    began = time.perf_counter()
                    await make_run()
                    each[make_run].append(time.perf_counter() - began)

            start = time.perf_counter()
            await asyncio.gather(*(lane() for _ in range(concurrency)))
            elapsed[make_run] += time.perf_counter() - start
    total = per_round * rounds
    return ((total / elapsed[plain], total / elapsed[sandboxed]),
            (statistics.median(each[plain]), statistics.median(each[sandboxed])))


async def bench(runs: int) -> dict:
    cpus = os.cpu_count() or 1
    sandbox = await Sandbox(SandboxLimits(timeout_seconds=10), workers=cpus).start()
    assert sandbox.unavailable is None, sandbox.unavailable
    scorer = CodeScorer(sandbox)
    python = sandbox.python
    trivial_dir = Path(tempfile.mkdtemp(prefix="asyncrl-bench-"))
    (trivial_dir / "main.py").write_text(TRIVIAL)
    unit_dir = Path(tempfile.mkdtemp(prefix="asyncrl-bench-"))
    (unit_dir / "main.py").write_text(SOLUTION)
    files = {"main.py": TRIVIAL.encode()}
    response = f"```python\n{SOLUTION}```"

    async def sandboxed_trivial():
        result = await sandbox.run(files, [python, "-I", "main.py"], b"21\n")
        assert result.stdout == b"42\n", result

    async def plain_trivial():
        assert await plain_run(python, trivial_dir, ["-I", "main.py"], b"21\n") == b"42\n"

    async def sandboxed_tests():
        result = await scorer.score("bench", response, UNIT_TESTS)
        assert result.score == 1.0 and result.total == 13, result

    async def plain_tests():
        await plain_unit_tests(python, unit_dir)

    figures = {"cpus": cpus, "isolation": sandbox.isolation.value, "python": python}
    await sandboxed_trivial()  # warm the page cache for both
    await plain_trivial()
    workloads = [("trivial", plain_trivial, sandboxed_trivial, runs),
                 ("unit_tests", plain_tests, sandboxed_tests, max(runs // 6, 10))]
    for name, plain_fn, sandboxed_fn, count in workloads:
        for lanes, label in ((1, "sequential"), (cpus, "parallel")):
            (plain, boxed), (plain_s, boxed_s) = await rates(plain_fn, sandboxed_fn, count, lanes)
            figures[f"{name}_{label}"] = {
                "plain_per_s": plain, "sandbox_per_s": boxed, "overhead_x": plain / boxed,
                "plain_median_ms": 1000 * plain_s, "sandbox_median_ms": 1000 * boxed_s,
            }
    await sandbox.close()
    shutil.rmtree(trivial_dir)
    shutil.rmtree(unit_dir)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="Runs of the trivial program.")
    parser.add_argument("--json", action="store_true", help="Print the figures as JSON.")
    args = parser.parse_args()
    figures = asyncio.run(bench(args.runs))
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"sandbox: {figures['isolation']} isolation, {figures['cpus']} CPUs, "
          f"programs run by {figures['python']}")
    print("unit_tests: one task scored = 5 stdin/stdout cases + 8 asserts = 6 sandboxed runs")
    units = {"trivial": "runs/s", "unit_tests": "tasks/s"}
    for key, value in figures.items():
        if not isinstance(value, dict):
            continue
        name, label = key.rsplit("_", 1)
        print(f"{name:10} {label:10} plain {value['plain_per_s']:6.1f} {units[name]:7} "
              f"sandbox {value['sandbox_per_s']:6.1f} {units[name]:7} "
              f"(plain/sandbox {value['overhead_x']:.2f}x); median latency: plain "
              f"{value['plain_median_ms']:4.0f} ms, sandbox {value['sandbox_median_ms']:4.0f} ms")


if __name__ == "__main__":
    main()
