"""Every expression of the Grafana dashboard returns data from a real Prometheus scraping a real
`asyncrl run --metrics` of the tiny job, through the files the run writes for Prometheus."""

import os
import signal
import subprocess
import time

import httpx
import pytest
import yaml

from support.dashboard import expressions, load_dashboard, substitute
from support.ports import free_port
from support.prometheus import (
    ASYNCRL,
    JOB,
    READY,
    TINY,
    Prometheus,
    prometheus_binary,
    stop,
    tail,
)


@pytest.mark.slow
def test_every_dashboard_expression_returns_data_from_a_real_run(tmp_path):
    binary = prometheus_binary()
    queries = [(where, substitute(expr, JOB)) for where, expr in expressions(load_dashboard())]
    # Autoscaled (within one replica: nothing changes), so that the runner serves the
    # autoscaler's signal as the operator does.
    job = yaml.safe_load(TINY.read_text())
    job["spec"]["rollout"]["autoscale"] = {"maxReplicas": 1, "cooldownSeconds": 2}
    job_file = tmp_path / "tiny-autoscaled.yaml"
    job_file.write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    run_log, prometheus_log = tmp_path / "run.log", tmp_path / "prometheus.log"
    env = {**os.environ, "ASYNCRL_EVAL_PROMPTS": "4"}
    run = prometheus = None
    try:
        with run_log.open("w") as out:
            # More steps than the test waits for: it stops the run once every panel has data.
            run = subprocess.Popen([ASYNCRL, "run", str(job_file), "--metrics", "--run-dir",
                                    str(run_dir), "--steps", "500"],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
        config_path = run_dir / "prometheus/prometheus.yml"
        deadline = time.monotonic() + 120
        while not config_path.is_file():
            assert run.poll() is None, tail(run_log)
            assert time.monotonic() < deadline, "asyncrl run --metrics wrote no prometheus.yml"
            time.sleep(0.2)
        assert "prometheus --config.file=" in run_log.read_text()

        # The run's own configuration, scraping every second, its targets file by full path.
        config = yaml.safe_load(config_path.read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        [scrape] = config["scrape_configs"]
        for sd in scrape["file_sd_configs"]:
            sd["files"] = [str(config_path.parent / name) for name in sd["files"]]
            sd["refresh_interval"] = "1s"
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        with prometheus_log.open("w") as out:
            prometheus = subprocess.Popen(
                [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT)
        server = Prometheus(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        while True:
            assert prometheus.poll() is None, tail(prometheus_log)
            try:
                if server.http.get("/-/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "Prometheus not ready:\n" + tail(prometheus_log)
            time.sleep(0.2)

        # Poll until the run did enough for every panel and every expression has data.
        deadline = time.monotonic() + 300
        while True:
            assert run.poll() is None, "asyncrl run stopped:\n" + tail(run_log)
            assert prometheus.poll() is None, "Prometheus stopped:\n" + tail(prometheus_log)
            waiting = [what for expr, what in READY.items() if server.failure(expr)]
            failing = [] if waiting else [
                (where, expr, why) for where, expr in queries if (why := server.failure(expr))]
            if not waiting and not failing:
                break
            if time.monotonic() > deadline:
                targets = server.http.get("/api/v1/targets").json()["data"]["activeTargets"]
                health = {t["labels"].get("service"): t["health"] for t in targets}
                assert not waiting, (f"the run never got to {waiting}; targets {health}\n"
                                     + tail(run_log))
                pytest.fail(f"{len(failing)} of {len(queries)} dashboard expressions have no "
                            f"data (targets {health}):\n" + "\n".join(
                                f"  {where}: {why}: {expr}" for where, expr, why in failing),
                            pytrace=False)
            time.sleep(2)
    finally:
        stop(run, signal.SIGINT, timeout=120)  # the runner stops every service it started
        stop(prometheus, signal.SIGTERM, timeout=30)
