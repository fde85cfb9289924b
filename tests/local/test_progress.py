"""The live view of `asyncrl run` (core/local/progress.py)."""

import io
from types import SimpleNamespace

from rich.console import Console

from asyncrl.local.progress import RunProgress


def _rendered(table) -> str:
    console = Console(file=io.StringIO(), width=100)
    console.print(table)
    return console.file.getvalue()


def _stats(skipped: int = 0, **cursor) -> SimpleNamespace:
    values = dict(prompts_per_epoch=0, prompt_cursor=0, epoch=0, epochs=0,
                  dataset_used_up=False) | cursor
    return SimpleNamespace(accepted_total=12, depth_groups=2, running_slots=3,
                           dropped_stale_total=1, skipped_uniform_total=skipped, **values)


def test_skipped_groups_get_a_row_once_there_are_any():
    progress = RunProgress("job", max_steps=10, group_size=8)
    assert "skipped" not in _rendered(progress.table(None, _stats(0)))
    view = _rendered(progress.table(None, _stats(7)))
    assert "skipped, every reward equal" in view
    assert view.split("skipped, every reward equal")[1].split()[1] == "7"


def _row(view: str, name: str) -> str:
    return next(line for line in view.splitlines() if f" {name} " in line).split(name)[1]


def test_the_epoch_row_says_where_the_prompt_cursor_is():
    progress = RunProgress("job", max_steps=10, group_size=8)
    assert " epoch " not in _rendered(progress.table(None, _stats()))  # no worker asked yet
    view = _rendered(progress.table(None, _stats(prompts_per_epoch=64, prompt_cursor=81,
                                                 epoch=1, epochs=3)))
    assert "2 / 3 (prompt 17 of 64)" in _row(view, "epoch")
    # Every epoch handed out, slots still out: the last epoch, whole.
    view = _rendered(progress.table(None, _stats(prompts_per_epoch=64, prompt_cursor=192,
                                                 epoch=3, epochs=3)))
    assert "3 / 3 (prompt 64 of 64)" in _row(view, "epoch")
    view = _rendered(progress.table(None, _stats(prompts_per_epoch=64, prompt_cursor=192,
                                                 epoch=3, epochs=3, dataset_used_up=True)))
    assert "3 / 3, used up" in _row(view, "epoch")
    view = _rendered(progress.table(None, _stats(prompts_per_epoch=64, prompt_cursor=200,
                                                 epoch=3)))  # no dataset.epochs: no end
    assert "4 (prompt 8 of 64)" in _row(view, "epoch")


def test_a_finished_run_shows_no_eta_even_short_of_max_steps(monkeypatch):
    """A job that ended with its dataset used up stops before maxSteps: no time is left."""
    clock = iter([0.0, 10.0, 20.0])
    monkeypatch.setattr("asyncrl.local.progress.time.monotonic", lambda: next(clock))
    progress = RunProgress("job", max_steps=100, group_size=8)
    status = SimpleNamespace(phase="training", step=0, version=0, trained_tokens_per_second=1.0,
                             reward_mean=0.0, staleness_mean=0.0, eval_accuracy=-1.0)
    progress.table(status, _stats())
    status.step = 3
    assert _row(_rendered(progress.table(status, _stats())), "ETA").strip(" │") == "5m23s"
    status.phase, status.step = "done", 4
    assert _row(_rendered(progress.table(status, _stats())), "ETA").strip(" │") == "-"


def test_an_episode_job_counts_episodes_per_second():
    view = _rendered(RunProgress("job", max_steps=10, group_size=8, unit="episodes")
                     .table(None, _stats()))
    assert "episodes/s (rollout)" in view and "samples/s" not in view


def _status(**fields) -> SimpleNamespace:
    values = dict(phase="training", step=3, version=3, trained_tokens_per_second=1.0,
                  reward_mean=0.5, staleness_mean=0.5, eval_accuracy=0.8125,
                  eval_stderr=0.0309) | fields
    return SimpleNamespace(**values)


def test_eval_accuracy_shows_its_standard_error_once_evaluated():
    progress = RunProgress("job", max_steps=10, group_size=8)
    row = _row(_rendered(progress.table(_status(), _stats())), "eval accuracy")
    assert "0.812 ± 0.031" in row and "problems" not in row  # the live status has no count
    assert "±" not in _row(_rendered(progress.table(_status(eval_stderr=-1.0), _stats())),
                           "eval accuracy")
    view = _rendered(progress.table(_status(eval_accuracy=-1.0, eval_stderr=-1.0), _stats()))
    assert "eval accuracy" not in view  # not evaluated yet


def _train(step: int, **fields) -> dict:
    return {"kind": "train", "step": step, "version": step, "trained_tokens": 100,
            "step_seconds": 0.5, "reward_mean": 0.25, "staleness_mean": 1.0,
            "clip_fraction": 0.0625} | fields


def test_the_last_frame_shows_the_records_evaluation_and_signals():
    records = [
        _train(1, entropy=1.5, mismatch_tokens=40, mismatch_abs_mean=0.002,
               mismatch_abs_max=0.25),
        {"kind": "eval", "step": 2, "eval_accuracy": 0.8125, "eval_stderr": 0.0309,
         "eval_problems": 160},
        _train(2, entropy=1.25, mismatch_tokens=0, mismatch_abs_mean=None,
               mismatch_abs_max=None),
    ]
    view = _rendered(RunProgress("job", max_steps=2, group_size=8)
                     .table(RunProgress.finished(None, records), _stats()))
    assert "0.812 ± 0.031 (160 problems)" in _row(view, "eval accuracy")
    assert "1.250 nats/token" in _row(view, "policy entropy (last step)")
    assert "0.062" in _row(view, "clip fraction (last step)")
    assert "|Δ log-prob|" not in view  # the last step measured no mismatch
    view = _rendered(RunProgress("job", max_steps=2, group_size=8)
                     .table(RunProgress.finished(None, records[:1]), _stats()))
    assert "mean 0.002, max 0.25" in _row(view, "engine/trainer |Δ log-prob|")


def test_the_last_frame_of_an_old_run_shows_accuracy_without_an_error():
    records = [_train(1, eval_accuracy=0.5)]  # before eval_stderr and the signals
    view = _rendered(RunProgress("job", max_steps=1, group_size=8)
                     .table(RunProgress.finished(None, records), _stats()))
    assert _row(view, "eval accuracy").strip(" │") == "0.500"
    assert "entropy" not in view and "|Δ log-prob|" not in view
