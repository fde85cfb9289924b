"""Reading a job's dataset files (dataset.kind: file) with Hugging Face `datasets`.

A path is a .jsonl, .json, .parquet or .csv file (optionally .gz, .bz2, .xz or .zst
compressed), a glob or a folder of such files, or a folder written by `Dataset.save_to_disk`;
`pkg://<package>/<file>` names a file shipped inside an installed Python package. The rows come
back as a memory-mapped Arrow dataset: a million-row file is converted once (cached by
`datasets`) and then paged in as rows are read, not held in each process' memory.

Local files only: nothing is downloaded at run time. Whatever is wrong with a file is a
`DatasetError` naming the file, the row (its line in a JSONL file) and the field.
"""

from __future__ import annotations

import glob
import importlib.resources
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Builders of `datasets` by file extension (before any compression suffix).
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
PACKAGE_SCHEME = "pkg://"
#: owner/name with no file extension: what a Hugging Face hub dataset id looks like.
_HUB_ID = re.compile(r"^(hf://(datasets/)?)?[A-Za-z0-9][\w.-]*/[\w.-]+$")


class DatasetError(ValueError):
    """A dataset that cannot be used, said as `<where>: <problem>; fix: <fix>`."""

    def __init__(self, where: str, problem: str, fix: str):
        super().__init__(f"{where}: {problem}; fix: {fix}")
        self.where, self.problem, self.fix = where, problem, fix


@dataclass(frozen=True)
class DataFiles:
    """What a dataset path names: files read by one builder, or a save_to_disk folder."""

    spec_path: str  # as written in the job
    files: tuple[Path, ...] = ()
    builder: str = ""
    saved: Path | None = None

    @property
    def name(self) -> str:
        """A short name for prompt ids: the file's stem, or the folder's name."""
        if self.saved is not None:
            return self.saved.name
        if len(self.files) == 1:
            return _stem(self.files[0])
        return self.files[0].parent.name

    @property
    def is_jsonl(self) -> bool:
        return all(_extension(f) == ".jsonl" for f in self.files)


def locate(path: str, field: str = "dataset.path") -> DataFiles:
    """The files `path` names; DatasetError when there are none, or they cannot be read."""
    if path.startswith(PACKAGE_SCHEME):
        return _one_file(path, _package_file(path, field), field)
    if _HUB_ID.match(path) and not Path(path).exists() and not _extension(Path(path)):
        repo = re.sub(r"^hf://(datasets/)?", "", path)
        raise DatasetError(
            f"{field} {path!r}",
            "no such file or folder here, and it looks like a Hugging Face hub dataset id; "
            "asyncrl reads local files only (nothing is downloaded at run time)",
            f"download it first, e.g. `huggingface-cli download {repo} --repo-type dataset "
            f"--local-dir data/{repo.split('/')[-1]}`, and set {field} to the file (or folder) "
            "it wrote",
        )
    if any(char in path for char in "*?["):
        matches = sorted(Path(p) for p in glob.glob(path, recursive=True) if Path(p).is_file())
        if not matches:
            raise DatasetError(f"{field} {path!r}", "the glob matches no file",
                               "check the pattern; relative paths start at the current folder")
        return _many_files(path, matches, field)
    found = Path(path)
    if found.is_dir():
        if (found / "dataset_info.json").exists() and (found / "state.json").exists():
            return DataFiles(path, saved=found)
        files = sorted(f for f in found.rglob("*") if f.is_file() and _extension(f) in BUILDERS)
        if not files:
            raise DatasetError(
                f"{field} {path!r}", "the folder holds no .jsonl, .json, .parquet or .csv file "
                "and was not written by save_to_disk", "point it at the data files")
        return _many_files(path, files, field)
    if not found.exists():
        raise DatasetError(f"{field} {path!r}", "no such file or folder",
                           "check the path; relative paths start at the current folder")
    return _one_file(path, found, field)


def load_rows(files: DataFiles):
    """The rows of `files` as one memory-mapped `datasets.Dataset`."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if files.saved is not None:
        loaded = datasets.load_from_disk(str(files.saved))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DatasetError(
                    str(files.saved), f"a DatasetDict of splits {sorted(loaded)} and no 'train'",
                    "point the path at one split's folder")
            loaded = loaded["train"]
        return loaded
    try:
        return datasets.load_dataset(files.builder, data_files=[str(f) for f in files.files],
                                     split="train")
    except Exception as exc:  # noqa: BLE001 - datasets wraps a bad file in several types
        raise _file_error(files, exc) from None


def json_line(files: DataFiles, row: int) -> tuple[Path, int] | None:
    """(file, line counting from 1) of row `row` (counting from 0) of a JSONL dataset; None
    for other formats. Blank lines hold no row, as the reader skips them."""
    if not files.is_jsonl:
        return None
    remaining = row
    for path in files.files:
        with _open_text(path) as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                if remaining == 0:
                    return path, number
                remaining -= 1
    return None


def row_where(files: DataFiles, row: int) -> str:
    """How an error names row `row` (counting from 0): `train.jsonl row 1833`, counting from 1
    as people do; in a JSONL file, the row's line (blank lines count as an editor counts
    them)."""
    found = json_line(files, row)
    if found is not None:
        return f"{found[0]} row {found[1]}"
    source = files.saved or (files.files[0] if len(files.files) == 1 else files.spec_path)
    return f"{source} row {row + 1}"


# --------------------------------------------------------------------------- helpers


def _extension(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes and suffixes[-1] in BUILDERS else ""


def _stem(path: Path) -> str:
    name = path.name
    while Path(name).suffix.lower() in (*COMPRESSIONS, *BUILDERS):
        name = Path(name).stem
    return name


def _one_file(spec_path: str, path: Path, field: str) -> DataFiles:
    extension = _extension(path)
    if not extension:
        raise DatasetError(
            f"{field} {spec_path!r}", f"cannot tell the format of {path.name}",
            "use a .jsonl, .json, .parquet or .csv file (optionally .gz, .bz2, .xz or .zst)")
    return DataFiles(spec_path, (path,), BUILDERS[extension])


def _many_files(spec_path: str, files: list[Path], field: str) -> DataFiles:
    builders = {BUILDERS.get(_extension(f)) for f in files}
    if None in builders:
        odd = next(f for f in files if not _extension(f))
        raise DatasetError(f"{field} {spec_path!r}", f"cannot tell the format of {odd}",
                           "match only .jsonl, .json, .parquet or .csv files")
    if len(builders) > 1:
        raise DatasetError(f"{field} {spec_path!r}",
                           f"matches files of several formats ({', '.join(sorted(builders))})",
                           "keep one format per dataset path")
    return DataFiles(spec_path, tuple(files), builders.pop())


def _package_file(path: str, field: str) -> Path:
    package, _, inner = path[len(PACKAGE_SCHEME):].partition("/")
    try:
        found = Path(str(importlib.resources.files(package).joinpath(inner)))
    except ModuleNotFoundError:
        raise DatasetError(f"{field} {path!r}", f"no installed Python package {package!r}",
                           f"install it (pip install {package.replace('_', '-')}), or give a "
                           "file path") from None
    if not found.is_file():
        raise DatasetError(f"{field} {path!r}", f"package {package} has no file {inner}",
                           "check the file's path inside the package")
    return found


def _open_text(path: Path):
    """A text reader of `path`, decompressed by its suffix."""
    suffix = path.suffix.lower()
    if suffix == ".gz":
        import gzip
        return gzip.open(path, "rt", encoding="utf-8")
    if suffix == ".bz2":
        import bz2
        return bz2.open(path, "rt", encoding="utf-8")
    if suffix == ".xz":
        import lzma
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _file_error(files: DataFiles, exc: Exception) -> DatasetError:
    """The DatasetError for a file `datasets` could not read: for JSON lines, the first line
    that is not a JSON object; else `datasets`' own innermost message."""
    if files.is_jsonl:
        for path in files.files:
            with _open_text(path) as lines:
                for number, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        value = json.loads(line)
                    except json.JSONDecodeError as bad:
                        return DatasetError(f"{path} row {number}", f"not valid JSON ({bad.msg} "
                                            f"at column {bad.colno})",
                                            "write one JSON object per line")
                    if not isinstance(value, dict):
                        return DatasetError(f"{path} row {number}",
                                            f"a JSON {type(value).__name__}, not an object",
                                            "write one JSON object per line")
    cause = exc
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    where = files.spec_path if len(files.files) != 1 else str(files.files[0])
    return DatasetError(where, f"cannot be read as {files.builder}: "
                        f"{type(cause).__name__}: {cause}".strip(),
                        "check that every row has the same fields with the same types")
