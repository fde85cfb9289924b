"""What the operator writes under an RLJob's status."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import ConfigDict, Field

from asyncrl.spec.base import SpecModel

# --------------------------------------------------------------------------- status


class Condition(SpecModel):
    """A Kubernetes-style condition."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="Condition type, e.g. Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="Human-readable details.")
    last_transition_time: datetime | None = Field(
        default=None, description="When status last changed."
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the condition was computed from."
    )


class AutoscalingStatus(SpecModel):
    """What the rollout autoscaler (spec.rollout.autoscale) decided last, and from what."""

    model_config = ConfigDict(extra="ignore")

    active: bool = Field(
        default=True, description="Whether the autoscaler sets the rollout replicas now: false "
        "once spec.rollout.replicas changed by hand (kubectl scale), until the autoscale section "
        "changes.")
    replicas: int = Field(description="The rollout replicas it wants.")
    spec_replicas: int = Field(
        description="spec.rollout.replicas when it took over; a different value there is a scale "
        "by hand.")
    spec_hash: str = Field(description="The autoscale section it runs with.")
    reason: str = Field(default="", description="CamelCase reason of the last decision.")
    message: str = Field(default="", description="The last decision, in words, with its signals.")
    last_scale_time: datetime | None = Field(
        default=None, description="When it last changed the replicas.")
    trainer_idle: float | None = Field(
        default=None, description="The share of the last window the trainer waited for a batch.")
    rollout_busy: float | None = Field(
        default=None, description="The mean share of the last window a rollout engine generated.")
    demand: float | None = Field(
        default=None, description="Wanted over current rollout replicas (the scaling signal).")


class FailureStatus(SpecModel):
    """What failed the job (spec.backoffLimit, activeDeadlineSeconds, a model download)."""

    model_config = ConfigDict(extra="ignore")

    reason: str = Field(description="CamelCase reason, e.g. RolloutFailed or DeadlineExceeded.")
    component: str = Field(description="The component that failed, or job for a deadline.")
    message: str = Field(description="What happened, with the failed container's last log lines.")
    generation: int | None = Field(
        default=None, description="metadata.generation it failed at: the job stays Failed, its "
        "workers stopped, until the spec changes.")


class QueueStatus(SpecModel):
    """Kueue admission of a job labelled kueue.x-k8s.io/queue-name."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(description="The LocalQueue the job waits in (its label).")
    workload: str = Field(description="The Kueue Workload that asks for the workers' pods.")
    admitted: bool = Field(
        default=False, description="Whether Kueue admitted it: until then, and once it is "
        "evicted or finished, the workers are at zero.")
    cluster_queue: str | None = Field(
        default=None, description="The ClusterQueue whose quota admitted it.")


class RLJobStatus(SpecModel):
    """Observed state, written by the operator."""

    # Written by the system, not by users; tolerate fields other tools (kopf) keep here.
    model_config = ConfigDict(extra="ignore")

    phase: Literal["Pending", "Queued", "Starting", "Running", "Suspended", "Succeeded",
                   "Failed"] = Field(
        default="Pending",
        description="Lifecycle phase of the job: Pending (nothing created yet), Queued (waiting "
        "for Kueue to admit it), Starting (children created, not all ready), Running, "
        "Suspended, Succeeded or Failed.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Latest observations of the job's state.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation this status reflects."
    )
    policy_version: int | None = Field(
        default=None, description="Policy version the trainer has published."
    )
    rollout_replicas: int | None = Field(
        default=None,
        description="Rollout worker pods that exist (the scale subresource's status replicas).",
    )
    rollout_ready_replicas: int | None = Field(
        default=None, description="Rollout worker pods that are ready."
    )
    failure: FailureStatus | None = Field(
        default=None, description="What failed the job, while it is Failed."
    )
    start_time: datetime | None = Field(
        default=None, description="When the job started, or last resumed from suspend "
        "(activeDeadlineSeconds counts from it)."
    )
    completion_time: datetime | None = Field(
        default=None, description="When the job succeeded or failed (ttlSecondsAfterFinished "
        "counts from it)."
    )
    autoscaling: AutoscalingStatus | None = Field(
        default=None, description="The rollout autoscaler's last decision (rollout.autoscale)."
    )
    queue: QueueStatus | None = Field(
        default=None, description="Kueue admission, for a job labelled "
        "kueue.x-k8s.io/queue-name."
    )
    trainer_step: int | None = Field(
        default=None, description="Training steps completed, as the trainer reports them."
    )
    tokens_per_second: float | None = Field(
        default=None, description="Trained tokens per second of the trainer's last step."
    )
    samples_per_second: float | None = Field(
        default=None, description="Accepted samples per second (recent average)."
    )
    staleness_mean: float | None = Field(
        default=None, description="Mean policy-version lag of recently trained tokens."
    )
    reward_mean: float | None = Field(
        default=None, description="Mean reward of the last batch the trainer trained on."
    )
    eval_accuracy: float | None = Field(
        default=None, description="Latest evaluation accuracy (greedy, held-out prompts)."
    )
    eval_stderr: float | None = Field(
        default=None, description="One standard error (binomial) of evalAccuracy."
    )
