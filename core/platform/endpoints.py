"""The ports every asyncrl service listens on, in one table: the services' settings take their
defaults from it, the operator its container ports, probes, Services and command lines.
(`asyncrl run` gives each service a free port instead, through the same settings.)"""

from __future__ import annotations

#: component -> port name -> number. Rollout workers serve /metrics on their HTTP port.
PORTS: dict[str, dict[str, int]] = {
    "buffer": {"grpc": 50051, "metrics": 9101},
    "reward": {"grpc": 50081, "metrics": 9102},
    "trainer": {"grpc": 50071, "metrics": 9103, "rendezvous": 29400, "weights": 29500},
    "rollout": {"http": 30000, "grpc": 50061, "sglang": 30001},
    "redis": {"redis": 6379},
}


def port(component: str, name: str) -> int:
    return PORTS[component][name]
