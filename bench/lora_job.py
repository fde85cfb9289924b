"""A LoRA job through `asyncrl run` on a published model's shape with random weights: by
default Qwen2.5-7B on one GPU, the trainer and the torch engine sharing it (weights by ipc).

It writes the shape's random weights once as a model directory (bf16 on a GPU, float32 on the
CPU; SmolLM2's tokenizer beside them, whose ids the larger vocabulary covers), runs
examples/arith-lora.yaml on it for --steps steps, and prints what each version cost: the
bytes it moved (`version_bytes`), the trainer's publish time, the engine's time to apply it
(its log's "version N applied in X ms") and the trainer's step time.
Random weights learn nothing; this measures whether the job fits and what a version costs.

    python3 bench/lora_job.py                                   # qwen2.5-7b on cuda
    .venv/bin/python bench/lora_job.py --shape smollm2-135m --device cpu --steps 2
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from asyncrl.model.policy import load_tokenizer
from asyncrl.model.shapes import SHAPES, random_model

ROOT = Path(__file__).resolve().parents[1]
APPLIED = re.compile(r"version (\d+) applied in ([\d.]+) ms \((\w+)\)")


def write_model(shape: str, dtype: torch.dtype, directory: Path) -> Path:
    """The shape's random weights as a Hugging Face model directory, written once."""
    if (directory / "config.json").is_file():
        return directory
    model = random_model(shape, "cpu", dtype)
    model.save_pretrained(directory)
    load_tokenizer().save_pretrained(directory)
    return directory


def job_file(model_dir: Path, args, out: Path) -> Path:
    manifest = yaml.safe_load((ROOT / "examples/arith-lora.yaml").read_text())
    manifest["metadata"]["name"] = f"lora-{args.shape.replace('.', '-')}"
    spec = manifest["spec"]
    spec["model"] = {"source": str(model_dir),
                     "dtype": "bfloat16" if args.device == "cuda" else "float32",
                     "lora": {"rank": args.rank, "alpha": 2 * args.rank}}
    spec["algorithm"]["skipUniformGroups"] = False  # random weights: every reward is 0
    spec["trainer"]["evalPrompts"] = 0
    path = out / "job.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("/tmp/lora-job"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model_dir = write_model(args.shape, dtype, args.out / f"{args.shape}-{str(dtype)[6:]}")
    run_dir = args.out / "run"
    devices = ["--devices", "auto"] if args.device == "cuda" else ["--devices", "cpu"]
    done = subprocess.run([str(Path(sys.executable).parent / "asyncrl"), "run",
                           str(job_file(model_dir, args, args.out)), "--run-dir", str(run_dir),
                           "--steps", str(args.steps), *devices], timeout=3600)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if '"kind": "train"' in line]
    applied = APPLIED.findall((run_dir / "logs/rollout.log").read_text())
    print(f"RESULT {args.shape} LoRA rank {args.rank} on {args.device}: exit {done.returncode}, "
          f"{len(records)} steps")
    if records:
        print(f"RESULT version: {records[-1]['version_bytes'] / 2**20:.1f} MiB by "
              f"{records[-1]['weight_transfer']}; trainer publish median "
              f"{statistics.median(r['publish_seconds'] for r in records) * 1e3:.1f} ms; "
              f"trainer step median {statistics.median(r['step_seconds'] for r in records):.2f} s")
    if applied:
        print(f"RESULT engine applied {len(applied)} versions, median "
              f"{statistics.median(float(ms) for _, ms, _ in applied):.1f} ms "
              f"({', '.join(sorted({how for _, _, how in applied}))})")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
