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
