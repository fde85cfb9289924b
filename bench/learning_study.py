"""Learning study: the same job run several times per setting, held-out accuracy per step and
per minute of the whole command, in one table and one figure.

Each run is a full `asyncrl run` of the job with the setting's overrides and its own
`dataset.seed` (the prompts' order and the held-out problems), one after another on this
machine. A run folder that already holds a finished run is read, not run again, so a study can
be extended a setting or a seed at a time and re-plotted with --plot-only.

    .venv/bin/python bench/learning_study.py --setting "eta4=" --setting \\
        "eta0=algorithm.maxStaleness=0,algorithm.oversampleGroups=6" --seeds 0 1 2 --out runs/study

A setting is NAME=OVERRIDES, the overrides comma-separated dotted paths under the job's spec
(values in YAML: `algorithm.ppoMinibatches=2,trainer.evalEvery=5`). The table gives, per run,
accuracy ± one standard error at every evaluation, the minute of the whole command at which an
evaluation first showed accuracy at --target (when that evaluation ended: what a user watching
sees), and the last evaluation's distance from the run's best. A finished run's checkpoints and
weight versions are deleted (a few GB a run; --keep-checkpoints keeps the checkpoints); its
metrics, logs and report stay.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: Per-step fields of metrics.jsonl drawn in signals.png, with their axis labels.
SIGNALS = {"reward_mean": "batch reward", "entropy": "policy entropy (nats/token)",
           "truncated_fraction": "share cut at maxNewTokens", "staleness_mean": "staleness"}


def parse_setting(text: str) -> tuple[str, dict]:
    name, _, overrides = text.partition("=")
    if not name:
        raise SystemExit(f"--setting {text!r}: give NAME=OVERRIDES")
    values = {}
    for item in filter(None, overrides.split(",")):
        path, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--setting {text!r}: {item!r} is not path=value")
        values[path] = yaml.safe_load(value)
    return name, values


def job_for(base: dict, overrides: dict, seed: int) -> dict:
    job = json.loads(json.dumps(base))
    job["spec"]["dataset"]["seed"] = seed
    for path, value in overrides.items():
        node = job["spec"]
        *parents, last = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return job


def run_once(job: dict, run_dir: Path, steps: int | None, keep_checkpoints: bool = False) -> None:
    """One `asyncrl run`, its start and end time kept beside its folder."""
    timing = run_dir.with_suffix(".timing.json")
    if timing.exists():
        return
    job_file = run_dir.with_suffix(".yaml")
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(yaml.safe_dump(job, sort_keys=False))
    command = [str(Path(sys.executable).parent / "asyncrl"), "run", str(job_file),
               "--run-dir", str(run_dir)] + (["--steps", str(steps)] if steps else [])
    started = time.time()
    with run_dir.with_suffix(".log").open("w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed (exit {result.returncode}); see "
                         f"{run_dir.with_suffix('.log')}")
    timing.write_text(json.dumps({"started": started, "ended": time.time()}))
    # A study reads metrics only; each run's checkpoints and weight versions are gigabytes.
    for heavy in ("weights",) if keep_checkpoints else ("checkpoints", "weights"):
        shutil.rmtree(run_dir / heavy, ignore_errors=True)


def evaluated_at(record: dict) -> float:
    """When a record's evaluation ended: metrics.jsonl stamps a training step before its
    evaluation runs, an evaluation of its own (step 0) after."""
    if record.get("kind", "train") == "train":
        return record["time"] + record.get("eval_seconds", 0.0)
    return record["time"]


def summarise(run_dir: Path, target: float) -> dict:
    timing = json.loads(run_dir.with_suffix(".timing.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    evaluations = [{"step": r["step"], "accuracy": r["eval_accuracy"],
                    "stderr": r.get("eval_stderr"),
                    "minute": (evaluated_at(r) - timing["started"]) / 60}
                   for r in records if r.get("eval_accuracy", -1) >= 0]
    reached = next((e["minute"] for e in evaluations if e["accuracy"] >= target), None)
    best = max(e["accuracy"] for e in evaluations)
    train = [r for r in records if r.get("kind", "train") == "train"]
    return {
        "run": run_dir.name, "evaluations": evaluations, "best": best,
        "last": evaluations[-1]["accuracy"], "last_below_best": best - evaluations[-1]["accuracy"],
        "minutes_to_target": reached, "wall_minutes": (timing["ended"] - timing["started"]) / 60,
        "staleness_mean": sum(r["staleness_mean"] for r in train) / max(len(train), 1),
        "clip_fraction_mean": sum(r.get("clip_fraction", 0.0) for r in train) / max(len(train), 1),
        "signals": {key: [[r["step"], r[key]] for r in train if r.get(key) is not None]
                    for key in SIGNALS},
    }


def table(summaries: dict[str, list[dict]], target: float) -> str:
    steps = sorted({e["step"] for runs in summaries.values() for s in runs
                    for e in s["evaluations"]})
    header = ("| setting | run | " + " | ".join(f"step {s}" for s in steps)
              + f" | ≥ {target:.0%} seen at (min) | last − best | wall (min) | staleness | clip |")
    lines = [header, "|" + " --- |" * (len(steps) + 7)]
    for name, runs in summaries.items():
        for summary in runs:
            by_step = {e["step"]: e for e in summary["evaluations"]}
            cells = []
            for step in steps:
                e = by_step.get(step)
                cells.append("-" if e is None else f"{e['accuracy']:.1%}"
                             + (f" ± {e['stderr']:.1%}" if e["stderr"] is not None else ""))
            reached = summary["minutes_to_target"]
            lines.append(
                f"| {name} | {summary['run']} | " + " | ".join(cells)
                + f" | {'-' if reached is None else f'{reached:.1f}'}"
                + f" | {-summary['last_below_best']:+.1%} | {summary['wall_minutes']:.1f}"
                + f" | {summary['staleness_mean']:.2f} | {summary['clip_fraction_mean']:.3f} |")
    return "\n".join(lines)


def plot(summaries: dict[str, list[dict]], path: Path, target: float) -> None:
    figure, (by_step, by_minute) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (name, runs) in enumerate(summaries.items()):
        for number, summary in enumerate(runs):
            evaluations = summary["evaluations"]
            accuracy = [e["accuracy"] for e in evaluations]
            errors = [e["stderr"] or 0.0 for e in evaluations]
            label = name if number == 0 else None
            colour = colours[index % len(colours)]
            by_step.errorbar([e["step"] for e in evaluations], accuracy, yerr=errors, fmt="o-",
                             color=colour, alpha=0.75, capsize=2, label=label)
            by_minute.errorbar([e["minute"] for e in evaluations], accuracy, yerr=errors,
                               fmt="o-", color=colour, alpha=0.75, capsize=2, label=label)
    for axis, label in ((by_step, "step"), (by_minute, "minutes since the command started")):
        axis.axhline(target, color="grey", linestyle=":", linewidth=1)
        axis.set_xlabel(label)
        axis.set_ylabel("held-out accuracy (greedy) ± 1 s.e.")
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_signals(summaries: dict[str, list[dict]], path: Path) -> None:
    """Each signal against the step, every run (a moving mean of 5 steps: one step of two
    prompts is noisy)."""
    figure, axes = plt.subplots(1, len(SIGNALS), figsize=(4 * len(SIGNALS), 3.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (name, runs) in enumerate(summaries.items()):
        for number, summary in enumerate(runs):
            for axis, key in zip(axes, SIGNALS):
                points = summary["signals"].get(key, [])
                if not points:
                    continue
                steps, values = zip(*points)
                smooth = [sum(values[max(0, i - 4):i + 1]) / len(values[max(0, i - 4):i + 1])
                          for i in range(len(values))]
                axis.plot(steps, smooth, color=colours[index % len(colours)], alpha=0.75,
                          label=name if number == 0 else None)
    for axis, label in zip(axes, SIGNALS.values()):
        axis.set_xlabel("step")
        axis.set_title(label, fontsize=10)
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=ROOT / "examples/arith.yaml")
    parser.add_argument("--setting", action="append", required=True,
                        help="NAME=OVERRIDES (comma-separated dotted spec paths)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="override algorithm.maxSteps")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=ROOT / "runs/study")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each run's checkpoints (to score them with asyncrl eval)")
    parser.add_argument("--plot-only", action="store_true", help="read finished runs, run none")
    args = parser.parse_args()
    base = yaml.safe_load(args.job.read_text())
    settings = [parse_setting(text) for text in args.setting]
    summaries: dict[str, list[dict]] = {}
    for name, overrides in settings:
        for seed in args.seeds:
            run_dir = args.out / f"{name}-seed{seed}"
            if not args.plot_only:
                print(f"running {run_dir.name} ...", flush=True)
                run_once(job_for(base, overrides, seed), run_dir, args.steps,
                         args.keep_checkpoints)
            if run_dir.with_suffix(".timing.json").exists():
                summaries.setdefault(name, []).append(summarise(run_dir, args.target))
    if not summaries:
        raise SystemExit("no finished runs to summarise")
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(summaries, args.target)
    (args.out / "summary.md").write_text(text + "\n")
    (args.out / "summary.json").write_text(json.dumps(summaries, indent=1))
    plot(summaries, args.out / "accuracy.png", args.target)
    plot_signals(summaries, args.out / "signals.png")
    print(text)
    print(f"\n{args.out / 'accuracy.png'}, {args.out / 'signals.png'}")


if __name__ == "__main__":
    main()
