"""Asynchronous vs synchronous RL on this machine: effective trained tokens/s of the same job.

Runs `asyncrl run` twice on the same job and step budget: `--sync` (η = 0, generation waits
for training: the classic alternation, each side gets every core while the other waits) and
asynchronous (η from the job, cores split between trainer and rollout worker, which on the CPU
lend each other their threads while one waits; --no-lend-cores: each keeps its own). Reports the
ratio and explains it with measured components: the ideal-overlap bound from the sync run's
busy times, decode batch occupancy, idle fractions, and time lost to interruptions.

    .venv/bin/python bench/async_vs_sync.py [--job examples/arith.yaml] [--steps 6]
        [--trainer-threads N --rollout-threads M]   (the async run's split; default half each)
        [--no-lend-cores]

bench/long_tail.yaml is the arith job with a long response-length tail (up to 256 tokens at
temperature 1.0), where the synchronous alternation decodes its last, longest responses
almost alone.

On a GPU (`--device cuda`; trainer and rollout share the first GPU) the job is
bench/long_tail_gpu.yaml on a random ~0.4B model whose lengths are geometric with mean 150
tokens up to 512 (bench/long_tail_model.py writes it first), unless `--job` names another:

    .venv/bin/python bench/async_vs_sync.py --device cuda [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from long_tail_model import write_long_tail_model

ROOT = Path(__file__).resolve().parents[1]


def run(job: Path, run_dir: Path, steps: int, sync: bool, threads: list[str] = (),
        devices: str = "cpu") -> None:
    args = [str(Path(sys.executable).parent / "asyncrl"), "run", str(job), "--run-dir",
            str(run_dir), "--steps", str(steps), "--devices", devices]
    args += ["--sync"] if sync else list(threads)
    # No evaluations: they would take trainer time in both modes alike and blur the comparison.
    env = {**os.environ, "ASYNCRL_EVAL_PROMPTS": "0"}
    result = subprocess.run(args, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


def summarise(run_dir: Path) -> dict:
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    rollout = [json.loads(l) for l in (run_dir / "rollout_status.jsonl").read_text().splitlines()]
    first, last = rollout[0], rollout[-1]

    def delta(key: str) -> float:
        return float(last[key]) - float(first[key])

    wall = train[-1]["elapsed"]
    span = last["time"] - first["time"]
    return {
        "wall": wall,
        "trained_tokens": sum(r["trained_tokens"] for r in train),
        "train_busy": sum(r["step_seconds"] for r in train),
        "trainer_idle": sum(r["wait_seconds"] for r in train) / wall,
        "occupancy": delta("decode_rows_total") / max(delta("decode_steps_total"), 1),
        "rollout_busy": delta("busy_seconds_total"),
        "rollout_idle": 1 - delta("busy_seconds_total") / max(span, 1e-9),
        "interrupted": delta("interrupted_requests_total"),
        "interruption_seconds": delta("weight_swap_seconds_total")
        + delta("resume_prefill_seconds_total"),
        "staleness": sum(r["staleness_mean"] for r in train) / len(train),
        "weights": sorted({r["weight_transfer"] for r in records if r.get("weight_transfer")}),
    }


def long_tail_job(folder: Path, size: str) -> Path:
    """bench/long_tail_gpu.yaml on a long-tail model written into `folder`."""
    job = yaml.safe_load((ROOT / "bench/long_tail_gpu.yaml").read_text())
    job["spec"]["model"]["source"] = str(write_long_tail_model(folder / "model", size=size))
    path = folder / "long_tail_gpu.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path,
                        help="default: examples/arith.yaml, on a GPU bench/long_tail_gpu.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--trainer-threads", type=int)
    parser.add_argument("--rollout-threads", type=int)
    parser.add_argument("--no-lend-cores", action="store_true",
                        help="the async run's trainer and rollout keep their own threads")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: trainer and rollout share GPU 0 (asyncrl run --devices 0)")
    parser.add_argument("--model-size", default="0.4b",
                        help="with --device cuda and the default job: the long-tail model's "
                        "size (bench/long_tail_model.py SIZES)")
    args = parser.parse_args()
    devices = "0" if args.device == "cuda" else "cpu"
    cores = os.cpu_count()
    trainer_threads = args.trainer_threads or cores - cores // 2
    rollout_threads = args.rollout_threads or max(1, cores // 2)
    threads = ["--trainer-threads", str(trainer_threads), "--rollout-threads", str(rollout_threads)]
    if args.no_lend_cores:
        threads.append("--no-lend-cores")
    with tempfile.TemporaryDirectory() as tmp:
        if args.job is None and args.device == "cuda":
            args.job = long_tail_job(Path(tmp), args.model_size)
        args.job = args.job or ROOT / "examples/arith.yaml"
        run(args.job, Path(tmp) / "sync", args.steps, sync=True, devices=devices)
        run(args.job, Path(tmp) / "async", args.steps, sync=False, threads=threads,
            devices=devices)
        sync, asyn = summarise(Path(tmp) / "sync"), summarise(Path(tmp) / "async")
    sync_rate = sync["trained_tokens"] / sync["wall"]
    async_rate = asyn["trained_tokens"] / asyn["wall"]
    bound = (sync["rollout_busy"] + sync["train_busy"]) / max(sync["rollout_busy"], sync["train_busy"])
    print(f"job {args.job.name}, {args.steps} steps per mode, {cores} cores, devices {devices}")
    print(f"threads: sync = trainer {cores} + rollout {cores} (they alternate); "
          f"async = trainer {trainer_threads} + rollout {rollout_threads}"
          + ("" if args.no_lend_cores or devices != "cpu" else ", lent to each other while one waits"))
    for name, s in (("sync", sync), ("async", asyn)):
        print(f"{name:>5}: {s['trained_tokens'] / s['wall']:6.1f} trained tokens/s "
              f"({s['trained_tokens']:.0f} tokens in {s['wall']:.0f} s); decode batch "
              f"{s['occupancy']:.1f}; idle: trainer {s['trainer_idle']:.0%}, rollout "
              f"{s['rollout_idle']:.0%}; interrupted requests {s['interrupted']:.0f} "
              f"({s['interruption_seconds']:.1f} s); staleness {s['staleness']:.2f}; weights "
              f"by {', '.join(s['weights']) or '-'}")
    print(f"async / sync = {async_rate / sync_rate:.2f}x; ideal-overlap bound from the sync "
          f"run's busy times (rollout {sync['rollout_busy']:.0f} s, train {sync['train_busy']:.0f} s)"
          f" = {bound:.2f}x")


if __name__ == "__main__":
    main()
