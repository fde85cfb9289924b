"""What the reward service scores and what it answers, as Python (the protobuf messages of
asyncrl/v1/reward.proto, with `from_pb` / `to_pb`)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from asyncrl.v1 import reward_pb2


class Failure(enum.Enum):
    """Why a response did not score 1 (NONE: it passed)."""

    NONE = reward_pb2.FAILURE_UNSPECIFIED
    WRONG_ANSWER = reward_pb2.FAILURE_WRONG_ANSWER
    NO_ANSWER = reward_pb2.FAILURE_NO_ANSWER
    RUNTIME_ERROR = reward_pb2.FAILURE_RUNTIME_ERROR
    SYNTAX_ERROR = reward_pb2.FAILURE_SYNTAX_ERROR
    TIMEOUT = reward_pb2.FAILURE_TIMEOUT
    MEMORY = reward_pb2.FAILURE_MEMORY
    KILLED = reward_pb2.FAILURE_KILLED
    VERIFIER_ERROR = reward_pb2.FAILURE_VERIFIER_ERROR
    OUTPUT_LIMIT = reward_pb2.FAILURE_OUTPUT_LIMIT
    EXCEPTION = reward_pb2.FAILURE_EXCEPTION
    INVALID_SCORE = reward_pb2.FAILURE_INVALID_SCORE
    HTTP_ERROR = reward_pb2.FAILURE_HTTP_ERROR

    @property
    def label(self) -> str:
        """The metric label: lower-case name ("wrong_answer", "timeout", ...)."""
        return self.name.lower()


@dataclass(frozen=True)
class MathReference:
    answer: str


@dataclass(frozen=True)
class IoCase:
    stdin: str
    expected_stdout: str


@dataclass(frozen=True)
class CodeReference:
    """Unit tests for a program: stdin/stdout cases (one process each) and assert-style test
    code run once after the program. `timeout_seconds` 0 means the job's limit. `prelude` is
    put before the program (a HumanEval prompt's imports and helpers)."""

    io_cases: tuple[IoCase, ...] = ()
    test_code: str = ""
    language: str = "python"
    timeout_seconds: float = 0.0
    prelude: str = ""


@dataclass(frozen=True)
class RowReference:
    """What a python or http reward reads: the prompt's text and the dataset row, kept as the
    JSON text it travels as, so a row reads the same in-process and through the service."""

    prompt: str
    row_json: str = "{}"

    @classmethod
    def of(cls, prompt: str, row: Mapping[str, Any]) -> RowReference:
        """From a row of any values: numpy scalars and arrays become numbers and lists, other
        values JSON cannot hold their str()."""
        return cls(prompt, json.dumps(dict(row), default=_jsonable, ensure_ascii=False))

    @property
    def row(self) -> dict[str, Any]:
        return json.loads(self.row_json)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars, as datasets' formats give them
        return value.tolist()
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", errors="replace")
    return str(value)


Reference = MathReference | CodeReference | RowReference
# The reward kind that scores each reference type; a row goes to the job's python or http.
_KIND_OF = {MathReference: "math", CodeReference: "code", RowReference: "row"}


@dataclass(frozen=True)
class ScoreTask:
    task_id: str
    response: str
    reference: Reference

    @classmethod
    def for_group(cls, reference: Reference, responses: Sequence[str],
                  group_id: str = "") -> list[ScoreTask]:
        """The n responses to one prompt, all against the same reference: `<group>#<i>`."""
        return [cls(f"{group_id}#{i}", response, reference) for i, response in enumerate(responses)]

    @property
    def kind(self) -> str:
        """math, code, or row (scored by the job's python or http reward)."""
        return _KIND_OF[type(self.reference)]

    def to_pb(self) -> reward_pb2.ScoreTask:
        task = reward_pb2.ScoreTask(task_id=self.task_id, response=self.response)
        ref = self.reference
        if isinstance(ref, MathReference):
            task.math.answer = ref.answer
        elif isinstance(ref, RowReference):
            task.row.prompt = ref.prompt
            task.row.row_json = ref.row_json
        else:
            task.code.CopyFrom(reward_pb2.CodeReference(
                language=ref.language, test_code=ref.test_code,
                timeout_seconds=ref.timeout_seconds, prelude=ref.prelude,
                io_cases=[reward_pb2.IoCase(stdin=c.stdin, expected_stdout=c.expected_stdout)
                          for c in ref.io_cases],
            ))
        return task

    @classmethod
    def from_pb(cls, message: reward_pb2.ScoreTask) -> ScoreTask:
        which = message.WhichOneof("reference")
        if which == "math":
            reference = MathReference(message.math.answer)
        elif which == "code":
            code = message.code
            reference = CodeReference(
                io_cases=tuple(IoCase(c.stdin, c.expected_stdout) for c in code.io_cases),
                test_code=code.test_code, language=code.language or "python",
                timeout_seconds=code.timeout_seconds, prelude=code.prelude,
            )
        elif which == "row":
            reference = RowReference(message.row.prompt, message.row.row_json or "{}")
            try:
                row = reference.row
            except ValueError as exc:
                raise ValueError(f"task {message.task_id!r}: row_json is not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ValueError(f"task {message.task_id!r}: row_json is not a JSON object")
        else:
            raise ValueError(f"task {message.task_id!r} has no reference (set math, code or row)")
        return cls(message.task_id, message.response, reference)


@dataclass(frozen=True)
class ScoreResult:
    task_id: str
    score: float
    passed: int = 0
    total: int = 1
    wall_seconds: float = 0.0
    failure: Failure = Failure.NONE
    detail: str = field(default="", compare=False)
    # Numbers a python reward returned beside its score, by name (logged as metrics).
    extras: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def failed(cls, task_id: str, failure: Failure, detail: str = "", *, passed: int = 0,
               total: int = 1, wall_seconds: float = 0.0) -> ScoreResult:
        return cls(task_id, 0.0, passed, total, wall_seconds, failure, detail)

    def to_pb(self) -> reward_pb2.ScoreResult:
        return reward_pb2.ScoreResult(
            task_id=self.task_id, score=self.score, passed=self.passed, total=self.total,
            wall_seconds=self.wall_seconds, failure=self.failure.value, detail=self.detail,
            extras=self.extras,
        )

    @classmethod
    def from_pb(cls, message: reward_pb2.ScoreResult) -> ScoreResult:
        return cls(message.task_id, message.score, message.passed, message.total,
                   message.wall_seconds, Failure(message.failure), message.detail,
                   dict(message.extras))
