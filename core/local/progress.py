"""The live view of a local run: one table, refreshed from the trainer's status and the
buffer's stats (the same figures Grafana shows in a cluster)."""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

from rich.table import Table


class RunProgress:
    def __init__(self, name: str, max_steps: int, group_size: int, unit: str = "samples"):
        """`unit`: what a group holds `group_size` of (samples, or an episode job's
        episodes, which may each give several samples)."""
        self.name = name
        self.max_steps = max_steps
        self.group_size = group_size
        self.unit = unit
        self._accepted = deque(maxlen=30)  # (time, accepted groups) for a moving rate
        self._steps = deque(maxlen=30)

    @staticmethod
    def finished(status, records: list[dict]):
        """The trainer's final state for the last frame, once it has exited: its last step
        record in metrics.jsonl (the newest evaluation included), or its last status. The
        records say more than the status does: the evaluation's problem count, the last
        step's entropy, clip fraction and engine/trainer mismatch (None where absent)."""
        train = [r for r in records if r.get("kind", "train") == "train"]
        if not train:
            return status
        last = train[-1]
        evaluated = [r for r in records if r.get("eval_accuracy", -1) >= 0]
        evaluation = evaluated[-1] if evaluated else {}
        return SimpleNamespace(
            phase="done", step=last["step"], version=last["version"],
            trained_tokens_per_second=last["trained_tokens"] / max(last["step_seconds"], 1e-9),
            reward_mean=last["reward_mean"], staleness_mean=last["staleness_mean"],
            eval_accuracy=evaluation.get("eval_accuracy", -1.0),
            eval_stderr=evaluation.get("eval_stderr", -1.0),  # runs before it: none
            eval_problems=evaluation.get("eval_problems"),
            **{key: last.get(key) for key in _LAST_STEP_SIGNALS},
        )

    def table(self, status, stats, workers: str | None = None) -> Table:
        """The live view; `workers`: the rollout workers row, shown where given."""
        now = time.monotonic()
        table = Table(title=f"asyncrl run: {self.name}", show_header=False, min_width=60)
        table.add_column(style="bold")
        table.add_column()
        step = status.step if status else 0
        table.add_row("phase", status.phase if status else "starting")
        table.add_row("step", f"{step} / {self.max_steps}")
        table.add_row("policy version", str(status.version) if status else "-")
        if stats is not None:
            self._accepted.append((now, stats.accepted_total))
        self._steps.append((now, step))
        per_second = _rate(self._accepted) * self.group_size
        table.add_row(f"{self.unit}/s (rollout)", f"{per_second:.2f}")
        if workers is not None:
            table.add_row("rollout workers", workers)
        if status:
            table.add_row("trained tokens/s", f"{status.trained_tokens_per_second:.1f}")
            table.add_row("reward mean (last batch)", f"{status.reward_mean:.3f}")
            table.add_row("staleness mean (last batch)", f"{status.staleness_mean:.2f}")
            if status.eval_accuracy >= 0:
                table.add_row("eval accuracy", _eval_accuracy(status))
            for name, text in _last_step_signals(status):
                table.add_row(name, text)
        if stats is not None:
            if stats.prompts_per_epoch:
                table.add_row("epoch", _epoch(stats))
            table.add_row("buffer depth (groups)", str(stats.depth_groups))
            table.add_row("rollouts in flight", str(stats.running_slots))
            table.add_row("dropped stale", str(stats.dropped_stale_total))
            if stats.skipped_uniform_total:
                table.add_row("skipped, every reward equal", str(stats.skipped_uniform_total))
        step_rate = _rate(self._steps)
        done = status is not None and status.phase == "done"  # maxSteps, or the data used up
        eta = (self.max_steps - step) / step_rate if step_rate > 0 and not done else None
        table.add_row("ETA", _duration(eta) if eta is not None else "-")
        return table


# Record fields the last frame shows (a finished run's records have them; the live status
# does not).
_LAST_STEP_SIGNALS = ("entropy", "clip_fraction", "mismatch_abs_mean", "mismatch_abs_max")


def _eval_accuracy(status) -> str:
    """"0.812 ± 0.031 (160 problems)": with one standard error where the status has one
    (not before the first evaluation, nor in an old run's records), and the problem count
    where the records have it (the live status does not)."""
    text = f"{status.eval_accuracy:.3f}"
    stderr = getattr(status, "eval_stderr", -1.0)
    if stderr >= 0:
        text += f" ± {stderr:.3f}"
    problems = getattr(status, "eval_problems", None)
    if problems:
        text += f" ({problems} problems)"
    return text


def _last_step_signals(status) -> list[tuple[str, str]]:
    """Rows for the last step's entropy, clip fraction and mismatch, where known."""
    value = {key: getattr(status, key, None) for key in _LAST_STEP_SIGNALS}
    rows = []
    if value["entropy"] is not None:
        rows.append(("policy entropy (last step)", f"{value['entropy']:.3f} nats/token"))
    if value["clip_fraction"] is not None:
        rows.append(("clip fraction (last step)", f"{value['clip_fraction']:.3f}"))
    if value["mismatch_abs_mean"] is not None:  # None: no token of the trainer's version
        rows.append(("engine/trainer |Δ log-prob|",
                     f"mean {value['mismatch_abs_mean']:.3g}, "
                     f"max {value['mismatch_abs_max']:.3g}"))  # often far below 1e-3
    return rows


def _epoch(stats) -> str:
    """Where the prompt cursor is: "2 / 3 (prompt 17 of 64)", counted from 1; "3 / 3, used
    up" at the end. Without dataset.epochs there is no "/ total"."""
    n = stats.prompts_per_epoch
    if stats.dataset_used_up:
        return f"{stats.epochs} / {stats.epochs}, used up"
    # Once the last epoch is handed out, the cursor stands at its end while slots finish.
    epoch = min(stats.epoch, stats.epochs - 1) if stats.epochs else stats.epoch
    position = min(stats.prompt_cursor - epoch * n, n)
    total = f" / {stats.epochs}" if stats.epochs else ""
    return f"{epoch + 1}{total} (prompt {position} of {n})"


def _rate(points: deque) -> float:
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return 0.0
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
