"""The run report and plots (core/local/report.py): eval accuracy with its standard error, the
policy and optimiser signals, and old runs' records that lack them."""

import matplotlib.pyplot as plt
import pytest

from asyncrl.local import report
from asyncrl.local.report import write_plots, write_report


def _train(step: int, **fields) -> dict:
    return {"kind": "train", "step": step, "version": step, "elapsed": 6.0 * step,
            "trained_tokens": 100, "step_seconds": 0.5, "reward_mean": 0.1 * step,
            "staleness_mean": 0.5, "staleness": [0, 1], "clip_fraction": 0.01 * step} | fields


def _signals(step: int, measured: bool = True) -> dict:
    mismatch = ({"mismatch_tokens": 10 * step, "mismatch_abs_mean": 0.001 * step,
                 "mismatch_abs_max": 0.1 * step, "mismatch_k3": 0.0001,
                 "mismatch_outside_fraction": 0.02 * step} if measured else
                {"mismatch_tokens": 0, "mismatch_abs_mean": None, "mismatch_abs_max": None,
                 "mismatch_k3": None, "mismatch_outside_fraction": None})
    return _train(step, entropy=2.0 - 0.1 * step, response_length_mean=10.0 + step,
                  truncated_fraction=0.25, optimizer_steps=2.0, learning_rate=1e-6,
                  clip_fraction_per_minibatch=[0.01, 0.02], **mismatch)


def _new_run() -> list[dict]:
    records = [_signals(step, measured=step % 2 == 0) for step in range(1, 11)]
    records.insert(0, {"kind": "eval", "step": 0, "version": 0, "elapsed": 0.0,
                       "eval_accuracy": 0.25, "eval_stderr": 0.0342, "eval_problems": 160})
    records[-1] |= {"eval_accuracy": 0.8125, "eval_stderr": 0.0309, "eval_problems": 160}
    return records


def _old_run() -> list[dict]:
    records = [_train(step) for step in range(1, 6)]
    records[-1]["eval_accuracy"] = 0.5
    return records


def _lines(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_the_report_gives_accuracy_with_its_error_and_sums_up_the_signals(tmp_path):
    text = write_report(tmp_path, "job", _new_run(), sync=False).read_text()
    assert _lines(text, "- eval accuracy:") == (
        "- eval accuracy: step 0: 0.250 ± 0.034 (160 problems), "
        "step 10: 0.812 ± 0.031 (160 problems)")
    # Fifths of 10 steps: steps 1-2 and 9-10.
    assert "1.850 (first fifth) -> 1.050 (last fifth) nats/token" in _lines(
        text, "- policy entropy:")
    assert "11.5 (first fifth) -> 19.5 (last fifth) tokens" in _lines(
        text, "- response length mean:")
    assert "25.0% of responses" in _lines(text, "- response length mean:")
    assert _lines(text, "- PPO clip fraction:") == (
        "- PPO clip fraction: mean 0.055, max 0.100; optimizer steps per batch: 2")
    # Steps 2, 4, ..., 10 measured 20 + 40 + ... + 100 = 300 tokens; token-weighted mean.
    mismatch = _lines(text, "- engine/trainer mismatch")
    assert "over 300 tokens" in mismatch and "(5 of 10 steps)" in mismatch
    assert "mean 0.00733, max 1;" in mismatch and "max 20.00% of tokens" in mismatch
    assert "plots/signals.png" in _lines(text, "Plots:")


def test_the_report_says_what_became_of_the_groups_generated(tmp_path):
    from asyncrl.v1 import buffer_pb2

    # The ninth round's seed 0: 260 prompts drawn, 248 groups accepted or skipped by the end.
    stats = buffer_pb2.BufferStats(accepted_total=118, consumed_total=80, dropped_stale_total=26,
                                   skipped_uniform_total=142, depth_groups=12)
    text = write_report(tmp_path, "job", _new_run(), sync=False, buffer_stats=stats).read_text()
    assert _lines(text, "- groups generated:") == (
        "- groups generated: 260; trained 80 (31%), skipped, every reward equal 142 (55%), "
        "dropped, staler than the bound 26 (10%), not trained by the end 12 (5%)")
    # Nothing generated (a run stopped at once), or no buffer answering: no line.
    empty = write_report(tmp_path, "job", _new_run(), sync=False,
                         buffer_stats=buffer_pb2.BufferStats()).read_text()
    assert "groups generated" not in empty
    assert "groups generated" not in write_report(tmp_path, "job", _new_run(),
                                                  sync=False).read_text()


def test_an_old_runs_report_has_no_error_nor_signals_it_did_not_record(tmp_path):
    text = write_report(tmp_path, "job", _old_run(), sync=False).read_text()
    assert _lines(text, "- eval accuracy:") == "- eval accuracy: step 5: 0.500"
    for absent in ("±", "entropy", "response length", "mismatch", "optimizer steps"):
        assert absent not in text, absent
    assert "- PPO clip fraction: mean 0.030, max 0.050" in text
    # The clip fraction, which old runs recorded too, has its plot.
    assert "plots/signals.png" in text


def test_plots_of_a_new_run_draw_error_bars_and_the_signals(tmp_path, monkeypatch):
    drawn = []
    errorbar = plt.Axes.errorbar

    def recorded(axis, x, y, yerr=None, **options):
        drawn.append((list(x), list(yerr)))
        return errorbar(axis, x, y, yerr=yerr, **options)

    monkeypatch.setattr(plt.Axes, "errorbar", recorded)
    written = write_plots(tmp_path, _new_run())
    assert tmp_path / "plots/signals.png" in written
    assert all(path.stat().st_size > 0 for path in written)
    errors = [0.0342, 0.0309]
    assert drawn == [([0, 10], errors), ([0.0, 1.0], errors)]  # vs step, vs wall time (min)
    panels = [title for title, _, _ in report.signal_panels(report.train_records(_new_run()))]
    assert panels == ["policy entropy", "response length",
                      "truncated responses and clipped tokens",
                      "engine/trainer mismatch: mean |Δ log-prob|",
                      "engine/trainer mismatch: max |Δ log-prob|"]


def test_the_signal_panels_skip_what_no_record_has():
    megatron = [_signals(1) | {"entropy": None}, _signals(2, measured=False) | {"entropy": None}]
    titles = [title for title, _, _ in report.signal_panels(megatron)]
    assert "policy entropy" not in titles
    assert "engine/trainer mismatch: max |Δ log-prob|" in titles
    old = [title for title, _, _ in report.signal_panels(_old_run())]
    assert old == ["truncated responses and clipped tokens"]


def test_plots_of_an_old_run_draw_accuracy_without_error_bars(tmp_path, monkeypatch):
    monkeypatch.setattr(plt.Axes, "errorbar", lambda *_, **__: pytest.fail("no error to draw"))
    written = write_plots(tmp_path, _old_run())
    assert {p.name for p in written} == {"reward_vs_step.png", "reward_vs_time.png",
                                         "throughput.png", "staleness.png", "signals.png"}
