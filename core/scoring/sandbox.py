"""Runs untrusted programs: one sandboxed process tree per run, a pool of slots sized to the
CPUs, and a start-up probe that decides how strong the cage can be on this machine.

Each run gets a fresh scratch directory holding the program's files, a minimal environment,
rlimits on CPU seconds, address space, processes, file size and open files, a wall-clock limit
that kills the whole sandbox, and caps on what it may print. `sandbox_init.py` builds the cage
(see its docstring for the namespaces); this module owns the pool, the timeouts and the pipes.

Each slot runs its programs under its own uid (`uid_base + slot`) when the service is root, so
RLIMIT_NPROC (counted per uid by the kernel) is a per-run limit that a fork bomb in one run
cannot use up for another, and so a run can signal no process but its own.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import marshal
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from asyncrl.platform.settings import DEFAULT_UID_BASE

log = logging.getLogger(__name__)

INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")
SETUP_FAILED = 125  # sandbox_init's exit status when the cage could not be built
# The sandbox's own start (two interpreters, the namespaces) is not charged to the program.
STARTUP_ALLOWANCE_SECONDS = 0.5
STDERR_TAIL_BYTES = 8192
_SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
_PROBE = "import socket; print(len(socket.if_nameindex()))"
# Directories that are readable by everyone but hold secrets: hidden from every run.
HIDDEN_PATHS = ("/run/secrets", "/var/run/secrets")


class Isolation(str, enum.Enum):
    NAMESPACES = "namespaces"  # root: network/mount/PID namespaces + a dedicated uid per slot
    USER_NAMESPACES = "userns"  # not root: the same inside a user namespace
    NONE = "none"  # unsafe: rlimits, scratch directory (and the dedicated uid when root)


class SandboxUnavailable(RuntimeError):
    """No network namespace could be created and the unsafe mode was not allowed."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_seconds: float = 5.0
    memory_mb: int = 512
    max_processes: int = 16
    max_file_size_mb: int = 16
    max_open_files: int = 64
    # stdout kept per run (and the most stderr read); more kills the run.
    max_output_bytes: int = 1 << 20

    @classmethod
    def from_spec(cls, code) -> SandboxLimits:
        """From the RLJob's `reward.code` (asyncrl.spec.CodeReward)."""
        return cls(timeout_seconds=code.timeout_seconds, memory_mb=code.memory_mb,
                   max_processes=code.max_processes, max_file_size_mb=code.max_file_size_mb)

    def rlimits(self, timeout: float) -> dict[str, tuple[int, int]]:
        cpu = math.ceil(timeout)
        mib = 1 << 20
        return {
            # SIGXCPU at the soft limit (a clear "timeout"), SIGKILL a second later.
            "cpu": (cpu, cpu + 1),
            "as": (self.memory_mb * mib,) * 2,
            "nproc": (self.max_processes,) * 2,
            "fsize": (self.max_file_size_mb * mib,) * 2,
            "nofile": (self.max_open_files,) * 2,
            "core": (0, 0),
        }

    @property
    def scratch_mb(self) -> int:
        """Size of the scratch tmpfs: room for a few files of the largest allowed size."""
        return max(16, 4 * self.max_file_size_mb)


@dataclass(frozen=True)
class RunResult:
    """How one sandboxed run ended. `exit_code` is the program's code, 128 + N after signal N,
    or None when the sandbox killed it (timed out or printed too much)."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    wall_seconds: float
    timed_out: bool = False
    output_exceeded: bool = False
    setup_error: str | None = None

    @property
    def signal(self) -> int | None:
        if self.exit_code is not None and self.exit_code > 128:
            return self.exit_code - 128
        return None


@dataclass
class _Output:
    data: bytearray = field(default_factory=bytearray)
    exceeded: bool = False


class Sandbox:
    """A pool of `workers` sandbox slots. `await start()` probes the machine once; then
    `await run(...)` runs one program and always returns a `RunResult` (never raises for
    anything the program does). `isolation` restricts the probe to one mode (NONE: skip it,
    which is unsafe and needs `allow_unsafe`)."""

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        *,
        workers: int | None = None,
        allow_unsafe: bool = False,
        uid_base: int = DEFAULT_UID_BASE,
        python: str | None = None,
        root: str | Path | None = None,
        on_run: Callable[[RunResult], None] | None = None,
        isolation: Isolation | None = None,
        hidden_paths: Sequence[str] = HIDDEN_PATHS,
    ):
        self.limits = limits
        self.workers = workers or os.cpu_count() or 1
        self.allow_unsafe = allow_unsafe
        self.uid_base = uid_base
        self._python_choice = python
        self._root_parent = root
        self._on_run = on_run
        if isolation is Isolation.USER_NAMESPACES and os.geteuid() == 0:
            raise ValueError("user-namespace isolation would leave the program root on the "
                             "host's files; as root the sandbox uses namespaces")
        self._only = isolation
        self._hidden = list(hidden_paths)
        self.isolation: Isolation | None = None
        self.unavailable: str | None = None
        self.python: str | None = None
        self._root: Path | None = None
        self._slots: asyncio.Queue[int] = asyncio.Queue()
        self._started = False
        self._start_lock = asyncio.Lock()

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> Sandbox:
        """Chooses the interpreter and the strongest isolation that works here."""
        async with self._start_lock:
            if self._started:
                return self
            self._root = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-", dir=self._root_parent))
            os.chmod(self._root, 0o711)  # slots may enter their own directory, not list others
            for slot in range(self.workers):
                self._slots.put_nowait(slot)
            self._started = True
            root = os.geteuid() == 0
            self.python = self._python_choice or _sandbox_python(root)
            best = Isolation.NAMESPACES if root else Isolation.USER_NAMESPACES
            tried = []
            for mode in [best] if self._only in (None, best) else []:
                problem = await self._probe(mode)
                if problem is None:
                    self.isolation = mode
                    log.info("code sandbox: %s isolation, %d slots, python %s", mode.value,
                             self.workers, self.python)
                    return self
                tried.append(f"{mode.value}: {problem}")
            self.isolation = Isolation.NONE
            reason = "; ".join(tried) or "isolation none was asked for"
            if self.allow_unsafe:
                if not root:
                    # Programs run as our own user: at least keep them out of /proc/<us>/environ.
                    _libc().prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
                log.critical(
                    "CODE SANDBOX IS UNSAFE: no network namespace can be created here (%s). "
                    "Tested code runs WITH NETWORK ACCESS%s because "
                    "allowUnsafeNoNetworkNamespace is set.", reason,
                    "" if root else " and as the service's own user",
                )
            else:
                self.unavailable = (
                    f"the code sandbox cannot create a network namespace here ({reason}); "
                    "refusing to run code. Run the reward service where namespaces are "
                    "allowed, or set reward.code.allowUnsafeNoNetworkNamespace: true on a "
                    "trusted single-user machine"
                )
                log.error("%s", self.unavailable)
            return self

    async def _probe(self, mode: Isolation) -> str | None:
        """None if a trivial program runs in `mode` and sees no network, else the problem."""
        run = await self._run_in_slot(
            mode, 0, {}, [self.python, "-I", "-S", "-c", _PROBE], b"", timeout=30.0)
        if run.setup_error or run.exit_code != 0:
            text = (run.setup_error or run.stderr.decode(errors="replace")).strip()
            return text.splitlines()[-1] if text else f"exit status {run.exit_code}"
        if run.stdout.strip() != b"1":
            return f"the sandbox sees {run.stdout.strip().decode()} network interfaces, not only lo"
        return None

    async def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def health(self) -> tuple[bool, str]:
        if not self._started:
            return True, "code sandbox not started yet"
        if self.unavailable:
            return False, self.unavailable
        return True, f"code sandbox: {self.isolation.value} isolation"

    # ------------------------------------------------------------------ runs

    async def run(
        self,
        files: Mapping[str, bytes],
        argv: Sequence[str],
        stdin: bytes = b"",
        *,
        timeout: float | None = None,
    ) -> RunResult:
        """Runs `argv` (argv[0] an absolute path, e.g. `self.python`) with `files` in its fresh
        scratch directory as cwd and `stdin` as its input; waits for a free slot first."""
        await self.start()
        if self.unavailable:
            raise SandboxUnavailable(self.unavailable)
        slot = await self._slots.get()
        try:
            result = await self._run_in_slot(self.isolation, slot, files, argv, stdin,
                                             timeout=timeout or self.limits.timeout_seconds)
        finally:
            self._slots.put_nowait(slot)
        if self._on_run is not None:
            self._on_run(result)
        return result

    async def _run_in_slot(self, mode: Isolation, slot: int, files: Mapping[str, bytes],
                           argv: Sequence[str], stdin: bytes, *, timeout: float) -> RunResult:
        dedicated_uid = os.geteuid() == 0 and mode is not Isolation.USER_NAMESPACES
        uid = self.uid_base + slot if dedicated_uid else None
        scratch = Path(tempfile.mkdtemp(prefix=f"run{slot}-", dir=self._root))
        start = time.perf_counter()
        process = None
        try:
            for name, data in files.items():
                path = scratch / name
                path.write_bytes(data)
                path.chmod(0o444)
            if mode is Isolation.NONE and uid is not None:
                os.chown(scratch, uid, uid)
            config = {
                "mode": mode.value, "scratch": str(scratch), "scratch_mb": self.limits.scratch_mb,
                "uid": uid, "gid": uid, "limits": self.limits.rlimits(timeout),
                "argv": list(argv), "env": _program_env(scratch), "service_pid": os.getpid(),
                "hide": self._hidden,
            }
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", str(INIT_SCRIPT), marshal.dumps(config).hex(),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )

            async def clean_up() -> None:
                """Once the sandbox's first process has exited: nothing of the run remains."""
                if process.returncode is None or mode is Isolation.NONE:
                    _kill_group(process.pid)  # without a PID namespace, stragglers may remain
                await process.wait()
                if uid is not None:
                    await self._kill_uid(uid, mode)

            return await self._supervise(process, stdin, timeout, start, clean_up)
        finally:
            if process is not None:
                await clean_up()
            shutil.rmtree(scratch, ignore_errors=True)

    async def _supervise(self, process: asyncio.subprocess.Process, stdin: bytes,
                         timeout: float, start: float, clean_up) -> RunResult:
        cap = self.limits.max_output_bytes
        stdout, stderr = _Output(), _Output()
        readers = [
            asyncio.ensure_future(_read_capped(process.stdout, stdout, cap, process.pid)),
            asyncio.ensure_future(_read_capped(process.stderr, stderr, cap, process.pid,
                                               tail=STDERR_TAIL_BYTES)),
        ]
        feeder = asyncio.ensure_future(_feed(process.stdin, stdin))
        timed_out = False
        try:
            try:
                await asyncio.wait_for(process.wait(), timeout + STARTUP_ALLOWANCE_SECONDS)
            except asyncio.TimeoutError:
                timed_out = True
                _kill_group(process.pid)
                await process.wait()
            wall = time.perf_counter() - start
            await clean_up()
            # Every writer is gone now; give the pipes a moment to deliver the rest.
            await asyncio.wait(readers, timeout=2.0)
        finally:
            for task in (*readers, feeder):
                task.cancel()
            await asyncio.gather(*readers, feeder, return_exceptions=True)
        code = process.returncode
        killed = timed_out or stdout.exceeded or stderr.exceeded
        setup_error = None
        if code == SETUP_FAILED and b"sandbox setup failed:" in stderr.data:
            setup_error = stderr.data.decode(errors="replace").strip().splitlines()[-1]
        return RunResult(
            exit_code=None if killed or code < 0 else code,
            stdout=bytes(stdout.data), stderr=bytes(stderr.data), wall_seconds=wall,
            timed_out=timed_out, output_exceeded=stdout.exceeded or stderr.exceeded,
            setup_error=setup_error,
        )

    async def _kill_uid(self, uid: int, mode: Isolation) -> None:
        """Makes sure no process of a slot's uid is left (it would count against the next
        run's process limit). In a PID namespace the kernel has already killed them all."""
        if mode is Isolation.NONE and _processes_of(uid):
            # kill(-1) as the slot's uid reaches every process of that uid, in any session.
            try:
                killer = await asyncio.create_subprocess_exec(
                    self.python, "-I", "-S", "-c", "import os; os.kill(-1, 9)",
                    user=uid, group=uid, extra_groups=[], env={},
                    stdin=asyncio.subprocess.DEVNULL,
                )
                await killer.wait()
            except OSError as exc:
                log.error("cannot kill the processes left by sandbox uid %d: %s", uid, exc)
        deadline = time.monotonic() + 5.0
        while _processes_of(uid) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _program_env(scratch: Path) -> dict[str, str]:
    """All the program sees of an environment: no secrets, nothing of the service's."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch),
            "LANG": "C.UTF-8"}


def _sandbox_python(as_root: bool) -> str:
    """An interpreter the sandbox user can execute: ours when every directory on its path is
    open to others (a container's /usr/local/bin/python), else the system's python3."""
    ours = os.path.realpath(sys.executable)
    if not as_root or _world_executable(ours):
        return ours
    for candidate in _SYSTEM_PYTHONS:
        if os.path.exists(candidate) and _world_executable(os.path.realpath(candidate)):
            return candidate
    return ours  # the probe will say why it cannot run


def _world_executable(path: str) -> bool:
    parts = Path(path).parents
    if any(not os.stat(p).st_mode & stat.S_IXOTH for p in parts):
        return False
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def _processes_of(uid: int) -> list[int]:
    """Live (not zombie) processes of `uid`."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    with open(f"/proc/{entry.name}/stat", "rb") as handle:
                        state = handle.read().rsplit(b")", 1)[1].split()[0]
                    if state != b"Z":
                        found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return found


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        if data:
            writer.write(data)
            await writer.drain()
        writer.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading all its input


async def _read_capped(reader: asyncio.StreamReader, out: _Output, cap: int, pgid: int,
                       tail: int | None = None) -> None:
    """Reads to EOF, keeping at most `cap` bytes (or the last `tail`); kills the sandbox as
    soon as more than `cap` bytes arrive, and drains the rest: asyncio reports a process's
    exit (`wait()`) only once its pipes have closed, and a pipe left unread stays open."""
    total = 0
    while chunk := await reader.read(1 << 16):
        total += len(chunk)
        if out.exceeded:
            continue
        if total > cap:
            out.exceeded = True
            _kill_group(pgid)
            continue
        out.data += chunk
        if tail is not None and len(out.data) > tail:
            del out.data[:-tail]
