"""A math verification worker process: JSON lines in on stdin, JSON lines out on stdout.

`python -I -m asyncrl.scoring.math_worker` answers each request {"answer", "reference",
"timeout"} with {"equal": bool} or {"error": "..."}. The parent kills and replaces a worker
that does not answer in time (sympy can spend minutes in C code, beyond any signal), so a
pathological answer costs one worker, never the service.

Only LaTeX parsing (latex2sympy) is used: math-verify's plain-expression parser goes through
sympy's `parse_expr`, which evaluates Python, and answers are untrusted model output.
"""

from __future__ import annotations

import resource

from asyncrl.scoring.worker_protocol import Channel

# A runaway sympy computation fails with MemoryError here instead of taking the machine.
ADDRESS_SPACE_BYTES = 4 << 30


def verify_answer(answer: str, reference: str, timeout: float) -> dict:
    """Whether `answer` is mathematically equivalent to `reference` (both LaTeX or plain text
    as found in a response), by math-verify: {"equal": bool}, or {"failure": reason,
    "detail": ...} with reason timeout, verifier_error (the reference or the comparison
    failed) or wrong_answer (the answer does not parse)."""
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    seconds = max(1, int(round(timeout)))  # math-verify's own (signal.alarm) limits: whole seconds
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    stage = "the reference"
    try:
        gold = parse(_boxed(reference), config, parsing_timeout=seconds, raise_on_error=True)
        if not gold:
            return _failure("verifier_error", f"the reference {reference!r} does not parse")
        stage = "the answer"
        try:
            target = parse(_boxed(answer), config, parsing_timeout=seconds, raise_on_error=True)
        except Exception as exc:  # noqa: BLE001 - an unparseable answer is a wrong answer
            return _failure("wrong_answer", f"the answer does not parse: {_describe(exc)}")
        if not target:
            return _failure("wrong_answer", "the answer does not parse")
        stage = "the comparison"
        return {"equal": bool(verify(gold, target, timeout_seconds=seconds, raise_on_error=True))}
    except TimeoutException:
        return _failure("timeout", f"{stage} took longer than {seconds}s")
    except Exception as exc:  # noqa: BLE001 - every failure is an answer, never a crash
        return _failure("verifier_error", f"{stage} failed: {_describe(exc)}")


def _failure(reason: str, detail: str) -> dict:
    return {"failure": reason, "detail": detail[:500]}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _boxed(text: str) -> str:
    return text if "\\boxed" in text else f"\\boxed{{{text}}}"


def main() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY or hard > ADDRESS_SPACE_BYTES:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    channel = Channel()  # anything a library prints goes to stderr
    import math_verify  # noqa: F401 - pay the sympy import before the first request

    channel.serve(_answer)


def _answer(request: dict) -> dict:
    try:
        return verify_answer(request["answer"], request["reference"], request["timeout"])
    except MemoryError:
        return _failure("verifier_error", "the verifier ran out of memory")


if __name__ == "__main__":
    main()
