"""The assert-style test harness, run inside the sandbox as `python -I -c <this file's text>`
with the program in ./main.py. Standard library only (it runs under the sandbox's python).

stdin carries {"nonce": ..., "tests": ...} as JSON. The harness reads it whole, then points
stdin at /dev/null, so neither the tests nor the nonce are in any file, argument, environment
variable or open descriptor the program can reach. It runs the program, then the tests in the
program's namespace: each top-level `def test*` in the test code is one test, or the test code as a
whole is one test if it defines none. Only after the last test has run does it write

    <nonce> <passed> <total> <status>

to stdout, where status is ok, wrong_answer (an assertion failed), runtime_error, memory or
syntax_error. A program that exits early (os._exit, sys.exit, a signal) never gets that line
written, and cannot write it itself without the nonce: the run then scores 0.

The limit of this design: the tests run in the program's interpreter, so a program written to
search the harness's own memory (frames, the garbage collector) could find the nonce. Faking
success that way takes deliberate introspection of this harness, not an early exit.
"""

import ast
import builtins
import json
import os
import sys
import traceback


def _report(nonce, passed, total, status):
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - the program may have broken sys.stdout
        pass
    os.write(1, ("\n%s %d %d %s\n" % (nonce, passed, total, status)).encode())


def _status_of(exc):
    if isinstance(exc, AssertionError):
        return "wrong_answer"
    if isinstance(exc, MemoryError):
        return "memory"
    return "runtime_error"


def _show(exc):
    traceback.print_exception(type(exc), exc, exc.__traceback__, limit=8, file=sys.stderr)


def _main():
    payload = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    nonce = payload.pop("nonce")
    test_source = payload.pop("tests")
    tests = compile(test_source, "tests.py", "exec")
    # The tests' own top-level `def test*` names, from their text: a program that defines
    # functions of the same names cannot make them disappear from the count.
    names = [node.name for node in ast.parse(test_source).body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test")]
    total = max(1, len(names))
    with open("main.py", encoding="utf-8") as handle:
        source = handle.read()
    try:
        program = compile(source, "main.py", "exec")
    except (SyntaxError, ValueError) as exc:
        _show(exc)
        return _report(nonce, 0, total, "syntax_error")
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(program, namespace)
    except BaseException as exc:  # noqa: BLE001 - includes SystemExit: the tests never ran
        _show(exc)
        return _report(nonce, 0, total, _status_of(exc))
    try:
        exec(tests, namespace)
    except BaseException as exc:  # noqa: BLE001
        _show(exc)
        return _report(nonce, 0, total, _status_of(exc))
    cases = [namespace.get(name) for name in names]
    if not cases:
        return _report(nonce, 1, 1, "ok")
    passed, status = 0, "ok"
    for case in cases:
        try:
            case()
            passed += 1
        except BaseException as exc:  # noqa: BLE001
            _show(exc)
            if status == "ok":
                status = _status_of(exc)
    return _report(nonce, passed, len(cases), status)


_main()
