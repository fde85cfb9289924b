"""A real Kueue controller manager beside the test control plane (tests/cluster/control_plane.py),
from the binary and CRDs tests/cluster/build.sh builds.

`Kueue(plane, workdir).start()` installs Kueue's CRDs (every one: its controllers watch them
all), gives it the control plane's serving certificate where it reads one, and runs
`kueue --config` out of the cluster against the admin kubeconfig: no leader election, no
internal certificate management (it would wait for a Secret mounted into its pod), no metrics
or visibility servers, and only the batch/job integration (which touches only Jobs with a queue
label: none here). No webhook configuration is installed: Kueue's controllers add their own
finalizers, and the CRDs' own defaults and validation rules apply without one. The manager
then admits Workloads exactly as in a cluster.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from cluster.control_plane import BUILD_SCRIPT, ControlPlane, ControlPlaneMissing, spawn
from cluster.control_plane import stop_processes
from support.ports import free_port

#: Kueue reads its metrics certificate from this fixed path, even with metrics off.
METRICS_CERTS = Path("/etc/kueue/metrics/certs")


class Kueue:
    def __init__(self, plane: ControlPlane, workdir: Path):
        self.plane, self.workdir = plane, Path(workdir)
        self.binary = plane.binaries / "kueue"
        self.crds = plane.binaries / "kueue-crds"
        self.health_port = free_port()
        self.processes: list = []

    def start(self, timeout: float = 120.0) -> Kueue:
        if not self.binary.exists() or not self.crds.is_dir():
            raise ControlPlaneMissing(
                f"Kueue is missing from {self.plane.binaries} (kueue, kueue-crds). Build it "
                f"(cached) with: bash {BUILD_SCRIPT}")
        try:
            METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        except PermissionError:
            raise ControlPlaneMissing(
                f"Kueue reads a certificate from {METRICS_CERTS}, which this user may not "
                "create: run the tests as root (as CI does), or create it writable") from None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._install_crds(timeout)
        # Any serving certificate for 127.0.0.1 will do (nothing calls these servers): the
        # control plane's own.
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        for folder in (certs, METRICS_CERTS):
            for name, source in (("tls.crt", "apiserver.crt"), ("tls.key", "apiserver.key")):
                (folder / name).write_bytes((self.plane.certs / source).read_bytes())
        config = self.workdir / "kueue.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": "kueue-system",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": free_port(), "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": ["batch/job"]},
            "featureGates": {"VisibilityOnDemand": False},
        }))
        self.processes.append(spawn("kueue", [
            str(self.binary), f"--config={config}", f"--kubeconfig={self.plane.kubeconfig}",
            "--zap-log-level=2"], self.workdir / "kueue.log"))
        self._wait_ready(timeout)
        return self

    def stop(self) -> None:
        stop_processes(self.processes, 10)
        self.processes.clear()

    def tail(self, chars: int = 4000) -> str:
        return self.processes[0].tail(chars) if self.processes else ""

    def check_alive(self) -> None:
        for process in self.processes:
            if process.popen.poll() is not None:
                raise RuntimeError(f"kueue exited with {process.popen.returncode}:\n"
                                   f"{process.tail()}")

    def _install_crds(self, timeout: float) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        ext = client.ApiextensionsV1Api(self.plane.api_client())
        names = []
        for path in sorted(self.crds.glob("*.yaml")):
            definition = yaml.safe_load(path.read_text())
            names.append(definition["metadata"]["name"])
            try:
                ext.create_custom_resource_definition(definition)
            except ApiException as exc:
                if exc.status != 409:  # installed by an earlier module of the session
                    raise
        deadline = time.monotonic() + timeout
        for name in names:
            while not any(c.type == "Established" and c.status == "True" for c in
                          ext.read_custom_resource_definition(name).status.conditions or []):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Kueue's CRD {name} not established after {timeout}s")
                time.sleep(0.25)

    def _wait_ready(self, timeout: float) -> None:
        url = f"http://127.0.0.1:{self.health_port}/readyz"
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"kueue not ready after {timeout}s:\n{self.tail()}")
            time.sleep(0.5)
