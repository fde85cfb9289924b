"""The code sandbox with real processes: correct and incorrect programs, and hostile programs
that must each score 0 while the sandbox stays healthy for the next run. (How fast it runs is
measured in bench/; the limits here only catch hangs.)"""

import ast
import asyncio
import dataclasses
import os
import secrets
import socket
import tempfile
from pathlib import Path

import pytest

import asyncrl.scoring
from asyncrl.scoring.code_reward import CodeScorer
from asyncrl.scoring.extract import extract_program
from asyncrl.scoring.sandbox import (
    DEFAULT_UID_BASE,
    Isolation,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    _processes_of,
)
from asyncrl.scoring.types import CodeReference, Failure, IoCase

# Only the tests that expect a timeout ask for a short one (`timed`); every other run gets a
# limit long enough that a busy machine never turns another failure into a timeout.
TIMEOUT = 1.5
LIMITS = SandboxLimits(timeout_seconds=30.0, memory_mb=256, max_processes=16,
                       max_file_size_mb=4, max_output_bytes=256 << 10)
WORKERS = 2

ADD_IO = CodeReference(io_cases=(IoCase("3 4\n", "7\n"), IoCase("10 -2\n", "8")))
ADD_TESTS = CodeReference(test_code=(
    "def test_small():\n    assert add(1, 2) == 3\n\n"
    "def test_negative():\n    assert add(-1, -2) == -3\n\n"
    "def test_large():\n    assert add(10**12, 1) == 10**12 + 1\n"
))
ADD_SOURCE = "def add(a, b):\n    return a + b\n"


def timed(reference: CodeReference = ADD_IO) -> CodeReference:
    """`reference` with the short timeout, for the programs that must time out."""
    return dataclasses.replace(reference, timeout_seconds=TIMEOUT)


def fenced(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}\n```\nDone."


@pytest.fixture(scope="module")
def sandbox(loop):
    sandbox = Sandbox(LIMITS, workers=WORKERS)
    loop.run(sandbox.start())
    assert sandbox.unavailable is None, sandbox.unavailable
    yield sandbox
    loop.run(sandbox.close())


@pytest.fixture(scope="module")
def scorer(sandbox):
    return CodeScorer(sandbox)


def score(loop, scorer, program, reference=ADD_IO):
    return loop.run(scorer.score("t", fenced(program), reference))


def run(loop, sandbox, program, stdin=b"", timeout=None):
    return loop.run(sandbox.run({"main.py": program.encode()}, [sandbox.python, "-I", "main.py"],
                                stdin, timeout=timeout))


def sandbox_processes() -> list[int]:
    """Live processes of the slots' uids (a killed orphan may linger as a zombie until the
    machine's init reaps it; it runs nothing)."""
    return [pid for slot in range(WORKERS) for pid in _processes_of(DEFAULT_UID_BASE + slot)]


@pytest.fixture
def still_healthy(loop, scorer):
    """After the test: a correct program scores 1 (the loop's limit catches a sandbox that
    hangs), and nothing of the sandbox runs."""
    yield
    result = score(loop, scorer, "a, b = map(int, input().split())\nprint(a + b)")
    assert (result.score, result.failure) == (1.0, Failure.NONE), result
    assert sandbox_processes() == []


# ---------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, rule, expected", [
    ("```python\nprint(1)\n```", "last_block", "print(1)\n"),
    ("```\nA\n```\ntext\n```py\nB\n```\n```bash\nC\n```", "last_block", "B\n"),
    ("```python\nA = 1\n```\n```python\nB = 22\n```", "first_block", "A = 1\n"),
    ("```python\nA = 1\n```\n```python\nB = 22\n```", "longest_block", "B = 22\n"),
    ("```\nuntagged\n```", "last_block", "untagged\n"),
    ("~~~python\ntilde\n~~~", "last_block", "tilde\n"),
    ("```bash\necho hi\n```", "last_block", "echo hi\n"),
    ("no code at all", "last_block", None),
    ("```python\nnot closed", "last_block", None),
])
def test_extract_program(text, rule, expected):
    assert extract_program(text, rule) == expected


def test_the_sandbox_isolates_with_namespaces_as_root(sandbox):
    if os.geteuid() != 0:
        pytest.skip("the machine's tests run as root; as a user the sandbox uses userns")
    assert sandbox.isolation is Isolation.NAMESPACES
    assert sandbox.health() == (True, "code sandbox: namespaces isolation")


def test_each_slot_runs_as_its_own_uid_with_no_new_privileges(loop):
    """Two runs at once, in the default (namespaces) mode, each read their identity from
    inside: uid and gid are their slot's (`uid_base + slot`), no supplementary groups, no
    capabilities, and no_new_privs set, so nothing they exec can gain privileges."""
    if os.geteuid() != 0:
        pytest.skip("the machine's tests run as root; as a user the sandbox uses userns")
    uid_base = DEFAULT_UID_BASE + 100
    sandbox = Sandbox(LIMITS, workers=2, uid_base=uid_base)
    # Each run sleeps a second so that the two overlap and hold both slots; were they not to
    # overlap, a fresh pool still hands out slot 0 and then slot 1.
    program = ("import os, time\nstatus = dict(line.split(':', 1) for line in "
               "open('/proc/self/status').read().splitlines())\n"
               "print({k: status[k].split() for k in "
               "('Uid', 'Gid', 'Groups', 'NoNewPrivs', 'CapEff', 'CapPrm')})\n"
               "time.sleep(1)\n")

    async def both():
        await sandbox.start()
        return await asyncio.gather(*(
            sandbox.run({"main.py": program.encode()}, [sandbox.python, "-I", "main.py"],
                        timeout=30) for _ in range(2)))

    try:
        reports = loop.run(both())
        assert sandbox.isolation is Isolation.NAMESPACES
        # Each run's processes were gone before it gave its slot back (not by close()).
        assert _processes_of(uid_base) == [] and _processes_of(uid_base + 1) == []
    finally:
        loop.run(sandbox.close())
    seen = []
    for report in reports:
        assert report.exit_code == 0, report
        status = ast.literal_eval(report.stdout.decode())
        (uid,) = set(status["Uid"])             # real, effective, saved and filesystem uid
        assert set(status["Gid"]) == {uid}
        assert status["Groups"] == []
        assert status["NoNewPrivs"] == ["1"]
        assert int(status["CapEff"][0], 16) == 0 and int(status["CapPrm"][0], 16) == 0
        seen.append(int(uid))
    assert sorted(seen) == [uid_base, uid_base + 1]


# ---------------------------------------------------------------------- correct and incorrect


def test_a_correct_stdin_stdout_program_passes(loop, scorer):
    result = score(loop, scorer, "a, b = map(int, input().split())\nprint(a + b)")
    assert (result.score, result.passed, result.total, result.failure) == (1.0, 2, 2, Failure.NONE)
    assert result.wall_seconds > 0


def test_an_incorrect_stdin_stdout_program_fails(loop, scorer):
    result = score(loop, scorer, "a, b = map(int, input().split())\nprint(a * b if a == 3 else 0)")
    assert (result.score, result.failure) == (0.0, Failure.WRONG_ANSWER)
    assert result.detail.startswith("case 0:") and "'7\\n'" in result.detail


def test_the_first_case_passing_is_counted(loop, scorer):
    result = score(loop, scorer, "a, b = map(int, input().split())\nprint(7)")
    assert (result.score, result.passed, result.total) == (0.0, 1, 2)


def test_a_correct_assert_style_program_passes(loop, scorer):
    result = score(loop, scorer, ADD_SOURCE, ADD_TESTS)
    assert (result.score, result.passed, result.total, result.failure) == (1.0, 3, 3, Failure.NONE)


def test_an_incorrect_assert_style_program_fails(loop, scorer):
    result = score(loop, scorer, "def add(a, b):\n    return abs(a) + abs(b)\n", ADD_TESTS)
    assert (result.score, result.passed, result.total) == (0.0, 2, 3)
    assert result.failure is Failure.WRONG_ANSWER


def test_top_level_asserts_are_one_test(loop, scorer):
    reference = CodeReference(test_code="assert add(2, 2) == 4\nassert add(0, 0) == 0\n")
    assert score(loop, scorer, ADD_SOURCE, reference).score == 1.0
    wrong = score(loop, scorer, "def add(a, b):\n    return 4\n", reference)
    assert (wrong.score, wrong.passed, wrong.total, wrong.failure) == (
        0.0, 0, 1, Failure.WRONG_ANSWER)


def test_io_cases_and_tests_together(loop, scorer):
    reference = CodeReference(io_cases=(IoCase("", "ready\n"),), test_code=ADD_TESTS.test_code)
    program = ADD_SOURCE + "if __name__ == '__main__':\n    print('ready')\n"
    result = score(loop, scorer, program, reference)
    assert (result.score, result.passed, result.total) == (1.0, 4, 4)


@pytest.mark.parametrize("program, reference, failure", [
    ("def add(a, b)\n    return a + b", ADD_TESTS, Failure.SYNTAX_ERROR),
    ("print(", ADD_IO, Failure.SYNTAX_ERROR),
    ("raise ValueError('no')", ADD_IO, Failure.RUNTIME_ERROR),
    ("def add(a, b):\n    return a + c\n", ADD_TESTS, Failure.RUNTIME_ERROR),
])
def test_broken_programs_fail_with_their_reason(loop, scorer, program, reference, failure):
    result = score(loop, scorer, program, reference)
    assert (result.score, result.failure) == (0.0, failure), result.detail


def test_a_response_without_code_has_no_answer(loop, scorer):
    result = loop.run(scorer.score("t", "I would add the numbers.", ADD_IO))
    assert (result.score, result.failure) == (0.0, Failure.NO_ANSWER)


# ---------------------------------------------------------------------- hostile programs


# Without its timeout the sandbox would never answer these: the loop's 60 s limit fails them.


def test_infinite_loop(loop, scorer, still_healthy):
    result = score(loop, scorer, "while True:\n    pass", timed())
    assert (result.score, result.failure) == (0.0, Failure.TIMEOUT)


def test_sleeping_past_the_timeout(loop, scorer, still_healthy):
    result = score(loop, scorer, "import time\ntime.sleep(3600)\nprint(7)", timed())
    assert (result.score, result.failure) == (0.0, Failure.TIMEOUT)


def test_fork_bomb(loop, sandbox, scorer, still_healthy):
    bomb = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass\n")
    result = score(loop, scorer, bomb, timed())
    assert result.score == 0.0 and result.failure in (Failure.TIMEOUT, Failure.KILLED)
    # The process limit held: a bomb that reports how far it got never passes the limit.
    counted = run(loop, sandbox, (
        "import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n"
        "    n += 1\nprint(n)\n"))
    assert counted.exit_code == 0, counted
    assert 0 < int(counted.stdout) < LIMITS.max_processes


def test_memory_bomb(loop, scorer, still_healthy):
    for bomb in ("x = bytearray(8 << 30)", "xs = []\nwhile True:\n    xs.append(' ' * 10**6)"):
        result = score(loop, scorer, bomb)
        assert (result.score, result.failure) == (0.0, Failure.MEMORY), result.detail


def test_huge_output_to_stdout(loop, scorer, still_healthy):
    result = score(loop, scorer, "while True:\n    print('x' * 1000)")
    # OUTPUT_LIMIT, not TIMEOUT: cut off at the cap, before the timeout.
    assert (result.score, result.failure) == (0.0, Failure.OUTPUT_LIMIT)


def test_huge_file(loop, sandbox, scorer, still_healthy):
    writer = ("chunk = b'x' * (1 << 20)\nwritten = 0\ntry:\n    with open('big.bin', 'wb') as f:\n"
              "        for _ in range(64):\n            f.write(chunk)\n            f.flush()\n"
              "            written += len(chunk)\nexcept OSError as exc:\n    print(written, exc)\n"
              "    raise\n")
    result = score(loop, scorer, writer)
    assert (result.score, result.failure) == (0.0, Failure.RUNTIME_ERROR)
    report = run(loop, sandbox, writer)
    written = int(report.stdout.split()[0])
    assert written <= LIMITS.max_file_size_mb << 20 and b"File too large" in report.stdout


def test_no_network_even_to_loopback(loop, sandbox, scorer, still_healthy):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        program = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('connected')\nexcept OSError as exc:\n    print('blocked', exc)\n")
        reference = CodeReference(io_cases=(IoCase("", "connected\n"),))
        assert score(loop, scorer, program, reference).score == 0.0
        report = run(loop, sandbox, program)
        assert report.stdout.startswith(b"blocked"), report
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected


def test_the_services_environment_does_not_leak(loop, sandbox, scorer, still_healthy,
                                                  monkeypatch):
    secret = f"hunter2-{secrets.token_hex(8)}"
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", secret)
    snoop = (
        "import glob, os\nseen = [repr(dict(os.environ))]\n"
        "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n        seen.append(open(path, 'rb').read().decode(errors='replace'))\n"
        "    except OSError:\n        pass\n"
        f"print('\\n'.join(seen))\nprint('LEAK' if {secret!r} in '\\n'.join(seen) else 'clean')\n")
    report = run(loop, sandbox, snoop)
    assert report.exit_code == 0, report
    assert secret.encode() not in report.stdout
    assert report.stdout.strip().endswith(b"clean")
    reference = CodeReference(io_cases=(IoCase("", "LEAK\n"),))
    assert score(loop, scorer, "import os\nprint('LEAK' if 'ASYNCRL_TEST_SECRET' in os.environ "
                               "else 'clean')", reference).score == 0.0


def test_writing_outside_the_scratch_directory(loop, sandbox, scorer, still_healthy):
    open_dir = Path(tempfile.mkdtemp(prefix="asyncrl-open-"))
    open_dir.chmod(0o777)  # only the read-only mount stops a write here, not permissions
    name = f"escape-{secrets.token_hex(4)}"
    targets = [open_dir / name, Path(asyncrl.scoring.__file__).parent / name,
               Path("/tmp") / name, Path("/var/tmp") / name]
    try:
        program = (
            f"import os\ntargets = {[str(t) for t in targets]!r} + [os.path.join('..', {name!r})]\n"
            "for path in targets:\n    try:\n        with open(path, 'w') as f:\n"
            "            f.write('pwned')\n        print('WROTE', path)\n"
            "    except OSError as exc:\n        print('denied', path, exc.errno)\n"
            "with open('inside.txt', 'w') as f:\n    f.write('fine')\n"
            f"with open('/dev/shm/{name}', 'w') as f:\n    f.write('private')\n"
            "print('scratch ok')\n")
        report = run(loop, sandbox, program)
        assert report.exit_code == 0, report
        assert b"WROTE" not in report.stdout and b"scratch ok" in report.stdout
        reference = CodeReference(io_cases=(IoCase("", "WROTE\n"),))
        assert score(loop, scorer, program, reference).score == 0.0
        # The sandbox's /dev/shm is its own: the host's never sees the file.
        assert not any(t.exists() for t in [*targets, Path("/dev/shm") / name])
        assert not any(Path(sandbox._root).glob("*"))  # scratch directories are removed
    finally:
        for target in targets:
            target.unlink(missing_ok=True)
        open_dir.rmdir()


def test_secret_directories_are_hidden(loop):
    if os.geteuid() != 0:
        pytest.skip("checks the root (namespaces) sandbox")
    secret_dir = Path(tempfile.mkdtemp(prefix="asyncrl-secrets-"))
    secret_dir.chmod(0o755)
    token = f"token-{secrets.token_hex(8)}"
    (secret_dir / "token").write_text(token)
    (secret_dir / "token").chmod(0o644)  # world-readable, like a service-account token
    sandbox = Sandbox(LIMITS, workers=1, hidden_paths=[str(secret_dir)])
    try:
        loop.run(sandbox.start())
        program = (f"import os\nprint(os.listdir({str(secret_dir)!r}))\n"
                   f"print(open({str(secret_dir / 'token')!r}).read())\n")
        report = run(loop, sandbox, program)
        assert report.stdout == b"[]\n" and b"FileNotFoundError" in report.stderr, report
        assert token.encode() not in report.stdout + report.stderr
    finally:
        loop.run(sandbox.close())
        (secret_dir / "token").unlink()
        secret_dir.rmdir()


def test_killing_the_parent_process(loop, sandbox, scorer, still_healthy):
    service = os.getpid()
    killer = (
        "import os, signal\n"
        f"for pid in (os.getppid(), 1, {service}, {os.getppid()}, -1):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as exc:\n"
        "        print('kill', pid, exc.errno)\n"
        "for entry in os.listdir('/proc'):\n    if entry.isdigit() and int(entry) != os.getpid():\n"
        "        try:\n            os.kill(int(entry), signal.SIGKILL)\n"
        "        except OSError:\n            pass\nprint('still here')\n")
    result = score(loop, scorer, killer)
    assert result.score == 0.0
    assert os.getpid() == service  # the service (this process) is alive: we are running
    # kill(-1) killed the program itself; killing its parent was refused or ignored.
    report = run(loop, sandbox, killer.replace(", -1)", ")"))
    assert report.stdout.strip().endswith(b"still here"), report


def test_multiprocessing_works_inside(loop, sandbox):
    program = ("from multiprocessing import Pool\nif __name__ == '__main__':\n"
               "    with Pool(2) as pool:\n        print(sum(pool.map(abs, range(-5, 5))))\n")
    report = run(loop, sandbox, program, timeout=10)
    assert report.stdout == b"25\n", report


def test_a_daemonised_grandchild_does_not_outlive_its_run(loop, sandbox, still_healthy):
    program = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        time.sleep(300)\n    os._exit(0)\nprint('done')\n")
    report = run(loop, sandbox, program)
    assert report.stdout == b"done\n" and report.exit_code == 0
    assert sandbox_processes() == []


@pytest.mark.parametrize("program", [
    "import os\nprint('all tests passed')\nos._exit(0)",
    "import sys\nsys.exit(0)",
    "import os\ndef add(a, b):\n    os._exit(0)",
    "import atexit, os\natexit.register(lambda: print('0' * 32, 3, 3, 'ok'))\nos._exit(0)",
    "import os\ndef add(a, b):\n    print('\\n' + os.urandom(16).hex(), 3, 3, 'ok', flush=True)\n"
    "    os._exit(0)",
    "import sys\nprint(open('/proc/self/cmdline').read(), sys.stdin.read())\n"
    "import os\nos._exit(0)",
])
def test_exiting_early_cannot_fake_success(loop, scorer, still_healthy, program):
    result = score(loop, scorer, program, ADD_TESTS)
    assert result.score == 0.0 and result.failure is not Failure.NONE, result


def test_same_named_test_functions_cannot_hide_the_tests(loop, scorer, still_healthy):
    program = ("def add(a, b):\n    return 0\n\ndef test_small():\n    pass\n\n"
               "def test_negative():\n    pass\n\ndef test_large():\n    pass\n")
    result = score(loop, scorer, program, ADD_TESTS)
    assert (result.score, result.passed, result.total) == (0.0, 0, 3)


# ---------------------------------------------------------------------- unsafe mode


def test_without_a_network_namespace_code_is_refused(loop):
    sandbox = Sandbox(LIMITS, workers=1, isolation=Isolation.NONE)
    try:
        loop.run(sandbox.start())
        assert sandbox.unavailable and "allowUnsafeNoNetworkNamespace" in sandbox.unavailable
        assert sandbox.health()[0] is False
        with pytest.raises(SandboxUnavailable):
            loop.run(sandbox.run({"main.py": b"print(1)"}, ["/bin/true"]))
    finally:
        loop.run(sandbox.close())


def test_the_unsafe_mode_must_be_asked_for_and_says_so(loop, caplog):
    sandbox = Sandbox(LIMITS, workers=1, isolation=Isolation.NONE, allow_unsafe=True)
    try:
        with caplog.at_level("CRITICAL"):
            loop.run(sandbox.start())
        assert "UNSAFE" in caplog.text and sandbox.unavailable is None
        report = run(loop, sandbox, "import os\nprint(os.getuid())")
        assert report.exit_code == 0
        if os.geteuid() == 0:
            assert int(report.stdout) == DEFAULT_UID_BASE  # still not root
        slow = run(loop, sandbox, "import time\ntime.sleep(30)", timeout=0.5)
        assert slow.timed_out
        if os.geteuid() == 0:  # without a PID namespace, the slot's uid finds the stragglers
            daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                      "    time.sleep(300)\nprint('done')\n")
            assert run(loop, sandbox, daemon).stdout == b"done\n"
            assert sandbox_processes() == []
    finally:
        loop.run(sandbox.close())
