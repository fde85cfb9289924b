"""The live view of `asyncrl run` (core/progress.py)."""

import io
from types import SimpleNamespace

from rich.console import Console

from asyncrl.progress import RunProgress


def _rendered(table) -> str:
    console = Console(file=io.StringIO(), width=100)
    console.print(table)
    return console.file.getvalue()


def _stats(skipped: int) -> SimpleNamespace:
    return SimpleNamespace(accepted_total=12, depth_groups=2, running_slots=3,
                           dropped_stale_total=1, skipped_uniform_total=skipped)


def test_skipped_groups_get_a_row_once_there_are_any():
    progress = RunProgress("job", max_steps=10, group_size=8)
    assert "skipped" not in _rendered(progress.table(None, _stats(0)))
    view = _rendered(progress.table(None, _stats(7)))
    assert "skipped, every reward equal" in view
    assert view.split("skipped, every reward equal")[1].split()[1] == "7"
