"""RLJob status, recomputed from observation every time (a pure function, tested alone).

`asyncrl.operator.observe` observes the children (replicas ready per workload, trainer pods'
restarts), the buffer's statistics and the trainer's status, and `compute_status` turns that,
the spec and the previous status into the new status: a phase, typed conditions with reasons,
observedGeneration and the training figures. `observe.write_status` writes it only when it
differs from what is stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from asyncrl.model.hub import PERMANENT_EXIT
from asyncrl.operator.builders.model import FETCH_CONTAINER

#: Condition types.
VALID = "Valid"            # the spec passed the operator's validation
READY = "Ready"            # every workload has its desired replicas ready
SUSPENDED = "Suspended"    # spec.suspend: workers at zero, state kept
BUFFER = "BufferReachable"  # the buffer answered GetStats
TRAINER = "TrainerReachable"  # the trainer answered GetStatus
FAILED = "Failed"          # terminal failure (e.g. the trainer keeps crashing)
COMPLETE = "Complete"      # the trainer reached algorithm.maxSteps
ADMITTED = "Admitted"      # Kueue admitted a queued job (kueue.x-k8s.io/queue-name)

#: Reasons.
SPEC_VALID, SPEC_INVALID = "SpecValid", "InvalidSpec"
ALL_READY, NOT_READY, NOT_CREATED = "AllWorkloadsReady", "WorkloadsNotReady", "ChildrenNotCreated"
SUSPENDED_BY_SPEC, RESUMED = "SuspendedBySpec", "NotSuspended"
REACHABLE, UNREACHABLE = "GetStatsAnswered", "GetStatsFailed"
TRAINER_REACHABLE, TRAINER_UNREACHABLE = "GetStatusAnswered", "GetStatusFailed"
NO_FAILURE = "NoFailure"  # a failure's own reason is <Component>Failed (ComponentFailure)
MODEL_FAILED = "ModelDownloadFailed"
DEADLINE_EXCEEDED = "DeadlineExceeded"  # spec.activeDeadlineSeconds
MAX_STEPS, DATA_USED, IN_PROGRESS = "MaxStepsReached", "DatasetUsedUp", "Training"


@dataclass(frozen=True)
class Workload:
    """A workload as observed: `exists` False when it is not (yet) there."""

    component: str
    desired: int
    exists: bool = False
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    #: Its controller has seen its latest spec (status.observedGeneration); until then its
    #: counts are from before a scale, a suspend or a resume, and say nothing of the new spec.
    current: bool = True


def seen_by_controller(observed_generation: int | None, generation: int | None) -> bool:
    """Whether a workload's controller has acted on its latest spec (Workload.current)."""
    return (observed_generation or 0) >= (generation or 0)


@dataclass(frozen=True)
class BufferStats:
    trainer_version: int
    #: The step of the last published weights; the version runs ahead of it after a trainer
    #: restarts from an older checkpoint, so completion is judged by the step.
    trainer_step: int
    accepted_total: int
    consumed_total: int
    staleness_counts: tuple[int, ...] = ()
    #: The trainer announced its last weights: at maxSteps, or when dataset.epochs ran out.
    trainer_finished: bool = False

    @property
    def staleness_mean(self) -> float | None:
        total = sum(self.staleness_counts)
        if not total:
            return None
        return sum(i * n for i, n in enumerate(self.staleness_counts)) / total


@dataclass(frozen=True)
class TrainerStatus:
    """What the trainer reports (TrainerStatusService.GetStatus)."""

    step: int
    phase: str
    #: Of the last step; 0 before the first.
    tokens_per_second: float = 0.0
    #: Mean reward of the last trained batch; meaningless before the first step.
    reward_mean: float = 0.0
    #: Greedy accuracy on held-out prompts; None before the first evaluation.
    eval_accuracy: float | None = None
    #: One standard error of eval_accuracy; None where the trainer does not report it.
    eval_stderr: float | None = None
    #: Seconds it has waited for batches, over its life (the autoscaler's signal).
    waited_seconds_total: float = 0.0


@dataclass(frozen=True)
class ComponentFailure:
    """A component whose pods failed (restarted past spec.backoffLimit, or ended Failed)."""

    component: str
    message: str

    @property
    def reason(self) -> str:
        """TrainerFailed, RolloutFailed, RewardFailed, BufferFailed or RedisFailed."""
        return f"{self.component.capitalize()}Failed"


@dataclass(frozen=True)
class Observation:
    generation: int | None
    suspend: bool
    max_steps: int
    workloads: tuple[Workload, ...] = ()
    invalid: str | None = None          # validation message, when the spec is invalid
    failure: ComponentFailure | None = None  # a component whose pods keep failing
    model_failure: str | None = None    # why the trainer pods could not download the model
    #: spec.activeDeadlineSeconds (None: no deadline).
    active_deadline_seconds: int | None = None
    stats: BufferStats | None = None
    stats_error: str | None = None
    trainer: TrainerStatus | None = None
    trainer_error: str | None = None
    #: accepted samples per second since the previous observation (the operator's
    #: `state.JobRegistry` keeps the previous count in memory), None when unknown.
    samples_per_second: float | None = None
    now: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    #: status.autoscaling as asyncrl.operator.autoscaling decided it (None: no autoscale),
    #: and the Events its decision posts.
    autoscaling: dict[str, Any] | None = None
    autoscaling_events: tuple = ()
    #: Kueue's word on a queued job (asyncrl.operator.kueue.Admission; None: not queued).
    queue: Any = None


def compute_status(observed: Observation, previous: dict[str, Any] | None) -> dict[str, Any]:
    """The new status (camelCase, as stored). Unknown figures keep their previous value."""
    previous = previous or {}
    conditions: list[tuple[str, bool, str, str]] = []

    failure = None
    if observed.invalid is not None:
        conditions.append((VALID, False, SPEC_INVALID, observed.invalid))
        phase = "Failed"
    else:
        conditions.append((VALID, True, SPEC_VALID, "The spec is valid."))
        failure = _failure(observed, previous)
        phase = _phase(observed, conditions, failure)

    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": observed.generation,
        "conditions": _conditions(conditions, previous.get("conditions") or [], observed),
        "failure": failure,
        **_times(observed, previous, phase),
    }
    rollout = next((w for w in observed.workloads if w.component == "rollout"), None)
    if rollout is not None:
        status["rolloutReplicas"] = rollout.replicas
        status["rolloutReadyReplicas"] = rollout.ready
    status["autoscaling"] = observed.autoscaling
    status["queue"] = observed.queue.as_status() if observed.queue is not None else None
    for key in _FIGURES:
        if previous.get(key) is not None:
            status[key] = previous[key]
    if observed.stats is not None:
        status["policyVersion"] = observed.stats.trainer_version
        # The step of the last published weights: known even when the trainer, done, has
        # exited before it was asked.
        status["trainerStep"] = observed.stats.trainer_step
        if observed.stats.staleness_mean is not None:
            status["stalenessMean"] = round(observed.stats.staleness_mean, 3)
    if observed.samples_per_second is not None:
        status["samplesPerSecond"] = round(observed.samples_per_second, 2)
    trainer = observed.trainer
    if trainer is not None:
        # The trainer counts a step before publishing it.
        published = observed.stats.trainer_step if observed.stats is not None else 0
        status["trainerStep"] = max(trainer.step, published)
        if trainer.step > 0:  # before the first step the trainer reports zeros
            status["tokensPerSecond"] = round(trainer.tokens_per_second, 1)
            status["rewardMean"] = round(trainer.reward_mean, 4)
        if trainer.eval_accuracy is not None:
            status["evalAccuracy"] = round(trainer.eval_accuracy, 4)
        if trainer.eval_stderr is not None:
            status["evalStderr"] = round(trainer.eval_stderr, 4)
    return status


#: Training figures; an observation that cannot see them keeps the previous values.
_FIGURES = ("policyVersion", "trainerStep", "tokensPerSecond", "samplesPerSecond",
            "stalenessMean", "rewardMean", "evalAccuracy", "evalStderr")


def _finished(observed: Observation) -> tuple[bool, bool]:
    """(maxSteps reached, the dataset's epochs used up first)."""
    stats = observed.stats
    reached = stats is not None and stats.trainer_step >= observed.max_steps
    # A job with dataset.epochs may end before maxSteps: its trainer announces the end.
    used_up = stats is not None and stats.trainer_finished and not reached
    return reached, used_up


def _failure(observed: Observation, previous: dict[str, Any]) -> dict[str, Any] | None:
    """status.failure: what failed the job. Terminal: kept (the workers stopped, so what
    caused it is no longer observed) until the spec changes (metadata.generation)."""
    kept = previous.get("failure")
    if kept and kept.get("generation") == observed.generation:
        return kept
    # A finished job stays Succeeded: its trainer exits once done and the StatefulSet restarts it.
    if any(_finished(observed)):
        return None
    found = None
    if observed.model_failure:
        found = (MODEL_FAILED, "trainer", observed.model_failure)
    elif observed.failure:
        found = (observed.failure.reason, observed.failure.component, observed.failure.message)
    elif observed.active_deadline_seconds and previous.get("startTime") and not observed.suspend \
            and not _queued(observed):
        started = parse_stamp(previous["startTime"])
        elapsed = (observed.now - started).total_seconds()
        if elapsed >= observed.active_deadline_seconds:
            found = (DEADLINE_EXCEEDED, "job",
                     f"The job ran {elapsed:.0f} s since {previous['startTime']}, past "
                     f"activeDeadlineSeconds {observed.active_deadline_seconds}.")
    if found is None:
        return None
    reason, component, message = found
    return {"reason": reason, "component": component,
            "message": f"{message} Its workers are stopped and its state kept; change the "
            "spec to start them again.", "generation": observed.generation}


def _queued(observed: Observation) -> bool:
    """Whether the job waits for Kueue (queued, not admitted): its deadline does not run."""
    return observed.queue is not None and not observed.queue.admitted


def _times(observed: Observation, previous: dict[str, Any], phase: str) -> dict[str, Any]:
    """startTime (activeDeadlineSeconds counts from it; a suspend clears it, so a resumed job
    counts again, as a Job does) and completionTime (ttlSecondsAfterFinished counts from it)."""
    stamp = observed.now.strftime(STAMP)
    start = previous.get("startTime")
    if phase in ("Suspended", "Queued"):
        start = None
    elif start is None and phase in ("Starting", "Running"):
        start = stamp
    finished = phase in ("Succeeded", "Failed")
    completion = (previous.get("completionTime") or stamp) if finished else None
    return {"startTime": start, "completionTime": completion}


#: How status writes a time (startTime, completionTime, lastScaleTime, conditions').
STAMP = "%Y-%m-%dT%H:%M:%SZ"


def parse_stamp(text: str) -> datetime:
    """A time as status writes it (STAMP), in UTC."""
    return datetime.strptime(text, STAMP).replace(tzinfo=timezone.utc)


def _phase(observed: Observation, conditions: list, failure: dict[str, Any] | None) -> str:
    reached, used_up = _finished(observed)
    done = reached or used_up
    if failure is not None:
        conditions.append((FAILED, True, failure["reason"], failure["message"]))
        return "Failed"
    conditions.append((FAILED, False, NO_FAILURE, "No component has failed."))

    if observed.stats is not None:
        conditions.append((BUFFER, True, REACHABLE,
                           f"Policy version {observed.stats.trainer_version}, "
                           f"{observed.stats.accepted_total} samples accepted."))
    else:
        conditions.append((BUFFER, False, UNREACHABLE,
                           observed.stats_error or "The buffer has not answered yet."))
    if observed.trainer is not None:
        conditions.append((TRAINER, True, TRAINER_REACHABLE,
                           f"Step {observed.trainer.step} of {observed.max_steps} "
                           f"({observed.trainer.phase.replace('_', ' ')})."))
    else:
        conditions.append((TRAINER, False, TRAINER_UNREACHABLE,
                           observed.trainer_error or "The trainer has not answered yet."))
    published = (f"Step {observed.stats.trainer_step if observed.stats else 0}"
                 f" of {observed.max_steps} published.")
    if used_up:
        conditions.append((COMPLETE, True, DATA_USED,
                           f"{published} The dataset's epochs are used up."))
    else:
        conditions.append((COMPLETE, done, MAX_STEPS if done else IN_PROGRESS, published))

    missing = [w.component for w in observed.workloads if not w.exists]
    waiting = [w for w in observed.workloads
               if w.exists and (not w.current or w.ready < w.desired or w.replicas > w.desired)]
    if missing:
        conditions.append((READY, False, NOT_CREATED, f"Not created yet: {', '.join(missing)}."))
    elif waiting:
        conditions.append((READY, False, NOT_READY, "; ".join(
            f"{w.component} {w.ready}/{w.desired} ready"
            + ("" if w.current else ", its new spec not yet seen by its controller")
            for w in waiting) + "."))
    else:
        conditions.append((READY, True, ALL_READY, "Every workload has its replicas ready."))

    if observed.suspend:
        conditions.append((SUSPENDED, True, SUSPENDED_BY_SPEC,
                           "Workers are scaled to zero; Redis and the run volume keep the state."))
    else:
        conditions.append((SUSPENDED, False, RESUMED, "The job is not suspended."))

    queue = observed.queue
    if queue is not None:
        conditions.append((ADMITTED, queue.admitted, queue.reason, queue.message))

    if done:
        return "Succeeded"
    if observed.suspend:
        return "Suspended"
    if _queued(observed):
        return "Queued"
    if len(missing) == len(observed.workloads):
        return "Pending"
    if missing or waiting:
        return "Starting"
    return "Running"


def _conditions(found: list[tuple[str, bool, str, str]], previous: list[dict],
                observed: Observation) -> list[dict[str, Any]]:
    """Kubernetes conditions; lastTransitionTime only moves when the status flips."""
    before = {c.get("type"): c for c in previous}
    stamp = observed.now.strftime(STAMP)
    out = []
    for kind, value, reason, message in found:
        status = "True" if value else "False"
        old = before.get(kind)
        changed = old is None or old.get("status") != status
        out.append({
            "type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": stamp if changed else old.get("lastTransitionTime", stamp),
            "observedGeneration": observed.generation,
        })
    return out


def status_changes(current: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The top-level status keys whose value differs (what to patch; empty: write nothing)."""
    current = current or {}
    return {key: value for key, value in new.items() if current.get(key) != value}


#: The components whose pods spec.backoffLimit counts, in the order a failure is named.
FAILING_COMPONENTS = ("trainer", "rollout", "reward", "buffer", "redis")
#: How many of a failed container's last log lines (its termination message) a failure quotes.
LOG_LINES = 8


def component_failure(pods: list[dict[str, Any]], backoff_limit: int) -> ComponentFailure | None:
    """The first component (FAILING_COMPONENTS) whose pods (dicts as the API returns them, all
    of the job's) restarted their containers more than `backoff_limit` times in all, or one
    of whose pods ended Failed. Exit code 0 is not a failure (a trainer that finished exits).
    A pod being deleted (a suspend, a rollout of new pods) is not counted."""
    by_component: dict[str, list[dict]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        component = (meta.get("labels") or {}).get("app.kubernetes.io/component", "")
        by_component.setdefault(component, []).append(pod)
    for component in FAILING_COMPONENTS:
        found = _failed(component, by_component.get(component, []), backoff_limit)
        if found is not None:
            return ComponentFailure(component, found)
    return None


def _failed(component: str, pods: list[dict[str, Any]], backoff_limit: int) -> str | None:
    restarts, last = 0, None  # last: (pod, its container's last termination), not exit 0
    for pod in pods:
        name = pod.get("metadata", {}).get("name", component)
        status = pod.get("status") or {}
        if status.get("phase") == "Failed":
            why = status.get("reason") or status.get("message") or "its container exited"
            return f"{component} pod {name} failed: {why}."
        for container in status.get("containerStatuses") or []:
            restarts += container.get("restartCount", 0)
            terminated = (container.get("lastState") or {}).get("terminated") or {}
            if terminated and terminated.get("exitCode") != 0:
                last = (name, terminated)
    if restarts <= backoff_limit or last is None:
        return None
    name, terminated = last
    code = terminated.get("exitCode")
    message = (f"{component} pods restarted {restarts} times, more than backoffLimit "
               f"{backoff_limit}; pod {name} last exited: {terminated.get('reason') or 'error'}"
               f"{f', code {code}' if code is not None else ''}.")
    lines = (terminated.get("message") or "").strip().splitlines()[-LOG_LINES:]
    if lines:
        message += " Its last log lines:\n" + "\n".join(lines)
    return message


def model_failure(pods: list[dict[str, Any]], max_restarts: int) -> str | None:
    """Why the trainer pods cannot download the job's Hub model, from their init container's
    last exit: at once when the Hub refused it (no such model or revision, gated), after
    `max_restarts` tries when it could not be reached. The reason is its termination message
    (the download's last line)."""
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        for container in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if container.get("name") != FETCH_CONTAINER:
                continue
            exits = [(container.get(key) or {}).get("terminated") or {}
                     for key in ("state", "lastState")]
            failed = next((e for e in exits if e.get("exitCode") not in (None, 0)), None)
            if failed is None:
                continue
            if failed["exitCode"] == PERMANENT_EXIT or \
                    container.get("restartCount", 0) >= max_restarts:
                lines = (failed.get("message") or "").strip().splitlines()
                why = lines[-1] if lines else f"exit code {failed['exitCode']}"
                return f"downloading the model failed: {why}"
    return None
