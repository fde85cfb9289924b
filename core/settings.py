"""Settings every service process shares, read from flags or ASYNCRL_* environment variables
and checked at start-up (the operator sets the same variables in each pod)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from asyncrl.outage import DEFAULT_OUTAGE_SECONDS


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
