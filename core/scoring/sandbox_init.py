"""The sandbox's first process: builds the cage, then starts the untrusted program inside it.

Run by the reward service as `python -I -S sandbox_init.py CONFIG` (CONFIG: a marshalled dict,
hex-encoded). Standard library only, few imports (start-up is paid on every run), and
single-threaded, so every step after fork is safe. The service has already written the
program's files into a fresh scratch directory and gives the program's stdin, stdout and
stderr as this process's own.

    service ─▶ this process (outside the new PID namespace; relays the exit status)
                └─▶ init (pid 1 of a new PID namespace: mounts, limits, reaps orphans)
                     └─▶ the program (the sandbox user, no network, rlimits, scratch as cwd)

Isolation modes (chosen by the service's start-up probe):

- "namespaces" (the service runs as root): new network, mount, PID, IPC and UTS namespaces;
  the whole file system read-only, a private size-limited tmpfs as the scratch directory
  (and another as /dev/shm), a fresh /proc that shows only the sandbox's processes, secret directories (`hide`) covered by
  empty mounts; the program runs as a dedicated uid.
- "userns" (the service is not root): the same inside a new user namespace; the program keeps
  the service's uid on the host but holds no capabilities and sees a read-only file system.
- "none" (explicitly allowed unsafe mode): rlimits, the dedicated uid when root, scratch cwd.

When init exits, the kernel kills every process left in its PID namespace, so nothing the
program started (even a daemonised grandchild in its own session) outlives the run. Init dies
with this process and this process with the service (PR_SET_PDEATHSIG), so the service kills
the whole sandbox by killing this process's process group, and a dying service leaves nothing.

Exit status: the program's exit code, 128 + N when a signal N killed it, and SETUP_FAILED
(with the reason on stderr) when the cage could not be built.
"""

import ctypes
import marshal
import os
import resource
import sys

SETUP_FAILED = 125

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REC, MS_PRIVATE = 0x4000, 0x40000

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SIGKILL = 9  # (the signal module imports enum: 5-10 ms of start-up per run)

SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and arm64 (asm-generic)
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result < 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _mount(source, target, fstype, flags, data=None) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags),
                       encode(data)), f"mount {fstype or source} on {target}")


def _read_only_everywhere() -> None:
    """Every mount in this (private) mount namespace becomes read-only and nosuid (device
    nodes stay usable: /dev/null, /dev/urandom)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                         ctypes.sizeof(attr)), "mount_setattr / read-only")


def _enter_namespaces(config: dict) -> None:
    flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    userns = config["mode"] == "userns"
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(flags | (CLONE_NEWUSER if userns else 0)), "unshare")
    if userns:
        # Map only our own ids: the program keeps them, with no capabilities after exec.
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
    # Nothing mounted from here on propagates back to the host.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def _build_file_system(config: dict) -> None:
    """Runs as pid 1 of the new PID namespace, inside the new mount namespace."""
    scratch = config["scratch"]
    files = {}
    for name in os.listdir(scratch):
        with open(os.path.join(scratch, name), "rb") as handle:
            files[name] = handle.read()
    try:
        _read_only_everywhere()
    except SetupError:
        if config["mode"] == "userns":
            raise  # the program has our own uid there: read-only is what protects our files
        # As root the dedicated uid already keeps the program out of the service's files.
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # World-readable secrets (a Kubernetes service-account token) disappear under empty mounts.
    for path in sorted({os.path.realpath(p) for p in config["hide"] if os.path.isdir(p)}):
        _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
               "size=4k,mode=0555")
    uid, gid = config["uid"], config["gid"]
    owner = "" if uid is None else f",uid={uid},gid={gid}"
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={config['scratch_mb']}m,nr_inodes=4096,mode=0700{owner}")
    if os.path.isdir("/dev/shm"):  # a private one: multiprocessing's semaphores live there
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               f"size={config['scratch_mb']}m,nr_inodes=1024,mode=1777")
    for name, data in files.items():
        path = os.path.join(scratch, name)
        with open(path, "wb") as handle:
            handle.write(data)
        os.chmod(path, 0o444)


def _exec_program(config: dict) -> None:
    """In the forked child: limits, identity, working directory, then exec. Never returns."""
    try:
        for name, (soft, hard) in config["limits"].items():
            resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (soft, hard))
        if config["uid"] is not None:
            os.setgroups([])
            os.setresgid(config["gid"], config["gid"], config["gid"])
            os.setresuid(config["uid"], config["uid"], config["uid"])
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.chdir(config["scratch"])
        os.closerange(3, 1 << 16)
        os.execve(config["argv"][0], config["argv"], config["env"])
    except BaseException as exc:  # noqa: BLE001 - any failure here is a setup failure
        os.write(2, f"sandbox setup failed: cannot start the program: {exc}\n".encode())
    os._exit(SETUP_FAILED)


def _start_program(config: dict) -> int:
    pid = os.fork()
    if pid == 0:
        _exec_program(config)
    return pid


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _init(config: dict) -> int:
    """pid 1 of the sandbox: build the file system, run the program, reap every orphan."""
    _build_file_system(config)
    program = _start_program(config)
    while True:
        pid, status = os.wait()
        if pid == program:
            return _status(os.waitstatus_to_exitcode(status))


def _relay(child: int) -> int:
    _, status = os.waitpid(child, 0)
    return _status(os.waitstatus_to_exitcode(status))


def main() -> int:
    config = marshal.loads(bytes.fromhex(sys.argv[1]))
    # If the service dies, so does the sandbox: nothing is left running without its timeout.
    _libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    if os.getppid() != config["service_pid"]:
        return SETUP_FAILED
    try:
        if config["mode"] == "none":
            _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the program may not ptrace or read us
            _, status = os.waitpid(_start_program(config), 0)
            return _status(os.waitstatus_to_exitcode(status))
        _enter_namespaces(config)
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # (after writing our own uid_map)
        # The parent keeps `alive` open while it lives: the child sees EOF once it is gone.
        watch, alive = os.pipe()
        child = os.fork()
        if child:
            os.close(watch)
            return _relay(child)
        try:
            os.close(alive)
            _libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
            os.set_blocking(watch, False)
            try:
                os.read(watch, 1)
                os._exit(SETUP_FAILED)  # EOF: the parent died before the line above
            except BlockingIOError:
                pass
            os.close(watch)
            os._exit(_init(config))
        except BaseException as exc:  # noqa: BLE001 - report, never run the program uncaged
            print(f"sandbox setup failed: {exc}", file=sys.stderr, flush=True)
            os._exit(SETUP_FAILED)
    except (SetupError, OSError) as exc:
        print(f"sandbox setup failed: {exc}", file=sys.stderr, flush=True)
        return SETUP_FAILED


if __name__ == "__main__":
    sys.exit(main())
