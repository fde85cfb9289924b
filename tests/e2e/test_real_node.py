"""Real pods on the real one-node cluster (fixture `real_node`, tests/cluster/node.py):
containers run from the registry-free base image, their logs come back through the API, a
ClusterIP Service routes by its DNS name through CoreDNS and kube-proxy, and a pod reads the
API through the `kubernetes` Service with its service-account token."""

from __future__ import annotations

import json
import uuid

import pytest
from kubernetes import client

from cluster.node import BASE_IMAGE
from support.waiting import wait_for

pytestmark = pytest.mark.real_node


@pytest.fixture
def core(real_node):
    return client.CoreV1Api(real_node.api_client())


@pytest.fixture
def namespace(real_node, core):
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


def pod(name: str, script: str, **spec) -> dict:
    """A pod of the base image running `python3 -c script`."""
    container = {"name": "main", "image": BASE_IMAGE, "imagePullPolicy": "Never",
                 "command": ["python3", "-c", script]}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [container], **spec}}


def wait_for_pod(core, namespace: str, name: str, done, timeout: float = 60):
    """Poll until `done(pod)` and return the pod; on timeout, fail with the pod's status."""
    current = None

    def check():
        nonlocal current
        current = core.read_namespaced_pod(name, namespace)
        return current if done(current) else None

    return wait_for(check, timeout, f"pod {namespace}/{name} to be {done.__name__}",
                    lambda: f"still {current.status.phase}: {current.status}", every=0.3)


def finished(current) -> bool:
    return current.status.phase in ("Succeeded", "Failed")


def ready(current) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in current.status.conditions or [])


def run_to_completion(core, namespace: str, name: str, script: str, **spec):
    core.create_namespaced_pod(namespace, pod(name, script, **spec))
    current = wait_for_pod(core, namespace, name, finished)
    return current, core.read_namespaced_pod_log(name, namespace)


def test_a_pod_runs_python_and_its_logs_and_exit_code_come_back(core, namespace):
    script = ("import platform, sys; print('answer', 6 * 7); "
              "print('python', platform.python_version()); sys.exit(int(sys.argv[1]))")
    done, logs = run_to_completion(core, namespace, "ok", script,
                                   container={"args": ["0"]})
    assert done.status.phase == "Succeeded", logs
    assert "answer 42" in logs
    assert "python 3.11." in logs
    assert done.spec.node_name == "asyncrl-node"

    failed, _ = run_to_completion(core, namespace, "fails", script, container={"args": ["3"]})
    assert failed.status.phase == "Failed"
    assert failed.status.container_statuses[0].state.terminated.exit_code == 3


SERVER = """
import http.server, socket
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = socket.gethostname().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("", 8080), Handler).serve_forever()
"""

CLIENT = """
import json, socket, sys, time, urllib.request
host = sys.argv[1]
deadline = time.monotonic() + 30
while True:
    try:
        body = urllib.request.urlopen(f"http://{host}/", timeout=3).read().decode()
        break
    except OSError as exc:
        # Until kube-proxy has programmed the Service: refused (never a stray answer).
        if time.monotonic() > deadline:
            raise
        time.sleep(0.3)
print(json.dumps({"address": socket.gethostbyname(host), "body": body}))
"""


def test_a_pod_reaches_another_through_a_service_by_its_dns_name(real_node, core, namespace):
    server = pod("echo-server", SERVER, restartPolicy="Always", container={
        "ports": [{"containerPort": 8080}],
        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}})
    core.create_namespaced_pod(namespace, server)
    service = core.create_namespaced_service(namespace, {
        "metadata": {"name": "echo"},
        "spec": {"selector": {"app": "echo-server"},
                 "ports": [{"port": 80, "targetPort": 8080}]}})
    wait_for_pod(core, namespace, "echo-server", ready)
    real_node.wait_for_endpoints(namespace, "echo")

    host = f"echo.{namespace}.svc"
    done, logs = run_to_completion(core, namespace, "client", CLIENT, container={"args": [host]})
    assert done.status.phase == "Succeeded", logs
    answer = json.loads(logs.strip().splitlines()[-1])
    assert answer["address"] == service.spec.cluster_ip   # CoreDNS resolved the Service
    assert answer["body"] == "echo-server"                 # and kube-proxy reached its pod


API_READER = """
import json, ssl, urllib.request
secrets = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{secrets}/token").read()
context = ssl.create_default_context(cafile=f"{secrets}/ca.crt")
def call(path, body=None):
    request = urllib.request.Request(
        "https://kubernetes.default.svc" + path, method="POST" if body else "GET",
        data=json.dumps(body).encode() if body else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, context=context, timeout=10))
review = call("/apis/authentication.k8s.io/v1/selfsubjectreviews",
              {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
print(json.dumps({"user": review["status"]["userInfo"]["username"],
                  "version": call("/version")["gitVersion"]}))
"""


def test_a_pod_reads_the_api_with_its_service_account_token(core, namespace):
    done, logs = run_to_completion(core, namespace, "api-reader", API_READER)
    assert done.status.phase == "Succeeded", logs
    answer = json.loads(logs.strip().splitlines()[-1])
    # TLS verified against the cluster CA, and the token authenticated as this pod's account.
    assert answer == {"user": f"system:serviceaccount:{namespace}:default",
                      "version": "v1.34.4"}


def test_missing_prerequisites_fail_with_the_command_that_provides_them(tmp_path):
    from cluster.node import NODE_SCRIPT, NodeMissing, RealCluster

    cluster = RealCluster(tmp_path / "work", binaries=tmp_path / "empty")
    with pytest.raises(NodeMissing) as caught:
        cluster.start()
    assert f"bash {NODE_SCRIPT} prepare" in str(caught.value)
    assert "kubelet" in str(caught.value)
    assert cluster.plane is None and cluster.state is None
