"""A job's lifetime rules (asyncrl.operator.lifetime) without a cluster: when a finished job is
due for deletion and a running one past its deadline, and what a failed job's children get."""

from __future__ import annotations

from datetime import datetime, timezone

import yaml

from asyncrl.operator.lifetime import as_applied, due_times, stopped_by_failure
from asyncrl.spec import parse_manifest
from support import ROOT

AT = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)


def job(**spec):
    data = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    data["spec"].update(spec)
    return parse_manifest(data)


def test_due_times_follow_the_status_and_the_spec():
    running = {"phase": "Running", "startTime": "2026-11-29T12:00:00Z"}
    assert due_times(job(), running) == (None, None)
    assert due_times(job(activeDeadlineSeconds=90), running) == (
        None, datetime(2026, 11, 29, 12, 1, 30, tzinfo=timezone.utc))
    done = {"phase": "Succeeded", "startTime": "2026-11-29T12:00:00Z",
            "completionTime": "2026-11-29T13:00:00Z"}
    # A finished job has no deadline; its TTL counts from its completion.
    assert due_times(job(activeDeadlineSeconds=90, ttlSecondsAfterFinished=0), done) == (
        datetime(2026, 11, 29, 13, 0, 0, tzinfo=timezone.utc), None)
    assert due_times(job(ttlSecondsAfterFinished=60), running) == (None, None)


def test_a_failed_job_builds_its_workers_at_zero_until_its_spec_changes():
    spec = job()
    failed = {"metadata": {"generation": 4},
              "status": {"failure": {"reason": "RolloutFailed", "generation": 4}}}
    assert stopped_by_failure(failed)
    assert as_applied(spec, failed).spec.suspend is True
    edited = {**failed, "metadata": {"generation": 5}}
    assert not stopped_by_failure(edited)
    assert as_applied(spec, edited) is spec
    assert not stopped_by_failure({"metadata": {"generation": 1}, "status": {}})
