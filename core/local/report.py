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
    """reward/eval vs step and vs wall time, throughput, staleness histogram, and the policy
    and optimiser signals vs step (entropy, response length, truncated and clipped shares,
    engine/trainer mismatch) where the records have them."""
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
            _plot_accuracy(axis, eval_xs, evaluated)
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

    if signal_panels(records):
        written.append(_save(_signals_figure(records), plots / SIGNALS_PLOT))
    return written


def _plot_accuracy(axis, xs: list[float], evaluated: list[dict]) -> None:
    """Eval accuracy with one standard error as error bars (none in an old run's records)."""
    accuracy = [r["eval_accuracy"] for r in evaluated]
    if not any("eval_stderr" in r for r in evaluated):
        axis.plot(xs, accuracy, "o-", label="eval accuracy")
        return
    errors = [r.get("eval_stderr", 0.0) for r in evaluated]
    axis.errorbar(xs, accuracy, yerr=errors, fmt="o-", capsize=3,
                  label="eval accuracy (± 1 standard error)")


SIGNALS_PLOT = "signals.png"

# The panels of plots/signals.png: (title, [(record field, label)], y label); a panel shows
# only where records carry its fields (an old run's have the clip fraction alone; the
# Megatron backend records no entropy).
_SIGNAL_PANELS = (
    ("policy entropy", [("entropy", "entropy")], "nats/token"),
    ("response length", [("response_length_mean", "mean length")], "tokens"),
    ("truncated responses and clipped tokens",
     [("truncated_fraction", "responses cut at maxNewTokens"),
      ("clip_fraction", "tokens clipped by PPO")], "share"),
    # Apart: the max is often orders of magnitude above the mean.
    ("engine/trainer mismatch: mean |Δ log-prob|", [("mismatch_abs_mean", "mean")], "nats"),
    ("engine/trainer mismatch: max |Δ log-prob|", [("mismatch_abs_max", "max")], "nats"),
)


def signal_panels(records: list[dict]) -> list[tuple[str, list[tuple[str, str]], str]]:
    """The signal panels some train record has a value for."""
    return [(title, [(key, label) for key, label in series if _series(records, key)[0]], unit)
            for title, series, unit in _SIGNAL_PANELS
            if any(_series(records, key)[0] for key, _ in series)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records with a value for `key` (the mismatch is None in steps
    whose batch held no token of the trainer's version)."""
    present = [r for r in records if r.get(key) is not None]
    return [r["step"] for r in present], [r[key] for r in present]


def _signals_figure(records: list[dict]):
    panels = signal_panels(records)
    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 2.2 * len(panels) + 0.6),
                                sharex=True, squeeze=False)
    for axis, (title, series, unit) in zip(axes[:, 0], panels):
        for key, label in series:
            steps, values = _series(records, key)
            axis.plot(steps, values, ".-", label=label)
        axis.set_title(title, fontsize=9)
        axis.set_ylabel(unit)
        axis.grid(alpha=0.3)
        if len(series) > 1:
            axis.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    return figure


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_report(run_dir: Path, job_name: str, all_records: list[dict], sync: bool,
                 buffer_stats=None) -> Path:
    """`buffer_stats`: the buffer's BufferStats at the end, when it answered (the line on what
    became of the groups generated)."""
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
        first, last = _fifths(records)
        lines.append(f"- batch reward mean: {_mean(first, 'reward_mean'):.3f} (first fifth) -> "
                     f"{_mean(last, 'reward_mean'):.3f} (last fifth)")
        lines.append(f"- staleness of trained groups: mean "
                     f"{_mean(records, 'staleness_mean'):.2f}, max "
                     f"{max(max(r['staleness']) for r in records)}")
    if evaluated:
        lines.append("- eval accuracy: " + ", ".join(
            f"step {r['step']}: {_accuracy(r)}" for r in evaluated))
    if buffer_stats is not None:
        lines += _generation_lines(buffer_stats)
    lines += _signal_lines(records)
    plots = ["reward_vs_step.png", "reward_vs_time.png", "throughput.png", "staleness.png"]
    if signal_panels(records):
        plots.append(SIGNALS_PLOT)
    lines += ["", "Plots: " + ", ".join(f"plots/{name}" for name in plots), ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _mean(records: list[dict], key: str) -> float:
    return sum(r[key] for r in records) / len(records)


def _accuracy(record: dict) -> str:
    """"0.812 ± 0.031 (160 problems)", or "0.812" from a run that recorded no error."""
    text = f"{record['eval_accuracy']:.3f}"
    if "eval_stderr" in record:
        text += f" ± {record['eval_stderr']:.3f}"
    if "eval_problems" in record:
        text += f" ({record['eval_problems']} problems)"
    return text


def _signal_lines(records: list[dict]) -> list[str]:
    """The policy and optimiser signals in a few lines, each only where recorded."""
    lines = []
    entropy = [r for r in records if r.get("entropy") is not None]
    if entropy:
        first, last = _fifths(entropy)
        lines.append(f"- policy entropy: {_mean(first, 'entropy'):.3f} (first fifth) -> "
                     f"{_mean(last, 'entropy'):.3f} (last fifth) nats/token")
    shaped = [r for r in records if "response_length_mean" in r]
    if shaped:
        first, last = _fifths(shaped)
        lines.append(f"- response length mean: {_mean(first, 'response_length_mean'):.1f} "
                     f"(first fifth) -> {_mean(last, 'response_length_mean'):.1f} (last fifth) "
                     f"tokens; cut at maxNewTokens: {_mean(shaped, 'truncated_fraction'):.1%} "
                     "of responses")
    clipped = [r for r in records if "clip_fraction" in r]
    if clipped:
        line = (f"- PPO clip fraction: mean {_mean(clipped, 'clip_fraction'):.3f}, max "
                f"{max(r['clip_fraction'] for r in clipped):.3f}")
        if all("optimizer_steps" in r for r in clipped):
            line += f"; optimizer steps per batch: {_mean(clipped, 'optimizer_steps'):.0f}"
        lines.append(line)
    measured = [r for r in records if r.get("mismatch_tokens")]
    if measured:
        tokens = sum(r["mismatch_tokens"] for r in measured)
        mean = sum(r["mismatch_abs_mean"] * r["mismatch_tokens"] for r in measured) / tokens
        lines.append(f"- engine/trainer mismatch over {tokens} tokens of the trainer's version "
                     f"({len(measured)} of {len(records)} steps): |Δ log-prob| mean "
                     f"{mean:.3g}, max {max(r['mismatch_abs_max'] for r in measured):.3g}; "
                     f"ratio outside [0.5, 2]: max "
                     f"{max(r['mismatch_outside_fraction'] for r in measured):.2%} of tokens")
    return lines


def _generation_lines(stats) -> list[str]:
    """What became of the groups the rollout generated: on a small machine generation is most of
    the work, and groups never trained are why a run takes longer than its steps suggest."""
    produced = stats.accepted_total + stats.skipped_uniform_total
    if not produced:
        return []
    left = max(0, stats.accepted_total - stats.consumed_total - stats.dropped_stale_total)
    parts = [(stats.consumed_total, "trained"),
             (stats.skipped_uniform_total, "skipped, every reward equal"),
             (stats.dropped_stale_total, "dropped, staler than the bound"),
             (left, "not trained by the end")]
    return [f"- groups generated: {produced}; " + ", ".join(
        f"{label} {count} ({count / produced:.0%})" for count, label in parts if count)]


def _fifths(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """The first and the last fifth of `records` (at least one each)."""
    size = max(1, len(records) // 5)
    return records[:size], records[-size:]
