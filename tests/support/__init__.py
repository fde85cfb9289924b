"""What several test folders use. tests/ is on sys.path (tests/conftest.py), so a test imports
`from support.x import y`.

- ROOT (here): the repository root.
- ports: free loopback ports (the library's rule).
- waiting: poll a predicate until it holds, with a deadline that only catches a hang.
- tiny_model: the tiny random models tests run on, and their weights as a snapshot file.
- servers: an event loop on a thread and a uvicorn server, on loopback in the test process.
- buffer: the buffer service (in process or as `asyncrl serve buffer`), its stub fixture, groups,
  and the fate of every group of a run from Redis' append-only file.
- reward: the reward service in process, and an HTTP scoring endpoint for http rewards.
- trainer_status: the trainer's status server, what the operator reads its figures from.
- rollout: a torch engine on the tiny model, recomputed log-probs, the workflow's test doubles.
- gate_oracle: the staleness gate's admission rule as plain Python, the buffer script's oracle.
- trainer: the trainer tests' tiny model and reproducible batches.
- operator_cluster: the operator against the kwok control plane (fixtures, process, jobs).
- dashboard: the Grafana dashboard, its PromQL and the metric names the services export.
- prometheus: a real Prometheus, its query API, and what a run must show on the dashboard.
- real_pods: the images and names of the real one-node cluster tests, waiting at its pace.
- sglang_requests: run by SGLang's own python, checks our request bodies against SGLang's code.
"""

from pathlib import Path

#: The repository root.
ROOT = Path(__file__).resolve().parents[2]
