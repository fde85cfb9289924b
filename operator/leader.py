"""Leader election for `asyncrl operator`: of several operator replicas only the holder of a
coordination.k8s.io Lease reconciles; the others wait to take over.

The election itself is the kubernetes client's (`kubernetes.leaderelection`, a Lease lock). It
runs in a background thread; kopf runs in the main thread once this process leads. Losing the
lease (the API server unreachable for longer than the renew deadline, or another replica took
it) stops kopf, and the process exits non-zero so Kubernetes restarts it as a follower: two
operators never reconcile at the same time for longer than the lease allows.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass, field

log = logging.getLogger("asyncrl.operator.leader")


@dataclass(frozen=True)
class LeaseSettings:
    name: str = "asyncrl-operator"
    namespace: str = "default"
    #: Unique per process: the pod name (POD_NAME from the downward API) plus a random suffix,
    #: so a restarted container never mistakes its predecessor's lease for its own.
    identity: str = field(default_factory=lambda: (
        f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"))
    lease_seconds: int = 15
    renew_deadline_seconds: int = 10
    retry_seconds: int = 2


class Leadership:
    """Campaigns for the lease in a daemon thread. `leading` is set once this process holds
    it; `lost` is set when it stops holding it (then `stop_flag` is set too, for kopf)."""

    def __init__(self, settings: LeaseSettings):
        self.settings = settings
        self.leading = threading.Event()
        self.lost = threading.Event()
        self.stop_flag = threading.Event()

    def start(self) -> Leadership:
        from kubernetes.leaderelection import electionconfig, leaderelection
        from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

        s = self.settings
        config = electionconfig.Config(
            LeaseLock(s.name, s.namespace, s.identity),
            lease_duration=s.lease_seconds, renew_deadline=s.renew_deadline_seconds,
            retry_period=s.retry_seconds,
            onstarted_leading=self._on_started, onstopped_leading=self._on_stopped)
        election = leaderelection.LeaderElection(config)
        threading.Thread(target=election.run, name="leader-election", daemon=True).start()
        log.info("campaigning for lease %s/%s as %s", s.namespace, s.name, s.identity)
        return self

    def wait_to_lead(self) -> None:
        """Blocks until this process leads (Ctrl-C or SIGTERM end the wait)."""
        while not self.leading.wait(0.5):  # a timed wait lets signals through
            pass

    def _on_started(self) -> None:
        log.info("leading: lease %s/%s held by %s", self.settings.namespace, self.settings.name,
                 self.settings.identity)
        self.leading.set()
        # The election renews the lease while this callback runs: return once it is lost.
        self.lost.wait()

    def _on_stopped(self) -> None:
        log.error("lost the lease %s/%s; stopping", self.settings.namespace, self.settings.name)
        self.lost.set()
        self.stop_flag.set()
