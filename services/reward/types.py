"""What the reward service scores and what it answers, as Python (the protobuf messages of
asyncrl/v1/reward.proto, with `from_pb` / `to_pb`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

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
    code run once after the program. `timeout_seconds` 0 means the job's limit."""

    io_cases: tuple[IoCase, ...] = ()
    test_code: str = ""
    language: str = "python"
    timeout_seconds: float = 0.0


@dataclass(frozen=True)
class ScoreTask:
    task_id: str
    response: str
    reference: MathReference | CodeReference

    @classmethod
    def for_group(cls, reference: MathReference | CodeReference, responses: Sequence[str],
                  group_id: str = "") -> list[ScoreTask]:
        """The n responses to one prompt, all against the same reference: `<group>#<i>`."""
        return [cls(f"{group_id}#{i}", response, reference) for i, response in enumerate(responses)]

    @property
    def kind(self) -> str:
        return "math" if isinstance(self.reference, MathReference) else "code"

    def to_pb(self) -> reward_pb2.ScoreTask:
        task = reward_pb2.ScoreTask(task_id=self.task_id, response=self.response)
        ref = self.reference
        if isinstance(ref, MathReference):
            task.math.answer = ref.answer
        else:
            task.code.CopyFrom(reward_pb2.CodeReference(
                language=ref.language, test_code=ref.test_code,
                timeout_seconds=ref.timeout_seconds,
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
                timeout_seconds=code.timeout_seconds,
            )
        else:
            raise ValueError(f"task {message.task_id!r} has no reference (set math or code)")
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

    @classmethod
    def failed(cls, task_id: str, failure: Failure, detail: str = "", *, passed: int = 0,
               total: int = 1, wall_seconds: float = 0.0) -> ScoreResult:
        return cls(task_id, 0.0, passed, total, wall_seconds, failure, detail)

    def to_pb(self) -> reward_pb2.ScoreResult:
        return reward_pb2.ScoreResult(
            task_id=self.task_id, score=self.score, passed=self.passed, total=self.total,
            wall_seconds=self.wall_seconds, failure=self.failure.value, detail=self.detail,
        )

    @classmethod
    def from_pb(cls, message: reward_pb2.ScoreResult) -> ScoreResult:
        return cls(message.task_id, message.score, message.passed, message.total,
                   message.wall_seconds, Failure(message.failure), message.detail)
