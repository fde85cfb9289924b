"""The settings of each service process, in one place: `asyncrl serve <service>` derives its
options from them (asyncrl.cli), `serve_command` builds the command lines `asyncrl run` and the
operator start services with, and each service reads them from flags or ASYNCRL_* environment
variables, checked at start-up. Ports default to the one table, asyncrl.platform.endpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from asyncrl.platform.endpoints import port
from asyncrl.platform.outage import DEFAULT_OUTAGE_SECONDS

#: A field that is never a command-line option (a secret comes from the environment).
NOT_A_FLAG = {"flag": False}
#: Seconds a trainer rank waits in a collective before it gives up.
DEFAULT_COLLECTIVE_TIMEOUT = 600.0
#: The first of the user ids the code sandbox runs untrusted programs as (one per slot).
DEFAULT_UID_BASE = 61000
#: Seconds SGLang may take to become healthy (loading weights, capturing CUDA graphs) before
#: the rollout worker gives up; the operator sizes the rollout pods' startup probe from it.
SGLANG_STARTUP_SECONDS = 900.0


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASYNCRL_", extra="forbid")

    job_file: Path = Field(description="The resolved RLJob manifest (YAML) this service runs.")
    redis_url: str | None = Field(
        default=None, description="Redis of the job (redis:// or rediss://)."
    )
    threads: int | None = Field(
        default=None, ge=1, description="torch threads for this process (default: all cores)."
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    outage_seconds: float = Field(
        default=DEFAULT_OUTAGE_SECONDS, gt=0,
        description="How long the service waits out Redis (or the buffer) being unreachable, "
        "retrying with backoff and reporting not ready, before it exits non-zero.",
    )

    @field_validator("job_file")
    @classmethod
    def _job_file_exists(cls, path: Path) -> Path:
        if not path.is_file():
            raise ValueError(f"job file {str(path)!r} does not exist; pass --job-file FILE")
        return path

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url {url!r} must start with redis://, rediss:// or unix://")
        return url


class BufferSettings(ServiceSettings):
    grpc_port: int = Field(default=port("buffer", "grpc"), ge=1, le=65535, description="Buffer gRPC API.")
    metrics_port: int = Field(default=port("buffer", "metrics"), ge=0, le=65535,
                              description="Prometheus; 0 = off.")
    redis_url: str = Field(description="Redis of the job (redis:// or rediss://).")
    redis_password: str | None = Field(default=None, description="From a Secret, never a flag.",
                                       json_schema_extra=NOT_A_FLAG)

class RewardSettings(ServiceSettings):
    grpc_port: int = Field(default=port("reward", "grpc"), ge=1, le=65535, description="Reward gRPC API.")
    metrics_port: int = Field(default=port("reward", "metrics"), ge=0, le=65535,
                              description="Prometheus; 0 = off.")
    workers: int | None = Field(
        default=None, ge=1,
        description="Math verifier processes and sandbox slots (default: the CPU count).")
    sandbox_uid_base: int = Field(
        default=DEFAULT_UID_BASE, ge=1000, le=2**31 - 70000,
        description="When root, sandbox slot i runs programs as uid sandbox_uid_base + i.")

class ComputeSettings(ServiceSettings):
    """A service that computes with torch threads: the rollout worker and the trainer."""

    lend_cores_file: Path | None = Field(
        default=None, description="A file this process shares with the one other computing "
        "process on the machine (asyncrl run: the trainer and its one rollout worker): while "
        "one waits, the other computes with its --threads too (asyncrl.platform.core_lending).")


class RolloutSettings(ComputeSettings):
    http_port: int = Field(default=port("rollout", "http"), ge=1, le=65535,
                           description="SGLang-compatible HTTP API (and /metrics).")
    grpc_port: int = Field(default=port("rollout", "grpc"), ge=1, le=65535,
                           description="RolloutControl gRPC API and its health.")
    max_running_requests: int | None = Field(
        default=None, ge=1,
        description="Engine batch slots (default: this replica's share of "
        "rollout.maxConcurrentRollouts x algorithm.groupSize).",
    )
    max_sequence_length: int | None = Field(
        default=None, ge=16,
        description="Prompt + response cap (default: longest prompt + rollout.maxNewTokens).",
    )
    weights_cache: Path = Field(
        default=Path("/tmp/asyncrl-weights"), description="Where HTTP weight snapshots land."
    )
    poll_seconds: float = Field(default=5.0, gt=0, description="Version re-read interval.")
    buffer_address: str | None = Field(
        default=None, description="host:port of the buffer; when set, the worker runs the "
        "rollout workflow (prompts -> groups -> buffer), otherwise it only serves requests."
    )
    worker: str = Field(default="rollout-0", description="Stable worker name (the pod's name).")
    reward_address: str | None = Field(
        default=None, description="host:port of the reward service; without it, the same "
        "scorer runs in this process (one math-verify worker, one sandbox slot)."
    )
    engine: Literal["torch", "sglang"] | None = Field(
        default=None, description="The engine this process runs (default: the job's "
        "rollout.engine); torch serves the torch engine's SGLang-compatible API."
    )
    sglang_port: int = Field(
        default=port("rollout", "sglang"), ge=1, le=65535,
        description="Loopback port of the SGLang server the worker launches (engine sglang).",
    )
    sglang_command: str | None = Field(
        default=None, description="Command that starts the SGLang server instead of "
        "`python -m sglang.launch_server ...` built from the job; {port} and {model_path} "
        "are filled in. It must serve SGLang's HTTP API on {port}."
    )
    sglang_startup_seconds: float = Field(
        default=SGLANG_STARTUP_SECONDS, gt=0,
        description="How long SGLang may take to become healthy.",
    )
    weights_address: str | None = Field(
        default=None, description="host:port of the trainer's weight transfer store; with "
        "trainer.weightTransfer distributed the engine joins it and receives each version by "
        "broadcast (without it, versions come from disk)."
    )

class TrainerSettings(ComputeSettings):
    buffer_address: str = Field(description="host:port of the buffer service.")
    run_dir: Path = Field(description="Run folder: checkpoints, weights, metrics.jsonl.")
    grpc_port: int = Field(default=port("trainer", "grpc"), ge=1, le=65535,
                           description="Trainer status gRPC and its health.")
    metrics_port: int = Field(default=0, ge=0, le=65535,
                              description="Prometheus; 0 = off (pods use the table's).")
    consumer: str = Field(default="trainer-0", description="Stable name (the pod's name).")
    eval_prompts: int | None = Field(
        default=None, ge=0,
        description="Held-out prompts per evaluation; unset: the job's trainer.evalPrompts.")
    reward_address: str | None = Field(
        default=None, description="Reward service for evaluations; without it, the same "
        "scorer runs in this process."
    )
    weights_port: int = Field(
        default=port("trainer", "weights"), ge=1, le=65535,
        description="Where rollout engines join the weight transfer group (rank 0 here), with "
        "trainer.weightTransfer distributed.",
    )
    collective_timeout: float = Field(
        default=DEFAULT_COLLECTIVE_TIMEOUT, gt=0, description="Under torchrun: seconds a rank "
        "waits in a collective before it gives up and exits (a hung peer never blocks forever)."
    )
    job_uid: str | None = Field(
        default=None, description="The RLJob's uid (the operator sets it): with the job's "
        "name it names the job's run in experiment trackers; unset: the run folder does.")


#: `asyncrl serve <name>` -> its settings.
SERVICES: dict[str, type[ServiceSettings]] = {
    "buffer": BufferSettings, "reward": RewardSettings, "rollout": RolloutSettings,
    "trainer": TrainerSettings,
}


def is_flag(settings_class: type[ServiceSettings], name: str) -> bool:
    extra = settings_class.model_fields[name].json_schema_extra or {}
    return extra.get("flag", True)


def environment_name(name: str) -> str:
    """The environment variable a service reads its setting `name` from: ASYNCRL_<NAME>."""
    return ServiceSettings.model_config["env_prefix"] + name.upper()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def serve_command(service: str, **values: Any) -> list[str]:
    """`serve <service> --name value ...` (after `asyncrl`, or torchrun's `-m asyncrl.cli`):
    each value a field of the service's settings, None left out."""
    settings_class = SERVICES[service]
    command = ["serve", service]
    for name, value in values.items():
        if name not in settings_class.model_fields or not is_flag(settings_class, name):
            raise ValueError(f"{settings_class.__name__} has no option {name!r}")
        if value is not None:
            command += [flag(name), str(value)]
    return command
