"""From a dataset row to a prompt and its reference (dataset.kind: file).

`dataset.fields` says which fields of a row make the prompt (a text field, a field of chat
turns, or a template over the row's fields) and what a response is checked against (a
reference answer, or tests). A preset is the mapping of a published dataset's layout, with
the instruction its prompts need and how its references are read (GSM8K's `#### N`, MATH's
last `\\boxed{}`, HumanEval's `check(entry_point)`, MBPP's `test_list`).

Rows are checked column by column when the dataset is opened (`open_dataset`): a missing
field, a row without a value, a value of the wrong shape fail at start, naming the file, the
row and the field. Prompts are then built row by row as they are asked for (`file_prompts`).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from asyncrl.data.files import DataFiles, DatasetError, load_rows, locate, row_where
from asyncrl.data.prompts import PromptItem, PromptSet, chat_messages, chat_prompt_ids

#: The instruction math presets add, so that the answer can be found (reward.math.extract's
#: default is boxed).
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{{}}."
CODE_INSTRUCTION = "Reply with the complete function in a ```python code block."


@dataclass(frozen=True)
class CodeTests:
    """A row's tests, as the code reward runs them: assert-style `test_code` run after the
    program, stdin/stdout `io_cases` (one process each), and `prelude` put before the
    program (e.g. the imports a HumanEval prompt opens with)."""

    test_code: str = ""
    io_cases: tuple[tuple[str, str], ...] = ()
    prelude: str = ""


@dataclass(frozen=True)
class Mapping:
    """Which fields make a prompt and its reference (a preset's, or the job's own)."""

    prompt: str | None = None
    messages: str | None = None
    template: str | None = None
    answer: str | None = None
    tests: str | None = None
    id: str | None = None
    # A preset's own readers of its fields: row -> answer text / CodeTests.
    read_answer: Callable[[dict], str] | None = field(default=None, compare=False)
    read_tests: Callable[[dict], CodeTests] | None = field(default=None, compare=False)
    # (field, what it must contain, what that means): a check of every row of a preset.
    must_contain: tuple[str, str, str] | None = None
    # Fields a preset reads besides the ones above.
    extra_fields: tuple[str, ...] = ()

    def overlaid(self, fields) -> Mapping:
        """This mapping with the job's `dataset.fields` (DatasetFields) on top: a field the
        job names replaces the preset's, and its value is then read as the job's own."""
        if fields is None:
            return self
        given = fields.model_dump(exclude_none=True)
        if {"prompt", "messages", "template"} & given.keys():
            given = {"prompt": None, "messages": None, "template": None, **given}
        changed = replace(self, **given)
        if "answer" in given:
            changed = replace(changed, read_answer=None, must_contain=None)
        if "tests" in given:
            changed = replace(changed, read_tests=None, extra_fields=())
        return changed

    @property
    def prompt_fields(self) -> list[str]:
        if self.messages:
            return [self.messages]
        if self.template:
            return template_fields(self.template)
        return [self.prompt or "prompt"]


def gsm8k_answer(row: dict) -> str:
    """GSM8K's answer field ends in `#### <number>`; the number, without thousands commas."""
    return row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    opening = text.find("{", start)
    if opening < 0:
        return None
    depth = 0
    for index in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[opening + 1:index]
    return None


def math_answer(row: dict) -> str:
    return last_boxed(row["solution"]) or ""


def humaneval_tests(row: dict) -> CodeTests:
    # The prompt (imports, helpers and the signature) goes first, so a response that
    # rewrites the function without its imports still runs; the test defines check().
    return CodeTests(test_code=f"{row['test']}\n\ncheck({row['entry_point']})\n",
                     prelude=row["prompt"])


def mbpp_tests(row: dict) -> CodeTests:
    setup = row.get("test_setup_code") or ""
    return CodeTests(test_code="\n".join([setup, *row["test_list"]]).strip() + "\n")


PRESETS: dict[str, Mapping] = {
    "gsm8k": Mapping(
        template="{question}\n" + MATH_INSTRUCTION, answer="answer", read_answer=gsm8k_answer,
        must_contain=("answer", "####", "GSM8K's answers end in '#### N'"),
    ),
    "math": Mapping(
        template="{problem}\n" + MATH_INSTRUCTION, answer="solution", read_answer=math_answer,
        must_contain=("solution", "\\boxed", "MATH's solutions give the answer in \\boxed{}"),
    ),
    "humaneval": Mapping(
        template="Complete this Python function:\n```python\n{prompt}```\n" + CODE_INSTRUCTION,
        tests="test", read_tests=humaneval_tests, extra_fields=("prompt", "entry_point"),
        id="task_id",
    ),
    "mbpp": Mapping(
        template="{text}\nYour code should pass these tests:\n{test_list}\n" + CODE_INSTRUCTION,
        tests="test_list", read_tests=mbpp_tests, id="task_id",
    ),
}


def template_fields(template: str) -> list[str]:
    """The row fields a prompt template names; DatasetError for a malformed template."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise DatasetError("dataset.fields.template", f"not a valid template: {exc}",
                           "name fields in braces, e.g. 'Solve: {question}'; write a literal "
                           "brace twice ({{ or }})") from None
    for name in names:
        if not re.fullmatch(r"[A-Za-z_][\w]*", name):
            raise DatasetError("dataset.fields.template", f"{{{name}}} is not a field name",
                               "name fields in braces, e.g. 'Solve: {question}'; write a "
                               "literal brace twice ({{ or }})")
    return list(dict.fromkeys(names))


def job_mapping(dataset, reference: str | None) -> Mapping:
    """The mapping a job's dataset section describes; `reference` is what its reward reads
    from each row (spec.reference_reward: math, code, or None)."""
    base = PRESETS[dataset.preset] if dataset.preset else Mapping()
    mapping = base.overlaid(dataset.fields)
    # A preset's references are read only when its reward kind uses them.
    if reference != "math":
        mapping = replace(mapping, answer=None, read_answer=None, must_contain=None)
    if reference != "code":
        mapping = replace(mapping, tests=None, read_tests=None, extra_fields=())
    return mapping


# --------------------------------------------------------------------------- checks


@dataclass
class Rows:
    """One split's rows of a dataset and where they came from (for errors)."""

    files: DataFiles
    data: Any  # datasets.Dataset
    start: int = 0
    stop: int | None = None

    def __post_init__(self):
        if self.stop is None:
            self.stop = len(self.data)

    def __len__(self) -> int:
        return self.stop - self.start

    def row(self, index: int) -> dict:
        return self.data[self.start + index]

    def where(self, index: int) -> str:
        return row_where(self.files, self.start + index)


def check_rows(rows: Rows, mapping: Mapping) -> None:
    """Every field `mapping` reads is present in every row, with a value of the right shape;
    else DatasetError naming the first row and field that is not."""
    table = rows.data.data  # the Arrow table under the dataset
    columns = set(table.column_names)
    needed = [(name, "prompt") for name in mapping.prompt_fields]
    needed += [(mapping.answer, "answer"), (mapping.tests, "tests"), (mapping.id, "id")]
    needed += [(name, "") for name in mapping.extra_fields]
    for name, role in needed:
        if name is None:
            continue
        if name not in columns:
            setting = f"dataset.fields.{role}" if role else "the preset"
            raise DatasetError(
                rows.files.spec_path, f"no row has a field '{name}' (its rows have "
                f"{', '.join(sorted(columns))})",
                f"set {setting} to the field that holds it" if role else
                "use a file in the preset's layout, or map the fields with dataset.fields")
        column = table.column(name)
        # null_count is kept with each chunk: rows are read only when some lack the field.
        missing = _first(column.is_null()) if column.null_count else None
        if missing is not None:
            raise DatasetError(rows.where(missing), f"field '{name}' is missing",
                               "give every row a value, or remove the row")
    if mapping.messages:
        _check_messages(rows, mapping.messages)
    if mapping.tests and not mapping.read_tests:
        _check_tests(rows, mapping.tests)
    if mapping.must_contain:
        name, text, meaning = mapping.must_contain
        import pyarrow.compute as pc

        column = table.column(name).cast("string")
        lacking = _first(pc.invert(pc.match_substring(column, text)))
        if lacking is not None:
            raise DatasetError(rows.where(lacking), f"field '{name}' has no '{text}' ({meaning})",
                               "fix the row, or map the fields yourself with dataset.fields")


def _first(mask) -> int | None:
    """Index of the first true value of an Arrow boolean array, or None."""
    import pyarrow.compute as pc

    found = pc.index(mask, True).as_py()
    return None if found is None or found < 0 else found


def _check_messages(rows: Rows, name: str) -> None:
    feature = rows.data.features[name]
    inner = getattr(feature, "feature", None)
    if isinstance(feature, list) and feature:
        inner = feature[0]
    keys = set(inner) if isinstance(inner, dict) else set()
    if not {"role", "content"} <= keys:
        raise DatasetError(
            rows.files.spec_path, f"field '{name}' is not a list of chat turns "
            "({role, content} objects)",
            f"give {name} as [{{\"role\": \"user\", \"content\": \"...\"}}, ...], or use "
            "dataset.fields.prompt for a text field")


def _check_tests(rows: Rows, name: str) -> None:
    value = rows.row(0)[name]
    try:
        read_tests_value(value)
    except ValueError as exc:
        raise DatasetError(rows.where(0), f"field '{name}': {exc}", TESTS_FIX) from None


TESTS_FIX = ("give assert-style test code (a string or a list of strings), or stdin/stdout "
             "cases as a list of {\"input\": ..., \"output\": ...}")


def read_tests_value(value: Any) -> CodeTests:
    """A tests field's value as CodeTests: test code, a list of asserts, or io cases."""
    if isinstance(value, str):
        return CodeTests(test_code=value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return CodeTests(test_code="\n".join(value) + "\n")
    if isinstance(value, list) and all(isinstance(v, dict) and {"input", "output"} <= v.keys()
                                       for v in value):
        return CodeTests(io_cases=tuple((str(v["input"]), str(v["output"])) for v in value))
    raise ValueError(f"a {type(value).__name__} is not tests")


# --------------------------------------------------------------------------- prompts


def open_dataset(spec) -> tuple[Rows, Rows, Mapping]:
    """(train rows, eval rows, mapping) of a file dataset, every row checked."""
    dataset = spec.dataset
    mapping = job_mapping(dataset, spec.reference_reward)
    files = locate(dataset.path)
    rows = Rows(files, load_rows(files))
    if dataset.eval_path:
        eval_files = locate(dataset.eval_path, "dataset.evalPath")
        train, held_out = rows, Rows(eval_files, load_rows(eval_files))
    else:
        held = int(round(len(rows) * dataset.eval_fraction))
        cut = len(rows) - held
        train, held_out = Rows(files, rows.data, 0, cut), Rows(files, rows.data, cut)
    for split in (train, held_out) if dataset.eval_path else (rows,):
        if len(split):
            check_rows(split, mapping)
    if not len(train):
        raise DatasetError(dataset.path, "holds no training rows",
                           "add rows, or lower dataset.evalFraction")
    return train, held_out, mapping


def file_prompts(spec, tokenizer) -> tuple[PromptSet, PromptSet]:
    train, held_out, mapping = open_dataset(spec)
    dataset = spec.dataset
    return tuple(
        PromptSet(len(rows), _item_builder(rows, mapping, tokenizer, dataset.system_prompt),
                  dataset.max_prompt_tokens)
        for rows in (train, held_out)
    )


def _item_builder(rows: Rows, mapping: Mapping, tokenizer, system_prompt: str | None):
    name = rows.files.name

    def build(index: int) -> PromptItem:
        row = rows.row(index)
        prompt_id = (str(row[mapping.id]) if mapping.id else f"{name}-{rows.start + index}")
        text, messages = prompt_of(row, mapping, system_prompt, rows.where(index))
        return PromptItem(prompt_id, chat_prompt_ids(tokenizer, messages),
                          reference_of(row, mapping), row=row, text=text)

    return build


def prompt_of(row: dict, mapping: Mapping, system_prompt: str | None,
              where: str) -> tuple[str, list[dict[str, str]]]:
    """(the prompt's text, its chat turns) for `row`."""
    if mapping.messages:
        turns = [{"role": t["role"], "content": t["content"]} for t in row[mapping.messages]]
        if system_prompt and not any(t["role"] == "system" for t in turns):
            turns.insert(0, {"role": "system", "content": system_prompt})
        text = next((t["content"] for t in reversed(turns) if t["role"] == "user"), "")
        return text, turns
    if mapping.template:
        values = {k: _as_text(v) for k, v in row.items()}
        text = mapping.template.format(**values)
    else:
        text = _as_text(row[mapping.prompt or "prompt"])
    if not text.strip():
        raise DatasetError(where, "the prompt is empty", "give the row a prompt, or remove it")
    return text, chat_messages(text, system_prompt)


def reference_of(row: dict, mapping: Mapping) -> Any:
    """What the job's math or code reward checks a response to `row` against (None when it
    reads neither)."""
    if mapping.read_answer:
        return mapping.read_answer(row)
    if mapping.answer:
        return _as_text(row[mapping.answer])
    if mapping.read_tests:
        return mapping.read_tests(row)
    if mapping.tests:
        return read_tests_value(row[mapping.tests])
    return None


def _as_text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(_as_text(v) for v in value)
    return str(value)
