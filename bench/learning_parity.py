"""Learning parity: does staleness-aware (decoupled) PPO learn as well with stale samples?

Runs the same job with η = 0, 1, 4 under the decoupled objective and η = 4 with standard PPO
(`decoupled: false`), then plots held-out accuracy against step for all four in one figure.
The expected picture (AReaL): the decoupled curves reach the same level; standard PPO degrades
as η grows. Each run is a full `asyncrl run`, so this takes a while (four times one run).

    .venv/bin/python bench/learning_parity.py [--job examples/arith.yaml] [--steps 40] [--out runs/parity]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [("η=0", 0, True), ("η=1", 1, True), ("η=4", 4, True), ("η=4, standard PPO", 4, False)]


def run(job: dict, name: str, out: Path, steps: int) -> list[dict]:
    run_dir = out / name.replace(" ", "").replace(",", "-").replace("η=", "eta")
    job_file = run_dir.with_suffix(".yaml")
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(yaml.safe_dump(job))
    result = subprocess.run([str(Path(sys.executable).parent / "asyncrl"), "run", str(job_file),
                             "--run-dir", str(run_dir), "--steps", str(steps)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stdout[-3000:]}{result.stderr[-2000:]}")
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("eval_accuracy", -1) >= 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=ROOT / "examples/arith.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=ROOT / "runs/parity")
    args = parser.parse_args()
    base = yaml.safe_load(args.job.read_text())
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, eta, decoupled in SETTINGS:
        job = yaml.safe_load(yaml.safe_dump(base))
        job["spec"]["algorithm"].update(maxStaleness=eta, decoupled=decoupled)
        evaluations = run(job, name, args.out, args.steps)
        axis.plot([r["step"] for r in evaluations], [r["eval_accuracy"] for r in evaluations],
                  "o-", label=name)
        print(name, " ".join(f"{r['step']}:{r['eval_accuracy']:.3f}" for r in evaluations))
    axis.set_xlabel("step")
    axis.set_ylabel("held-out accuracy (greedy)")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.out / "learning_parity.png", dpi=100)
    print(f"figure: {args.out / 'learning_parity.png'}")


if __name__ == "__main__":
    main()
