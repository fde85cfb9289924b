"""A real one-node Kubernetes cluster for tests: real containers, on this machine, no registry.

`RealCluster(workdir).start()` runs the control plane of control_plane.py for a real kubelet
(`ControlPlane(real_node=True)`), then the node: containerd (Debian's package, our own config,
state under `workdir`), the base image of base_image.sh imported (it is also the pod sandbox
image), a bridge CNI network, kubelet and kube-proxy (iptables mode) as local processes, and
CoreDNS as a Deployment. `stop()` ends all of it and undoes what it changed on the host: pod
processes and containerd shims, mounts, the bridge, iptables chains and rules, cgroups,
sysctls, and host paths that were absent before.

What it changed on the host is written to a state file before each change, so a run that died
(SIGKILL, power loss of the test process) is undone by the next start or by `node.sh down`.
One real node per machine at a time: a lock serialises them.

    python tests/cluster/node.py up|down|status|prepare    (tests/cluster/node.sh wraps it)
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cluster.control_plane import (  # noqa: E402
    BUILD_SCRIPT, SERVICE_CIDR, ControlPlane, _Process, bin_dir, missing_binaries, spawn,
    stop_processes)
from support.ports import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
NODE_SCRIPT = HERE / "node.sh"
BASE_IMAGE_SCRIPT = HERE / "base_image.sh"
CACHE = Path(os.environ.get("ASYNCRL_CACHE") or Path.home() / ".cache" / "asyncrl")
#: Lock and state of the node that is up; in the cache, so a machine-wide lock leaves no file
#: outside it.
STATE_DIR = CACHE / "node"
LOCK_FILE = STATE_DIR / "lock"
STATE_FILE = STATE_DIR / "state.json"

NODE_BINARIES = ("kubelet", "kube-proxy", "coredns", "kubectl")
#: Debian package -> a file it installs.
PACKAGES = {
    "containerd": "/usr/bin/containerd",
    "runc": "/usr/sbin/runc",
    "containernetworking-plugins": "/usr/lib/cni/bridge",
    "iptables": "/usr/sbin/iptables",
    "conntrack": "/usr/sbin/conntrack",
    # Only to delete the nf_tables tables kube-proxy creates, once empty again.
    "nftables": "/usr/sbin/nft",
}
CNI_BIN_DIR = "/usr/lib/cni"
BASE_IMAGE = "asyncrl.local/debian-python:bookworm"

NODE_NAME = "asyncrl-node"
BRIDGE = "asyncrl0"
POD_CIDR = "10.244.0.0/16"
DNS_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
#: Marks the iptables rules this module adds itself.
RULE_COMMENT = "asyncrl-real-node"
#: Chains created by kube-proxy, kubelet and the CNI plugins.
CHAIN_PREFIXES = ("KUBE-", "CNI-")
IPTABLES_TABLES = ("filter", "nat", "mangle")

#: Host paths only a kubelet writes to: removed by stop, content and all, if absent before.
KUBELET_PATHS = ("/var/lib/kubelet", "/var/log/pods", "/var/log/containers")
#: Host paths other programs may share (containerd's shims put their sockets in
#: /run/containerd/s whatever the config says): stop removes our files there, then the
#: folders it finds empty, if absent before.
SHARED_PATHS = ("/run/containerd", "/run/netns", "/var/lib/cni", "/etc/cni", "/opt/cni",
                "/var/lib/containerd", "/etc/containerd", "/var/lib/kube-proxy",
                "/etc/kubernetes", "/run/kubernetes")
HOST_PATHS = KUBELET_PATHS + SHARED_PATHS
#: Sysctl folders compared before and after (kubelet and kube-proxy tune a few of them).
SYSCTL_DIRS = ("kernel", "vm", "net/ipv4", "net/ipv4/conf/all", "net/ipv4/conf/default",
               "net/ipv6/conf/all", "net/ipv6/conf/default", "net/bridge", "net/netfilter",
               "net/core")
#: Values that change on their own.
SYSCTL_VOLATILE = ("kernel.ns_last_pid", "kernel.random.", "kernel.hostname",
                   "kernel.domainname")


class NodeMissing(RuntimeError):
    """Packages, binaries or the base image are missing; the message says how to get them."""


#: Free disk a node needs: its containerd keeps an imported image twice, as layer blobs and
#: unpacked (about 10 GiB for the 5 GB service image, measured), plus room for pods' logs.
NODE_DISK_GIB = 12
#: Free disk below which the kubelet evicts pods (and refuses new ones): well inside the headroom
#: NODE_DISK_GIB leaves above the import.
EVICTION_DISK = "512Mi"


def check_disk(path: Path) -> None:
    """Fail at once, naming what holds the space, rather than in an image import half-way."""
    free = shutil.disk_usage(path).free / 2**30
    if free >= NODE_DISK_GIB:
        return
    candidates = [*CACHE.glob("*"), *Path(tempfile.gettempdir()).glob("pytest-of-*")]
    sizes = []
    for candidate in candidates:
        out = subprocess.run(["du", "-sx", "--block-size=1M", str(candidate)],
                             capture_output=True, text=True)
        if out.returncode == 0 and out.stdout:
            sizes.append((int(out.stdout.split()[0]), candidate))
    largest = ", ".join(f"{path} {mb / 1024:.1f} GiB" for mb, path in sorted(sizes)[::-1][:6])
    raise NodeMissing(f"only {free:.1f} GiB free under {path}; a real node needs about "
                      f"{NODE_DISK_GIB} GiB (containerd keeps the service image as layer blobs "
                      f"and unpacked). Largest folders here: {largest}")


def log(message: str) -> None:
    print(f"[real-node] {message}", file=sys.stderr, flush=True)


def run(*argv: str, check: bool = True, input: str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, input=input,
                          timeout=timeout)


# --------------------------------------------------------------------------- prerequisites


def base_image_tar() -> Path:
    out = run("bash", str(BASE_IMAGE_SCRIPT), "--print")
    return Path(out.stdout.strip())


def missing_prerequisites(binaries: Path) -> list[str]:
    missing = [f"package {name} ({path})" for name, path in PACKAGES.items()
               if not os.path.exists(path)]
    missing += [f"binary {name} in {binaries}" for name in
                missing_binaries(binaries, ("etcd", "kube-apiserver", "kube-controller-manager",
                                            "kube-scheduler", *NODE_BINARIES))]
    if not base_image_tar().is_file():
        missing.append(f"base image {base_image_tar()}")
    return missing


def prepare() -> None:
    """Install the Debian packages and build what is missing (all cached)."""
    absent = [name for name, path in PACKAGES.items() if not os.path.exists(path)]
    if absent:
        log(f"apt-get install {' '.join(absent)}")
        # An install stopped half-way (scripts/test.sh stops this when a test pass fails) would
        # refuse every later one until dpkg finishes configuring what it unpacked.
        subprocess.run(["dpkg", "--configure", "-a"], check=False, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "update", "-qq"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=600",
                        *absent], check=True,
                       stdout=subprocess.DEVNULL,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, stdout=sys.stderr)
    subprocess.run(["bash", str(BASE_IMAGE_SCRIPT)], check=True, stdout=subprocess.DEVNULL)


def node_ip() -> str:
    """The address of the interface that holds the default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.255", 9))
            address = sock.getsockname()[0]
        except OSError:
            address = ""
    if address and not address.startswith("127."):
        return address
    for line in run("ip", "-4", "-o", "addr", "show", "scope", "global").stdout.splitlines():
        return line.split()[3].split("/")[0]
    raise RuntimeError("no global IPv4 address on this machine: a real node needs one")


def default_mtu() -> int:
    route = run("ip", "-4", "route", "show", "default", check=False).stdout.split()
    if "dev" in route:
        mtu = Path(f"/sys/class/net/{route[route.index('dev') + 1]}/mtu")
        if mtu.exists():
            return int(mtu.read_text())
    return 1500


# --------------------------------------------------------------------------- host state


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (tells a pid from a reused one); None when it
    is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def read_sysctls() -> dict[str, str]:
    values = {}
    for folder in SYSCTL_DIRS:
        base = Path("/proc/sys") / folder
        if not base.is_dir():
            continue
        for entry in base.iterdir():
            key = str(entry.relative_to("/proc/sys")).replace("/", ".")
            if not entry.is_file() or not os.access(entry, os.W_OK) or \
                    key.startswith(SYSCTL_VOLATILE):
                continue
            with contextlib.suppress(OSError):
                values[key] = entry.read_text().strip()
    return values


def write_sysctl(key: str, value: str) -> None:
    Path("/proc/sys", *key.split(".")).write_text(value)


def iptables_chains() -> dict[str, list[str]]:
    """Chains per "<command> <table>" (e.g. "iptables nat")."""
    chains = {}
    for command in ("iptables", "ip6tables"):
        for table in IPTABLES_TABLES:
            out = run(command, "-t", table, "-S", check=False)
            if out.returncode == 0:
                chains[f"{command} {table}"] = [line.split()[1] for line in out.stdout.splitlines()
                                                if line.startswith("-N ")]
    return chains


def iptables_tables() -> dict[str, list[str]]:
    """Tables that exist per command (e.g. {"iptables": ["filter"]}); listing creates none."""
    tables = {}
    for command in ("iptables", "ip6tables"):
        out = run(f"{command}-save", check=False).stdout
        tables[command] = [line[1:] for line in out.splitlines() if line.startswith("*")]
    return tables


def cgroup_roots() -> list[Path]:
    """Every cgroup hierarchy's root (v1 controllers, or the unified v2 root)."""
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        return [base]
    return [p for p in base.iterdir() if p.is_dir() and (p / "cgroup.procs").exists()]


@dataclass
class HostState:
    """What the node changed on the host, persisted so that a dead run can be undone."""
    workdir: str
    owner_pid: int = field(default_factory=os.getpid)
    containerd_socket: str = ""
    #: name, pid, start time of every process started.
    processes: list[list] = field(default_factory=list)
    sysctls: dict[str, str] = field(default_factory=dict)
    absent_paths: list[str] = field(default_factory=list)
    chains: dict[str, list[str]] = field(default_factory=dict)
    tables: dict[str, list[str]] = field(default_factory=dict)
    cgroups: list[str] = field(default_factory=list)
    bridge_existed: bool = False
    ready: bool = False

    @classmethod
    def capture(cls, workdir: Path) -> HostState:
        return cls(
            workdir=str(workdir),
            sysctls=read_sysctls(),
            absent_paths=[p for p in HOST_PATHS if not os.path.lexists(p)],
            chains=iptables_chains(),
            tables=iptables_tables(),
            cgroups=[str(root / "kubepods") for root in cgroup_roots()
                     if (root / "kubepods").exists()],
            bridge_existed=Path(f"/sys/class/net/{BRIDGE}").exists(),
        )

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = STATE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(STATE_FILE)

    @classmethod
    def load(cls) -> HostState | None:
        try:
            return cls(**json.loads(STATE_FILE.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def record(self, process: _Process) -> None:
        pid = process.popen.pid
        self.processes.append([process.name, pid, _start_time(pid)])
        self.save()


@contextlib.contextmanager
def machine_lock(timeout: float):
    """One real node per machine: wait up to `timeout` seconds for the one that is up."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    handle = open(LOCK_FILE, "a+")
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                state = HostState.load()
                raise TimeoutError(
                    f"another real node holds {LOCK_FILE} (process "
                    f"{state.owner_pid if state else '?'}); stop it with: bash {NODE_SCRIPT} down")
            if not said:
                log(f"waiting for the real node that holds {LOCK_FILE}")
                said = True
            time.sleep(2)
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


# --------------------------------------------------------------------------- undo


def kill_recorded(processes: list[list]) -> None:
    """SIGKILL recorded processes that still run (same pid and start time)."""
    for name, pid, started in processes:
        if started and _start_time(pid) == started:
            log(f"killing leftover {name} ({pid})")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _cgroup_tree(root: Path) -> list[Path]:
    """`root` and its descendants, deepest first."""
    if not root.is_dir():
        return []
    tree = [Path(d) for d, _, _ in os.walk(root)]
    return sorted(tree, key=lambda p: len(p.parts), reverse=True)


def kill_pods(state: HostState) -> None:
    """SIGKILL every container process (they live in the kubepods cgroups), then the shims of
    our containerd, which outlive it otherwise."""
    created = [root / "kubepods" for root in cgroup_roots()
               if str(root / "kubepods") not in state.cgroups]
    for _ in range(50):
        pids = set()
        for group in created:
            for folder in _cgroup_tree(group):
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in (folder / "cgroup.procs").read_text().split())
        pids |= _shims(state.containerd_socket)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for group in created:
        for folder in _cgroup_tree(group):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _shims(socket_path: str) -> set[int]:
    if not socket_path:
        return set()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and \
                    socket_path.encode() in argv:
                found.add(int(entry.name))
    return found


def mounted_under(prefixes: list[str]) -> list[str]:
    """Mount points at or below any of `prefixes`, deepest first."""
    mounts = [line.split()[1].replace("\\040", " ")
              for line in Path("/proc/mounts").read_text().splitlines()]
    return sorted({m for m in mounts for p in prefixes if m == p or m.startswith(p + "/")},
                  key=len, reverse=True)


def _remove_tree(path: str | Path) -> None:
    """rmtree, unless something is still mounted below: never delete through a mount."""
    if mounted_under([str(path)]):
        log(f"left {path}: still mounted below it")
        return
    shutil.rmtree(path, ignore_errors=True)


def unmount_under(prefixes: list[str]) -> None:
    """Unmount everything mounted under `prefixes`, deepest first."""
    for _ in range(5):
        ours = mounted_under(prefixes)
        if not ours:
            return
        for mount in ours:
            if run("umount", mount, check=False).returncode != 0:
                run("umount", "-l", mount, check=False)
    log(f"still mounted under {prefixes}")


def remove_network(state: HostState) -> None:
    if state.bridge_existed:
        return
    links = run("ip", "-o", "link", "show", "master", BRIDGE, check=False).stdout
    for line in links.splitlines():
        run("ip", "link", "delete", line.split(":")[1].strip().split("@")[0], check=False)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        run("ip", "link", "delete", BRIDGE, check=False)
    run("conntrack", "-D", "-s", POD_CIDR, check=False)


def remove_iptables(state: HostState) -> None:
    """Delete chains that were not there before (and the rules that jump to them), and the
    rules carrying RULE_COMMENT."""
    for key, before in state.chains.items():
        command, table = key.split()
        listing = run(command, "-t", table, "-S", check=False).stdout.splitlines()
        new = [line.split()[1] for line in listing if line.startswith("-N ")
               and line.split()[1].startswith(CHAIN_PREFIXES) and line.split()[1] not in before]
        for line in listing:
            if not line.startswith("-A "):
                continue
            rule = shlex.split(line)
            jumps = {rule[i + 1] for i, a in enumerate(rule[:-1]) if a in ("-j", "-g")}
            if rule[1] not in new and (jumps & set(new) or RULE_COMMENT in rule):
                run(command, "-t", table, "-D", *rule[1:], check=False)
        for chain in new:
            run(command, "-t", table, "-F", chain, check=False)
        for chain in new:
            run(command, "-t", table, "-X", chain, check=False)
    remove_empty_tables(state)


def remove_empty_tables(state: HostState) -> None:
    """nf_tables tables that appeared (iptables-nft creates them on first use) and hold no
    rule and no chain of their own any more."""
    if not shutil.which("nft"):
        return
    family = {"iptables": "ip", "ip6tables": "ip6"}
    for command, before in state.tables.items():
        for table in set(iptables_tables().get(command, [])) - set(before):
            listing = run(command, "-t", table, "-S", check=False).stdout.splitlines()
            if all(line.startswith("-P ") and line.endswith(" ACCEPT") for line in listing):
                run("nft", "delete", "table", family[command], table, check=False)


def restore_sysctls(state: HostState) -> None:
    now = read_sysctls()
    changed = {key: value for key, value in state.sysctls.items() if now.get(key, value) != value}
    for key, value in changed.items():
        with contextlib.suppress(OSError):
            write_sysctl(key, value)
    if changed:
        log(f"restored {', '.join(f'{k}={v}' for k, v in sorted(changed.items()))}")


def _task_folders(state: HostState) -> list[Path]:
    """One folder per container and pod sandbox of our containerd, named by its id."""
    tasks = Path(state.workdir) / "containerd" / "state" / "io.containerd.runtime.v2.task"
    return list(tasks.glob("*/*"))


def remove_runtime_files(state: HostState) -> None:
    """What the runtime leaves in shared host folders when its pods are killed rather than
    deleted: shim sockets in /run/containerd/s (each task folder names its socket in an
    `address` file) and CNI result caches in /var/lib/cni/results (named after the sandbox)."""
    folders = _task_folders(state)
    for folder in folders:
        with contextlib.suppress(OSError):
            socket_path = (folder / "address").read_text().strip().removeprefix("unix://")
            if socket_path.startswith("/run/containerd/"):
                os.unlink(socket_path)
    ids = {folder.name for folder in folders}
    results = Path("/var/lib/cni/results")
    if ids and results.is_dir():
        for entry in results.iterdir():
            if any(task_id in entry.name for task_id in ids):
                entry.unlink(missing_ok=True)


def remove_paths(state: HostState) -> None:
    containers = Path("/var/log/containers")
    if containers.is_dir() and "/var/log/containers" not in state.absent_paths:
        # kubelet links every container's log here; drop the links into our workdir.
        for link in containers.iterdir():
            if link.is_symlink() and os.readlink(link).startswith(state.workdir):
                link.unlink()
    for path in state.absent_paths:
        if not os.path.lexists(path):
            continue
        log(f"removing {path} (made during the run)")
        if path in KUBELET_PATHS:
            _remove_tree(path)
        else:
            _remove_empty_folders(Path(path))


def _remove_empty_folders(root: Path) -> None:
    for folder in sorted((Path(d) for d, _, _ in os.walk(root)), key=lambda p: len(p.parts),
                         reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()
    if root.exists():
        log(f"left {root}: it holds files of another program")


def undo(state: HostState) -> None:
    """Undo everything `state` records, in dependency order. Safe to run twice."""
    kill_recorded(state.processes)
    kill_pods(state)
    remove_runtime_files(state)
    unmount_under([state.workdir, *(p for p in state.absent_paths if p in KUBELET_PATHS)])
    remove_network(state)
    remove_iptables(state)
    restore_sysctls(state)
    remove_paths(state)
    # Container filesystems and etcd's preallocated files are large; logs and configs stay for
    # reading after a failure.
    for heavy in ("containerd", "kubelet", "control-plane/etcd"):
        _remove_tree(Path(state.workdir) / heavy)


def undo_stale() -> None:
    """Undo a run that died without stopping (its state file is still there)."""
    state = HostState.load()
    if state is None:
        return
    log(f"undoing a real node left behind by process {state.owner_pid} ({state.workdir})")
    undo(state)
    STATE_FILE.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the node


@dataclass
class Node:
    """containerd, kubelet, kube-proxy and CoreDNS on this machine, for `plane`."""
    workdir: Path
    plane: ControlPlane
    state: HostState
    binaries: Path
    processes: list[_Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logs = self.workdir / "logs"
        self.socket = self.workdir / "containerd" / "containerd.sock"
        self.kubelet_port = free_port()

    def start(self, timeout: float) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.state.containerd_socket = str(self.socket)
        self.state.save()
        self._prepare_host()
        self._start_containerd(timeout)
        self.import_image(base_image_tar())
        self._write_cni_config()
        self._start_kubelet()
        self._start_kube_proxy()
        self._wait_node_ready(timeout)
        self._start_coredns(timeout)

    def stop(self) -> None:
        # Before the pods are killed, so that kubelet restarts none of them.
        stop_processes(self.processes, grace=3)
        self.processes.clear()

    def check_alive(self) -> None:
        for process in self.processes:
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n"
                                   f"{process.tail()}")

    def _spawn(self, name: str, argv: list[str]) -> None:
        process = spawn(name, argv, self.logs / f"{name}.log")
        self.processes.append(process)
        self.state.record(process)

    # ---------------------------------------------------------------- host

    def _prepare_host(self) -> None:
        # Routing between the pod bridge and the node, and Service NAT for traffic that stays
        # on the bridge (pod to pod through a ClusterIP).
        write_sysctl("net.ipv4.ip_forward", "1")
        write_sysctl("net.bridge.bridge-nf-call-iptables", "1")
        # Outbound traffic here goes through a proxy that answers any address: a ClusterIP
        # kube-proxy has not translated yet must fail, not reach it.
        for chain in ("FORWARD", "OUTPUT"):
            run("iptables", "-I", chain, "-d", SERVICE_CIDR, "-m", "comment", "--comment",
                RULE_COMMENT, "-j", "REJECT")

    # ---------------------------------------------------------------- containerd

    def _start_containerd(self, timeout: float) -> None:
        base = self.workdir / "containerd"
        base.mkdir(parents=True, exist_ok=True)
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = base / "config.toml"
        config.write_text(f"""version = 2
root = "{base / 'root'}"
state = "{base / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = "{self.socket}"

[{cri}]
  sandbox_image = "{BASE_IMAGE}"
  # Without CAP_SYS_RESOURCE a negative oom_score_adj is refused and runc fails.
  restrict_oom_score_adj = true
  # Pod network namespaces under our state folder, not /run/netns.
  netns_mounts_under_state_dir = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{base / 'runc'}"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{self.workdir / 'cni' / 'net.d'}"
  max_conf_num = 1

[plugins."io.containerd.internal.v1.opt"]
  path = "{base / 'opt'}"
""")
        self._spawn("containerd", ["containerd", "--config", str(config)])
        deadline = time.monotonic() + timeout
        while self.ctr("version", check=False).returncode != 0:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"containerd not up after {timeout}s")
            time.sleep(0.2)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run("ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args,
                   check=check, timeout=600)

    def import_image(self, tar: Path | str) -> None:
        """Load an image tar (docker save or OCI layout) into the node's runtime; pods use it
        with imagePullPolicy: Never."""
        self.ctr("images", "import", str(tar))

    def _write_cni_config(self) -> None:
        folder = self.workdir / "cni" / "net.d"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "10-asyncrl.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "asyncrl",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True,
                 "hairpinMode": True, "mtu": default_mtu(),
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                          "routes": [{"dst": "0.0.0.0/0"}],
                          "dataDir": str(self.workdir / "cni" / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
                {"type": "firewall"},
            ],
        }, indent=1))

    # ---------------------------------------------------------------- kubelet, kube-proxy

    def _resolv_conf(self) -> str:
        """A resolv.conf for CoreDNS's upstream: the host's, unless it points at loopback."""
        host = Path("/etc/resolv.conf")
        if "nameserver 127." not in host.read_text():
            return str(host)
        for alternative in (Path("/run/systemd/resolve/resolv.conf"),):
            if alternative.exists():
                return str(alternative)
        return str(host)

    def _start_kubelet(self) -> None:
        root = self.workdir / "kubelet"
        root.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "kubelet.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
            "address": "0.0.0.0", "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": free_port(),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.plane.certs / "ca.crt")}},
            # Only the API server (an admin client certificate) talks to this kubelet.
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDomain": CLUSTER_DOMAIN, "clusterDNS": [DNS_IP],
            "resolvConf": self._resolv_conf(),
            "podLogsDir": str(self.workdir / "pod-logs"),
            # Images come from tars, not a registry: never delete one.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            # A busy CI disk must not evict the test's pods. Absolute sizes, not shares: 1% of a
            # large shared disk is more than the headroom check_disk leaves after the import.
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": EVICTION_DISK,
                             "nodefs.inodesFree": "1%", "imagefs.available": EVICTION_DISK},
            "rotateCertificates": False, "serverTLSBootstrap": False,
            "nodeStatusReportFrequency": "10s",
        }))
        self._spawn("kubelet", [
            str(self.binaries / "kubelet"), f"--config={config}",
            f"--kubeconfig={self.plane.kubeconfig}", f"--root-dir={root}",
            f"--cert-dir={root / 'pki'}", f"--hostname-override={NODE_NAME}",
            f"--node-ip={self.plane.node_ip}", "--v=1",
        ])

    def _start_kube_proxy(self) -> None:
        config = self.workdir / "kube-proxy.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "mode": "iptables", "clusterCIDR": POD_CIDR, "hostnameOverride": NODE_NAME,
            "clientConnection": {"kubeconfig": str(self.plane.kubeconfig)},
            "bindAddress": "0.0.0.0",
            "healthzBindAddress": f"127.0.0.1:{free_port()}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            # Zeros keep the host's conntrack settings; no localhost NodePorts keeps
            # route_localnet as it is.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
            "iptables": {"localhostNodePorts": False, "minSyncPeriod": "0s"},
        }))
        self._spawn("kube-proxy", [str(self.binaries / "kube-proxy"), f"--config={config}"])

    def _wait_node_ready(self, timeout: float) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        core = client.CoreV1Api(self.plane.api_client())
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            with contextlib.suppress(ApiException):
                node = core.read_node(NODE_NAME)
                if any(c.type == "Ready" and c.status == "True"
                       for c in node.status.conditions or []):
                    return
            if time.monotonic() > deadline:
                kubelet = next(p for p in self.processes if p.name == "kubelet")
                raise TimeoutError(f"node {NODE_NAME} not Ready after {timeout}s; kubelet log:\n"
                                   f"{kubelet.tail()}")
            time.sleep(0.5)

    # ---------------------------------------------------------------- CoreDNS

    def _start_coredns(self, timeout: float) -> None:
        kubectl = kubectl_command(self.binaries, self.plane.kubeconfig)
        manifest = coredns_manifest(self.binaries / "coredns")
        subprocess.run([*kubectl, "apply", "-f", "-"], input=manifest, text=True, check=True,
                       capture_output=True)
        out = subprocess.run([*kubectl, "-n", "kube-system", "rollout", "status",
                              "deployment/coredns", f"--timeout={int(timeout)}s"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            pods = subprocess.run([*kubectl, "-n", "kube-system", "describe", "pods"],
                                  capture_output=True, text=True).stdout
            raise TimeoutError(f"CoreDNS not ready: {out.stderr}\n{pods[-3000:]}")
        wait_for_endpoints(kubectl, "kube-system", "kube-dns", timeout)


def kubectl_command(binaries: Path, kubeconfig: Path) -> list[str]:
    """kubectl for the cluster of `kubeconfig`, its discovery cache beside it (not ~/.kube)."""
    return [str(binaries / "kubectl"), f"--kubeconfig={kubeconfig}",
            f"--cache-dir={kubeconfig.parent / 'kubectl-cache'}"]


def wait_for_endpoints(kubectl: list[str], namespace: str, service: str,
                       timeout: float) -> None:
    """Until the Service has a ready endpoint (kube-proxy programs only those)."""
    deadline = time.monotonic() + timeout
    selector = f"kubernetes.io/service-name={service}"
    template = "{.items[*].endpoints[?(@.conditions.ready==true)].addresses[0]}"
    while True:
        out = subprocess.run([*kubectl, "-n", namespace, "get", "endpointslices", "-l",
                              selector, "-o", f"jsonpath={template}"],
                             capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Service {namespace}/{service} has no ready endpoint")
        time.sleep(0.3)


def coredns_manifest(binary: Path) -> str:
    """CoreDNS as a Deployment: the base image running the binary from the cache (hostPath),
    serving cluster.local from the API and forwarding the rest to the host's resolver."""
    corefile = f""".:53 {{
    errors
    health :8080
    ready :8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }}
    forward . /etc/resolv.conf
    cache 30
    loop
    loadbalance
}}
"""
    labels = {"k8s-app": "kube-dns"}
    meta = {"name": "coredns", "namespace": "kube-system"}
    docs = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "system:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods",
                                                       "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", **meta}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
         "data": {"Corefile": corefile}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "serviceAccountName": "coredns", "dnsPolicy": "Default",
                      "priorityClassName": "system-cluster-critical",
                      "containers": [{
                          "name": "coredns", "image": BASE_IMAGE, "imagePullPolicy": "Never",
                          "command": ["/coredns", "-conf", "/etc/coredns/Corefile"],
                          "ports": [{"name": "dns", "containerPort": 53, "protocol": "UDP"},
                                    {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
                                    {"name": "metrics", "containerPort": 9153}],
                          "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181},
                                             "periodSeconds": 1},
                          "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}},
                          "volumeMounts": [
                              {"name": "config", "mountPath": "/etc/coredns"},
                              {"name": "binary", "mountPath": "/coredns", "readOnly": True}],
                      }],
                      "volumes": [
                          {"name": "config", "configMap": {"name": "coredns"}},
                          {"name": "binary", "hostPath": {"path": str(binary),
                                                          "type": "File"}}],
                  }}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
         "spec": {"clusterIP": DNS_IP, "selector": labels, "ports": [
             {"name": "dns", "port": 53, "protocol": "UDP"},
             {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
             {"name": "metrics", "port": 9153, "protocol": "TCP"}]}},
    ]
    return yaml.safe_dump_all(docs)


# --------------------------------------------------------------------------- the cluster


@dataclass
class RealCluster:
    """Control plane + one real node; what tests use."""
    workdir: Path
    binaries: Path | None = None
    lock_timeout: float = 1800.0
    plane: ControlPlane | None = None
    node: Node | None = None
    state: HostState | None = None
    _lock: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _imported: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.binaries = Path(self.binaries) if self.binaries else bin_dir()

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig

    def start(self, timeout: float = 180.0) -> RealCluster:
        if os.geteuid() != 0:
            raise NodeMissing("a real node needs root: containerd, kubelet, iptables, mounts")
        missing = missing_prerequisites(self.binaries)
        if missing:
            raise NodeMissing(f"a real node needs: {'; '.join(missing)}. Install and build "
                              f"them (cached; slow the first time) with: bash {NODE_SCRIPT} "
                              f"prepare")
        self._lock.enter_context(machine_lock(self.lock_timeout))
        try:
            undo_stale()
            self.workdir.mkdir(parents=True, exist_ok=True)
            check_disk(self.workdir)
            self.state = HostState.capture(self.workdir)
            self.state.save()
            self.plane = ControlPlane(self.workdir / "control-plane", binaries=self.binaries,
                                      real_node=True, node_ip=node_ip(), stop_grace=1,
                                      on_spawn=self.state.record)
            self.plane.start(timeout)
            self.node = Node(self.workdir, self.plane, self.state, self.binaries)
            self.node.start(timeout)
            self.state.ready = True
            self.state.save()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        try:
            if self.node:
                self.node.stop()
            if self.state:
                kill_pods(self.state)
            if self.plane:
                self.plane.stop()
            if self.state:
                undo(self.state)
                # Left in place if undo failed: the next start retries it.
                STATE_FILE.unlink(missing_ok=True)
        finally:
            self._lock.close()

    def __enter__(self) -> RealCluster:
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()

    # ---------------------------------------------------------------- helpers for tests

    def api_client(self):
        """A new kubernetes.client.ApiClient authenticated as cluster admin."""
        return self.plane.api_client()

    @functools.cached_property
    def api(self):
        """One shared kubernetes.client.ApiClient (cluster admin)."""
        return self.api_client()

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster; raises with its stderr when it fails."""
        out = subprocess.run([*kubectl_command(self.binaries, self.kubeconfig), *args],
                             input=input, capture_output=True, text=True,
                             timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({out.returncode}):\n"
                               f"{out.stderr}{out.stdout}")
        return out

    def import_image(self, tar: Path | str) -> None:
        """Once per tar while the node is up (test modules share the node and its images)."""
        if str(tar) not in self._imported:
            self.node.import_image(tar)
            self._imported.add(str(tar))

    def wait_for_endpoints(self, namespace: str, service: str, timeout: float = 60) -> None:
        wait_for_endpoints(kubectl_command(self.binaries, self.kubeconfig), namespace, service,
                           timeout)


# --------------------------------------------------------------------------- command line


DEFAULT_WORKDIR = Path(os.environ.get("ASYNCRL_NODE_DIR", "/tmp/asyncrl-node"))


def _serve(workdir: Path) -> int:
    """Bring the cluster up, report readiness in the state file, and hold it until SIGTERM."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    cluster = RealCluster(workdir, lock_timeout=0)
    started = time.monotonic()
    cluster.start()
    log(f"up in {time.monotonic() - started:.1f}s")
    try:
        while not stop:
            time.sleep(0.5)
    finally:
        started = time.monotonic()
        cluster.stop()
        log(f"down in {time.monotonic() - started:.1f}s")
    return 0


def _up(workdir: Path) -> int:
    state = HostState.load()
    if state and _start_time(state.owner_pid):
        kubeconfig = Path(state.workdir) / "control-plane" / "admin.kubeconfig"
        print(f"already up (or coming up): export KUBECONFIG={kubeconfig}")
        return 0
    if state:
        # Undone before its workdir (which names what to undo) is deleted.
        with machine_lock(10):
            undo_stale()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    logfile = workdir / "node.log"
    with open(logfile, "wb") as handle:
        server = subprocess.Popen([sys.executable, __file__, "serve", str(workdir)],
                                  stdout=handle, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    started = time.monotonic()
    while server.poll() is None:
        state = HostState.load()
        if state and state.ready and state.owner_pid == server.pid:
            kubeconfig = workdir / "control-plane" / "admin.kubeconfig"
            print(f"up in {time.monotonic() - started:.0f}s; export KUBECONFIG={kubeconfig}")
            return 0
        time.sleep(0.5)
    print(logfile.read_text()[-4000:], file=sys.stderr)
    return 1


def _down() -> int:
    state = HostState.load()
    if state is None:
        print("no real node is up")
        return 0
    started = time.monotonic()
    if _start_time(state.owner_pid):
        os.kill(state.owner_pid, signal.SIGTERM)
        while _start_time(state.owner_pid) and time.monotonic() - started < 120:
            time.sleep(0.2)
    if STATE_FILE.exists():
        with machine_lock(10):
            undo_stale()
    print(f"down in {time.monotonic() - started:.0f}s")
    return 0


def _status() -> int:
    state = HostState.load()
    if state is None:
        print("no real node is up")
        return 1
    alive = bool(_start_time(state.owner_pid))
    print(f"workdir {state.workdir}; owner {state.owner_pid} "
          f"{'running' if alive else 'gone (run: node.sh down)'}; ready {state.ready}")
    kubeconfig = Path(state.workdir) / "control-plane" / "admin.kubeconfig"
    kubectl = kubectl_command(bin_dir(), kubeconfig)
    subprocess.run([*kubectl, "get", "nodes", "-o", "wide"], check=False)
    subprocess.run([*kubectl, "get", "pods", "-A", "-o", "wide"], check=False)
    return 0 if alive and state.ready else 1


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "prepare":
        prepare()
        return 0
    if command == "up":
        prepare()
        return _up(DEFAULT_WORKDIR)
    if command == "serve":
        return _serve(Path(argv[1]))
    if command == "down":
        return _down()
    if command == "status":
        return _status()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
