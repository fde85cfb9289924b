"""What `asyncrl data preview` and `asyncrl validate` say about a job's prompts: the first
prompts exactly as the model sees them, and how many are too long to run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncrl.data.files import PACKAGE_SCHEME
from asyncrl.data.prompts import PromptItem, PromptSet


def local_data_missing(spec) -> str | None:
    """The dataset path of a file job when it is not on this machine (it may be a path in
    the pods' image or volume), else None."""
    dataset = spec.dataset
    if dataset.kind != "file":
        return None
    for path in filter(None, (dataset.path, dataset.eval_path)):
        if path.startswith(PACKAGE_SCHEME) or any(c in path for c in "*?["):
            continue
        if not Path(path).exists():
            return path
    return None


def check_dataset(spec) -> str:
    """Opens a file job's dataset and checks every row against its mapping (raises
    DatasetError); a one-line summary of what it holds."""
    from asyncrl.data.mapping import open_dataset

    train, held_out, _ = open_dataset(spec)
    return (f"{spec.dataset.path}: {len(train)} training and {len(held_out)} evaluation "
            "prompts, fields checked")


@dataclass(frozen=True)
class Lengths:
    count: int
    too_long: int
    longest: int
    mean: float


def prompt_lengths(prompts: PromptSet, advance=lambda: None) -> Lengths:
    """Token counts of every prompt (each built, so each is checked); `advance` is called
    once per prompt (a progress bar)."""
    longest = total = too_long = 0
    for item in prompts:
        length = len(item.prompt_ids)
        longest, total = max(longest, length), total + length
        too_long += not prompts.fits(item)
        advance()
    return Lengths(len(prompts), too_long, longest, total / max(len(prompts), 1))


def describe(item: PromptItem, tokenizer, limit: int | None) -> tuple[str, str]:
    """(header, text) of one prompt: id, tokens, reference; the text the model is given."""
    length = len(item.prompt_ids)
    over = f" > maxPromptTokens {limit}: dropped" if limit is not None and length > limit else ""
    reference = _reference_text(item.reference)
    header = f"{item.prompt_id}  ({length} tokens{over})"
    if reference:
        header += f"  reference: {reference}"
    return header, tokenizer.decode(item.prompt_ids)


def _reference_text(reference) -> str:
    if reference is None:
        return ""
    test_code = getattr(reference, "test_code", None)
    if test_code is not None:
        cases = len(getattr(reference, "io_cases", ()))
        lines = len(test_code.strip().splitlines())
        return f"{lines} lines of test code" + (f", {cases} stdin/stdout cases" if cases else "")
    return repr(str(reference))

