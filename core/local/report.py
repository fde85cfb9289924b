"""Plots and a short report of a run, from its metrics.jsonl."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind", "train") == "train"]


def write_plots(run_dir: Path, all_records: list[dict]) -> list[Path]:
    """reward/eval vs step and vs wall time, throughput, staleness histogram."""
    records = train_records(all_records)
    evaluated = [r for r in all_records if r.get("eval_accuracy", -1) >= 0]
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    steps = [r["step"] for r in records]
    minutes = [r["elapsed"] / 60 for r in records]
    written = []

    for x_name, xs, eval_xs in (
        ("step", steps, [r["step"] for r in evaluated]),
        ("wall time (min)", minutes, [r["elapsed"] / 60 for r in evaluated]),
    ):
        figure, axis = plt.subplots(figsize=(7, 4))
        axis.plot(xs, [r["reward_mean"] for r in records], label="batch reward mean", alpha=0.6)
        if evaluated:
            axis.plot(eval_xs, [r["eval_accuracy"] for r in evaluated], "o-", label="eval accuracy")
        axis.set_xlabel(x_name)
        axis.set_ylim(-0.02, 1.02)
        axis.legend()
        axis.grid(alpha=0.3)
        name = "reward_vs_step.png" if x_name == "step" else "reward_vs_time.png"
        written.append(_save(figure, plots / name))

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(steps, [r["trained_tokens"] / max(r["step_seconds"], 1e-9) for r in records])
    axis.set_xlabel("step")
    axis.set_ylabel("trained tokens/s (update only)")
    axis.grid(alpha=0.3)
    written.append(_save(figure, plots / "throughput.png"))

    counts = Counter(s for r in records for s in r.get("staleness", []))
    figure, axis = plt.subplots(figsize=(7, 4))
    keys = sorted(counts)
    axis.bar(keys, [counts[k] for k in keys])
    axis.set_xlabel("staleness of trained groups (versions)")
    axis.set_ylabel("groups")
    written.append(_save(figure, plots / "staleness.png"))
    return written


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_report(run_dir: Path, job_name: str, all_records: list[dict], sync: bool) -> Path:
    records = train_records(all_records)
    evaluated = [r for r in all_records if r.get("eval_accuracy", -1) >= 0]
    elapsed = records[-1]["elapsed"] if records else 0.0
    trained = sum(r["trained_tokens"] for r in records)
    lines = [
        f"# Run report: {job_name}",
        "",
        f"- mode: {'synchronous (η = 0, generation waits for training)' if sync else 'asynchronous'}",
        f"- steps: {records[-1]['step'] if records else 0}, final policy version "
        f"{records[-1]['version'] if records else 0}",
        f"- wall time: {elapsed / 60:.1f} min; trained tokens: {trained:.0f} "
        f"({trained / max(elapsed, 1e-9):.1f} effective trained tokens/s)",
    ]
    if records:
        first, last = records[: max(1, len(records) // 5)], records[-max(1, len(records) // 5):]
        lines.append(f"- batch reward mean: {_mean(first, 'reward_mean'):.3f} (first fifth) -> "
                     f"{_mean(last, 'reward_mean'):.3f} (last fifth)")
        lines.append(f"- staleness of trained groups: mean "
                     f"{_mean(records, 'staleness_mean'):.2f}, max "
                     f"{max(max(r['staleness']) for r in records)}")
    if evaluated:
        lines.append("- eval accuracy: " + ", ".join(
            f"step {r['step']}: {r['eval_accuracy']:.3f}" for r in evaluated))
    lines += ["", "Plots: plots/reward_vs_step.png, plots/reward_vs_time.png, "
              "plots/throughput.png, plots/staleness.png", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _mean(records: list[dict], key: str) -> float:
    return sum(r[key] for r in records) / len(records)
