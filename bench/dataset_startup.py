"""A file dataset's cost to a rollout worker: start-up time and resident memory with a
generated one-million-row JSONL file, against a 1,000-row file, measured in one run.

Each measurement is a fresh process doing what `asyncrl serve rollout` does with the dataset
before its engine starts: read the job, load the tokenizer, open the dataset (every row
checked), size the engine's sequences, then build the first 64 prompts as the workflow would.
Rows are arithmetic problems (arith's generator) in the gsm8k-like mapping prompt/answer.
"Cold" is the first open of a file, which converts it to Arrow once (cached by `datasets`);
"warm" is every later process, which maps the cached Arrow file.

    .venv/bin/python bench/dataset_startup.py [--rows 1000000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.data import arith

# Runs in the measured process: start-up as the rollout worker does it, then its peak RSS.
_WORKER = """
import json, resource, sys, time
started = time.perf_counter()
from asyncrl.spec import load_manifest
from asyncrl.model.policy import load_tokenizer
from asyncrl.data.prompts import build_prompts, max_sequence_length
spec = load_manifest(sys.argv[1]).spec
tokenizer = load_tokenizer(spec.model.source)
loaded = time.perf_counter()
train, _ = build_prompts(spec, tokenizer)
length = max_sequence_length(spec, train)
items = [train[i] for i in range(64)]
ready = time.perf_counter()
print(json.dumps({"rows": len(train), "seconds": ready - started,
                  "dataset_seconds": ready - loaded,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

MANIFEST = """apiVersion: asyncrl.io/v1alpha1
kind: RLJob
metadata: {{name: dataset-startup}}
spec:
  model: {{source: tiny-random}}
  dataset:
    kind: file
    path: {path}
    fields: {{prompt: prompt, answer: answer, id: id}}
    maxPromptTokens: 256
"""


def write_rows(path: Path, count: int) -> None:
    # One batch of generated problems, repeated with fresh ids: generating a million
    # problems would time the generator, not the reader.
    problems = arith.generate(min(count, 10_000), seed=0, difficulty=3)
    with path.open("w") as out:
        for index in range(count):
            problem = problems[index % len(problems)]
            out.write(json.dumps({"id": f"p{index}", "prompt": problem.prompt,
                                  "answer": problem.answer}) + "\n")


def measure(manifest: Path, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", _WORKER, str(manifest)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        # A cache of its own, so that "cold" really is the first conversion.
        env = {**os.environ, "HF_DATASETS_CACHE": str(scratch / "cache"),
               "TOKENIZERS_PARALLELISM": "false"}
        results = {}
        for label, count in (("small", args.small), ("large", args.rows)):
            data = scratch / f"{label}.jsonl"
            began = time.perf_counter()
            write_rows(data, count)
            written = time.perf_counter() - began
            manifest = scratch / f"{label}.yaml"
            manifest.write_text(MANIFEST.format(path=data))
            cold = measure(manifest, env)
            warm = measure(manifest, env)
            results[label] = {"rows": count, "file_mb": data.stat().st_size / 2**20,
                              "write_seconds": written, "cold": cold, "warm": warm}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    small, large = results["small"], results["large"]
    print(f"{'':>24} {'start-up cold':>14} {'start-up warm':>14} {'peak RSS warm':>14}")
    for label in ("small", "large"):
        r = results[label]
        print(f"{r['rows']:>10,} rows {r['file_mb']:6.0f} MB "
              f"{r['cold']['seconds']:13.1f}s {r['warm']['seconds']:13.1f}s "
              f"{r['warm']['peak_rss_mb']:11.0f} MB")
    print(f"large / small: start-up warm {large['warm']['seconds'] / small['warm']['seconds']:.2f}x,"
          f" peak RSS warm {large['warm']['peak_rss_mb'] / small['warm']['peak_rss_mb']:.2f}x, "
          f"cold {large['cold']['seconds'] / small['cold']['seconds']:.2f}x")


if __name__ == "__main__":
    main()
