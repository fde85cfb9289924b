"""Code rewards: extract the program from a response and run the task's unit tests against it
in the sandbox: stdin/stdout cases (one run each) and assert-style test code (one run through
the harness). The score is 1 only if every test passes; the first failing case ends the
scoring (its reason is the task's failure), so a wrong program costs one run, not all.

Python first; a language is a `Language` entry (file name, how to run, how to test), so
adding one is adding an entry (with a harness for its assert-style tests).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.scoring.extract import extract_program
from asyncrl.scoring.sandbox import RunResult, Sandbox
from asyncrl.scoring.types import CodeReference, Failure, IoCase, ScoreResult

log = logging.getLogger(__name__)

_HARNESS = Path(__file__).with_name("harness.py").read_text(encoding="utf-8")
_SYNTAX = re.compile(rb"^(SyntaxError|IndentationError|TabError)\b", re.MULTILINE)
_HARNESS_STATUS = {
    "ok": Failure.NONE, "wrong_answer": Failure.WRONG_ANSWER, "memory": Failure.MEMORY,
    "runtime_error": Failure.RUNTIME_ERROR, "syntax_error": Failure.SYNTAX_ERROR,
}


@dataclass(frozen=True)
class Language:
    name: str
    source_file: str

    def run_argv(self, interpreter: str) -> list[str]:
        """Runs the program on one stdin/stdout case."""
        return [interpreter, "-I", self.source_file]

    def test_argv(self, interpreter: str) -> list[str]:
        """Runs the assert-style harness, which loads the program itself."""
        return [interpreter, "-I", "-c", _HARNESS]


LANGUAGES = {"python": Language("python", "main.py")}


class CodeScorer:
    """Scores one code response with the sandbox; `extract` is the fenced-block rule
    (last_block, first_block or longest_block)."""

    def __init__(self, sandbox: Sandbox, extract: str = "last_block"):
        self.sandbox = sandbox
        self._extract = extract

    async def score(self, task_id: str, response: str, reference: CodeReference) -> ScoreResult:
        start = time.perf_counter()
        cases = len(reference.io_cases) + (1 if reference.test_code else 0)

        def failed(failure: Failure, detail: str, passed: int = 0, total: int = cases):
            return ScoreResult.failed(task_id, failure, detail, passed=passed, total=max(total, 1),
                                      wall_seconds=time.perf_counter() - start)

        language = LANGUAGES.get(reference.language or "python")
        if language is None:
            return failed(Failure.VERIFIER_ERROR, f"language {reference.language!r} is not "
                          f"supported (supported: {', '.join(LANGUAGES)})")
        if cases == 0:
            return failed(Failure.VERIFIER_ERROR, "the task has no tests")
        program = extract_program(response, self._extract, language.name)
        if program is None:
            return failed(Failure.NO_ANSWER, "no fenced code block in the response")
        if reference.prelude:
            program = f"{reference.prelude.rstrip()}\n\n{program}"
        files = {language.source_file: program.encode()}
        timeout = reference.timeout_seconds or self.sandbox.limits.timeout_seconds
        await self.sandbox.start()
        interpreter = self.sandbox.python

        passed = 0
        for index, case in enumerate(reference.io_cases):
            run = await self.sandbox.run(files, language.run_argv(interpreter),
                                         case.stdin.encode(), timeout=timeout)
            verdict = run_failure(run, timeout) or _compare(run, case)
            if verdict:
                return failed(verdict[0], f"case {index}: {verdict[1]}", passed)
            passed += 1
        total = passed
        if reference.test_code:
            nonce = secrets.token_hex(16)
            payload = json.dumps({"nonce": nonce, "tests": reference.test_code}).encode()
            run = await self.sandbox.run(files, language.test_argv(interpreter), payload,
                                         timeout=timeout)
            ran, count, verdict = _test_verdict(run, nonce, timeout)
            passed, total = passed + ran, total + count
            if verdict:
                return failed(verdict[0], f"tests: {verdict[1]}", passed, total)
        return ScoreResult(task_id, 1.0, passed, total, time.perf_counter() - start)


def run_failure(run: RunResult, timeout: float) -> tuple[Failure, str] | None:
    """Why a run failed, judged from how it ended (None: it exited 0 in time)."""
    if run.setup_error:
        log.warning("sandbox setup failed: %s", run.setup_error)
        return Failure.KILLED, run.setup_error
    if run.timed_out:
        return Failure.TIMEOUT, f"still running after the {timeout:g}s wall-clock limit"
    if run.output_exceeded:
        return Failure.OUTPUT_LIMIT, "printed more than the sandbox keeps"
    if run.exit_code is None:
        return Failure.KILLED, "the sandbox was killed"
    if run.signal == signal.SIGXCPU:
        return Failure.TIMEOUT, f"used up its {timeout:g}s of CPU time"
    if b"MemoryError" in run.stderr:
        return Failure.MEMORY, "ran out of memory (address-space limit)"
    if _SYNTAX.search(run.stderr):
        return Failure.SYNTAX_ERROR, _last_line(run.stderr)
    if run.signal is not None:
        return Failure.KILLED, f"killed by {signal.Signals(run.signal).name}" \
            if run.signal in signal.valid_signals() else f"killed by signal {run.signal}"
    if run.exit_code != 0:
        return Failure.RUNTIME_ERROR, _last_line(run.stderr) or f"exit status {run.exit_code}"
    return None


def _compare(run: RunResult, case: IoCase) -> tuple[Failure, str] | None:
    actual = run.stdout.decode("utf-8", errors="replace")
    if _lines(actual) == _lines(case.expected_stdout):
        return None
    return Failure.WRONG_ANSWER, f"expected {_clip(case.expected_stdout)}, got {_clip(actual)}"


def _test_verdict(run: RunResult, nonce: str, timeout: float):
    """(passed, total, failure or None) of a harness run. Only a line carrying the nonce
    counts as the harness's report: without it the tests did not all run."""
    report = _harness_report(run.stdout, nonce)
    if report is None or run.timed_out or run.output_exceeded:
        verdict = run_failure(run, timeout) or (
            Failure.RUNTIME_ERROR, "the tests did not run to the end (the program exited early)")
        return 0, report[1] if report else 1, verdict
    passed, total, status = report
    failure = _HARNESS_STATUS.get(status, Failure.RUNTIME_ERROR)
    if failure is Failure.NONE and passed == total:
        return passed, total, None
    if failure is Failure.NONE:
        failure = Failure.WRONG_ANSWER
    return passed, total, (failure, f"{passed}/{total} passed; {_last_line(run.stderr)}")


def _harness_report(stdout: bytes, nonce: str) -> tuple[int, int, str] | None:
    at = stdout.rfind(nonce.encode())
    if at < 0:
        return None
    fields = stdout[at:].split(b"\n", 1)[0].split()
    try:
        return int(fields[1]), int(fields[2]), fields[3].decode()
    except (IndexError, ValueError):
        return None


def _lines(text: str) -> list[str]:
    """Output as compared: line by line, trailing spaces and trailing blank lines ignored."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _last_line(data: bytes) -> str:
    lines = data.decode("utf-8", errors="replace").strip().splitlines()
    return lines[-1][:300] if lines else ""


def _clip(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
