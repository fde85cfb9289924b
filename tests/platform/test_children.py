"""Starting children from a process that uses gRPC (asyncrl.platform.children): importing
asyncrl turns gRPC's fork support off before grpc is imported, whoever imports grpc next, so a
Popen with a preexec_fn (a real fork) never waits in gRPC's fork handler (grpc/grpc#37259);
a setting of the user's own is kept."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = ("import os, asyncrl, grpc\n"
         "print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])")


def fork_support(environment: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], env=environment, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.strip()


def test_importing_asyncrl_turns_grpc_fork_support_off_unless_set():
    unset = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    assert fork_support(unset) == "false"
    assert fork_support({**unset, "GRPC_ENABLE_FORK_SUPPORT": "true"}) == "true"


def test_this_test_session_forks_with_it_off():
    """conftest imports asyncrl before any test module imports grpc."""
    assert os.environ.get("GRPC_ENABLE_FORK_SUPPORT") == "false"
