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


class RLJobStatus(SpecModel):
    """Observed state, written by the operator."""

    # Written by the system, not by users; tolerate fields other tools (kopf) keep here.
    model_config = ConfigDict(extra="ignore")

    phase: Literal["Pending", "Starting", "Running", "Suspended", "Succeeded", "Failed"] = Field(
        default="Pending",
        description="Lifecycle phase of the job: Pending (nothing created yet), Starting "
        "(children created, not all ready), Running, Suspended, Succeeded or Failed.",
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
