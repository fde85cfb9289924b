#!/usr/bin/env bash
# A real one-node Kubernetes cluster on this machine (tests/cluster/node.py does the work):
#
#   bash tests/cluster/node.sh prepare   # apt packages, build.sh, base_image.sh (all cached)
#   bash tests/cluster/node.sh up        # prepare, then bring the cluster up in the background;
#                                        # prints the KUBECONFIG to use
#   bash tests/cluster/node.sh status    # kubectl get nodes, pods
#   bash tests/cluster/node.sh down      # stop it and undo its changes to the host
#
# Needs root (containerd, kubelet, iptables) and the project's .venv (scripts/setup.sh). The
# pytest fixture `real_node` (tests/conftest.py) uses the same code; run one or the other.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
if ! [ -x "$python" ]; then
    echo "node.sh: no $python; make the virtual environment with: bash scripts/setup.sh" >&2
    exit 1
fi
exec "$python" "$root/tests/cluster/node.py" "$@"
