"""The test control plane's harness itself: pinned versions, and a clear failure (never a
silent skip) when the binaries are not built."""

from __future__ import annotations

import re

import pytest

from cluster.control_plane import BUILD_SCRIPT, ControlPlane, ControlPlaneMissing
from support import ROOT


def test_missing_binaries_fail_with_the_build_command(tmp_path):
    plane = ControlPlane(tmp_path / "work", binaries=tmp_path / "empty")
    with pytest.raises(ControlPlaneMissing) as caught:
        plane.start()
    assert f"bash {BUILD_SCRIPT}" in str(caught.value)
    assert "kube-apiserver" in str(caught.value)
    assert not plane.processes


def test_one_pinned_release_everywhere():
    script = BUILD_SCRIPT.read_text()
    k8s = re.search(r"^K8S_VERSION=v(1\.\d+\.\d+)$", script, re.M).group(1)
    etcd = re.search(r"^ETCD_VERSION=(v3\.\d+\.\d+)$", script, re.M).group(1)
    go_mod = (ROOT / "tests" / "cluster" / "go" / "go.mod").read_text()
    assert f"k8s.io/kubernetes v{k8s}" in go_mod
    assert f"go.etcd.io/etcd/server/v3 {etcd}" in go_mod
    staging = re.findall(r"^\s+(k8s\.io/[a-z-]+) => (k8s\.io/[a-z-]+) (v\S+)$", go_mod, re.M)
    assert len(staging) > 25
    for source, target, version in staging:
        assert source == target and version == "v0." + k8s.split(".", 1)[1], (source, version)
