"""A real Kubernetes control plane for tests, from the binaries tests/cluster/build.sh builds.

`ControlPlane(workdir).start()` runs etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok as local processes on free loopback ports, with a generated CA, serving
and admin client certificates and a service-account key, writes an admin kubeconfig, waits until
the API server is ready, and registers fake nodes that kwok keeps Ready: CPU nodes and a tainted
GPU pool advertising `nvidia.com/gpu`. kwok also plays the kubelet for pods bound to its nodes, so
pods reach Running (and Ready) without containers. `stop()` ends every process it started.

`ControlPlane(workdir, real_node=True, node_ip=...)` is the control plane for a real kubelet
(tests/cluster/node.py): no kwok and no fake nodes; the API server listens on every address,
advertises the node's IP (in its certificate) and keeps the default endpoint reconciler, so pods
reach it through the `kubernetes` Service, and it reaches the kubelet for logs and exec.

Nothing here is a mock: Deployments become ReplicaSets and Pods through the real controllers,
the real scheduler places pods by resources, selectors and taints, and the real garbage
collector deletes children whose owner is gone.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "tests" / "cluster" / "build.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
SERVICE_CIDR = "10.0.0.0/24"

#: Labels, capacity and taint of the fake GPU node pool.
GPU_POOL_LABEL = {"node-pool": "gpu"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPUS_PER_NODE = 8


class ControlPlaneMissing(RuntimeError):
    """The binaries are not built; the message says how to build them."""


def bin_dir() -> Path:
    """Where build.sh puts the binaries (it knows the pinned version)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print"], capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip())


def missing_binaries(directory: Path, names=BINARIES) -> list[str]:
    return [name for name in names if not os.access(directory / name, os.X_OK)]


# --------------------------------------------------------------------------- certificates


def _write_certificates(directory: Path, extra_ips: tuple[str, ...] = ()) -> None:
    """CA, API server serving certificate (also valid for `extra_ips`), admin client certificate
    (system:masters) and the service-account signing key, as PEM files in `directory`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=2)

    def key() -> rsa.RSAPrivateKey:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def write_key(name: str, private: rsa.RSAPrivateKey) -> None:
        (directory / name).write_bytes(private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption()))

    def name(common: str, org: str | None = None) -> x509.Name:
        parts = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
        if org:
            parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(parts)

    ca_key = key()
    ca = (x509.CertificateBuilder().subject_name(name("asyncrl-test-ca"))
          .issuer_name(name("asyncrl-test-ca")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start)
          .not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    write_key("ca.key", ca_key)

    def issue(file: str, subject: x509.Name, usage, sans=None) -> None:
        private = key()
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca.subject)
                   .public_key(private.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        (directory / f"{file}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(f"{file}.key", private)

    issue("apiserver", name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, [
        x509.DNSName("localhost"), x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"), x509.DNSName("kubernetes.default.svc"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips),
    ])
    issue("admin", name("admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH)

    sa_key = key()
    write_key("sa.key", sa_key)
    (directory / "sa.pub").write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


# --------------------------------------------------------------------------- processes


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def spawn(name: str, argv: list[str], log: Path) -> _Process:
    """Start `argv` with stdout and stderr into `log`."""
    handle = open(log, "wb")
    popen = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
    handle.close()
    return _Process(name, popen, log)


def stop_processes(processes: list[_Process], grace: float) -> None:
    """SIGTERM every process (last started first), then SIGKILL what is left after `grace`."""
    for process in reversed(processes):
        if process.popen.poll() is None:
            process.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in reversed(processes):
        try:
            process.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.popen.kill()
            process.popen.wait(timeout=10)


@dataclass
class ControlPlane:
    workdir: Path
    binaries: Path | None = None
    cpu_nodes: int = 2
    gpu_nodes: int = 1
    #: For a real kubelet: no kwok, no fake nodes; reachable from pods at `node_ip`.
    real_node: bool = False
    node_ip: str | None = None
    #: Seconds between SIGTERM and SIGKILL in stop().
    stop_grace: float = 15.0
    #: Called with each process right after it started (to record its pid elsewhere).
    on_spawn: Callable[[_Process], None] | None = None
    processes: list[_Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.binaries = Path(self.binaries) if self.binaries else bin_dir()
        self.certs = self.workdir / "pki"
        self.logs = self.workdir / "logs"
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.etcd_port = free_port()
        self.api_port = free_port()
        if self.real_node and not self.node_ip:
            raise ValueError("real_node=True needs node_ip (the address pods reach the API at)")

    @property
    def required_binaries(self) -> tuple[str, ...]:
        return tuple(b for b in BINARIES if not (self.real_node and b == "kwok"))

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    # ---------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 120.0) -> ControlPlane:
        missing = missing_binaries(self.binaries, self.required_binaries)
        if missing:
            raise ControlPlaneMissing(
                f"Kubernetes test binaries missing from {self.binaries}: {', '.join(missing)}. "
                f"Build them (cached; slow the first time) with: bash {BUILD_SCRIPT}")
        for folder in (self.certs, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        _write_certificates(self.certs, (self.node_ip,) if self.real_node else ())
        self._write_kubeconfig()
        try:
            self._start_etcd()
            self._start_apiserver()
            self._wait_ready(timeout)
            self._start_controllers()
            if not self.real_node:
                self._create_nodes()
                self._wait_nodes_ready(timeout)
            self._wait_default_service_account(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM every process (last started first), then SIGKILL what is left."""
        stop_processes(self.processes, self.stop_grace)
        self.processes.clear()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()

    def check_alive(self) -> None:
        """Raise with the log tail of any component that exited."""
        for process in self.processes:
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n"
                                   f"{process.tail()}")

    # ---------------------------------------------------------------- components

    def _spawn(self, name: str, *args: str) -> None:
        process = spawn(name, [str(self.binaries / name), *args], self.logs / f"{name}.log")
        self.processes.append(process)
        if self.on_spawn:
            self.on_spawn(process)

    def _start_etcd(self) -> None:
        peer = free_port()
        self._spawn(
            "etcd", "--name=default", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync=true", "--log-level=warn",
        )

    def _network_flags(self) -> list[str]:
        if not self.real_node:
            # Loopback only; nothing needs the `kubernetes` Service's endpoints.
            return ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                    "--endpoint-reconciler-type=none"]
        c = self.certs
        # Pods reach the API through the `kubernetes` Service (endpoint: the node's IP); the
        # API server reaches the kubelet (logs, exec) as an admin client, at its InternalIP.
        return ["--bind-address=0.0.0.0", f"--advertise-address={self.node_ip}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--kubelet-client-certificate={c / 'admin.crt'}",
                f"--kubelet-client-key={c / 'admin.key'}"]

    @property
    def audit_log(self) -> Path:
        """One JSON line per request the API server answered (who, verb, resource, agent)."""
        return self.logs / "audit.log"

    def requests_from(self, user_agents: tuple[str, ...], since: float = 0.0) -> list[dict]:
        """The audit events of requests whose User-Agent starts with one of `user_agents`,
        received at or after the Unix time `since`."""
        found = {}
        for line in self.audit_log.read_text().splitlines():
            event = json.loads(line)
            received = datetime.datetime.fromisoformat(
                event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
            if event.get("userAgent", "").startswith(user_agents) and received >= since:
                found[event["auditID"]] = event  # a watch is logged when it starts and ends
        return list(found.values())

    def _write_audit_policy(self) -> Path:
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text("apiVersion: audit.k8s.io/v1\nkind: Policy\n"
                          "omitStages: [RequestReceived]\nrules:\n  - level: Metadata\n")
        return policy

    def _start_apiserver(self) -> None:
        c = self.certs
        self._spawn(
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            *self._network_flags(),
            f"--secure-port={self.api_port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={c / 'apiserver.crt'}", f"--tls-private-key-file={c / 'apiserver.key'}",
            f"--client-ca-file={c / 'ca.crt'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={c / 'sa.pub'}",
            f"--service-account-signing-key-file={c / 'sa.key'}",
            "--authorization-mode=RBAC", "--allow-privileged=true", "--profiling=false",
            f"--audit-policy-file={self._write_audit_policy()}",
            f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
            "--audit-log-maxbackup=0",
        )

    def _start_controllers(self) -> None:
        c = self.certs
        common = [f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
                  "--bind-address=127.0.0.1"]
        self._spawn(
            "kube-controller-manager", *common, f"--secure-port={free_port()}",
            f"--cert-dir={self.workdir / 'controller-manager-certs'}",
            f"--service-account-private-key-file={c / 'sa.key'}",
            f"--root-ca-file={c / 'ca.crt'}", "--use-service-account-credentials=false",
            # Fast reactions for tests. kwok posts its nodes' status about every 65 s: a
            # shorter grace had the node controller mark them NotReady every minute, and every
            # pod on them with them, which kwok does not make Ready again.
            "--concurrent-gc-syncs=10",
            f"--node-monitor-grace-period={'60s' if self.real_node else '1h'}",
        )
        self._spawn(
            "kube-scheduler", *common, f"--secure-port={free_port()}",
            f"--cert-dir={self.workdir / 'scheduler-certs'}",
        )
        if not self.real_node:
            self._start_kwok()

    def _start_kwok(self) -> None:
        config = self.workdir / "kwok.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1", "kind": "KwokConfiguration",
            "options": {"manageAllNodes": False,
                        "manageNodesWithAnnotationSelector": "kwok.x-k8s.io/node=fake"},
        }))
        self._spawn(
            "kwok", f"--kubeconfig={self.kubeconfig}", f"--config={config}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--server-address=127.0.0.1:{free_port()}",
            "--cidr=10.244.0.1/16", "--node-ip=10.0.0.2",
        )

    # ---------------------------------------------------------------- API access

    def _write_kubeconfig(self) -> None:
        c = self.certs
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "asyncrl-test",
            "clusters": [{"name": "asyncrl-test", "cluster": {
                "server": self.server, "certificate-authority": str(c / "ca.crt")}}],
            "users": [{"name": "admin", "user": {
                "client-certificate": str(c / "admin.crt"), "client-key": str(c / "admin.key")}}],
            "contexts": [{"name": "asyncrl-test",
                          "context": {"cluster": "asyncrl-test", "user": "admin"}}],
        }))

    def api_client(self):
        """A kubernetes.client.ApiClient authenticated as cluster admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def _get(self, path: str) -> tuple[int, str]:
        context = ssl.create_default_context(cafile=str(self.certs / "ca.crt"))
        context.load_cert_chain(self.certs / "admin.crt", self.certs / "admin.key")
        try:
            with urllib.request.urlopen(f"{self.server}{path}", context=context,
                                        timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except OSError as exc:
            return 0, str(exc)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            status, body = self._get("/readyz")
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"kube-apiserver not ready after {timeout}s: {body[-500:]}")
            time.sleep(0.5)

    def _create_nodes(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.api_client())
        for i in range(self.cpu_nodes):
            core.create_node(_node(f"kwok-cpu-{i}", {"node-pool": "cpu"}, gpus=0))
        for i in range(self.gpu_nodes):
            core.create_node(_node(f"kwok-gpu-{i}", GPU_POOL_LABEL, gpus=GPUS_PER_NODE,
                                   taints=[GPU_TAINT]))

    def _wait_nodes_ready(self, timeout: float) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.api_client())
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            nodes = core.list_node().items
            ready = [n for n in nodes if any(c.type == "Ready" and c.status == "True"
                                             for c in n.status.conditions or [])]
            if nodes and len(ready) == len(nodes):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"kwok nodes not Ready after {timeout}s")
            time.sleep(0.5)

    def _wait_default_service_account(self, timeout: float) -> None:
        """Pods are admitted only once the service-account controller made `default`."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        core = client.CoreV1Api(self.api_client())
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                core.read_namespaced_service_account("default", "default")
                return
            except ApiException as exc:
                if exc.status != 404 or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)


def _node(name: str, labels: dict[str, str], *, gpus: int, taints=()) -> dict:
    capacity = {"cpu": "32", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64", **labels},
        },
        "spec": {"taints": list(taints)},
        # kwok fills in conditions, addresses and nodeInfo.
        "status": {"capacity": capacity, "allocatable": capacity},
    }
