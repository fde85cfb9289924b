"""Each service's settings are the one owner of its options: `asyncrl serve <service>` offers
exactly their fields, and the command lines the operator and `asyncrl run` build
(`serve_command`) parse with that CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from asyncrl.cli import app
from asyncrl.operator import builders
from asyncrl.operator.builders import OperatorConfig
from asyncrl.local.runner import LocalJob, RunOptions
from asyncrl.platform.settings import SERVICES, flag, is_flag, serve_command
from asyncrl.spec import load_manifest
from support import ROOT

SERVE = typer.main.get_command(app).commands["serve"]


def options(service: str) -> set[str]:
    return {name for param in SERVE.commands[service].params for name in param.opts
            if name != "--help"}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_the_cli_offers_exactly_the_settings_fields(service):
    settings_class = SERVICES[service]
    expected = {flag(name) for name in settings_class.model_fields if is_flag(settings_class, name)}
    assert options(service) == expected


def test_a_secret_is_never_an_option_and_unknown_options_are_refused():
    assert "--redis-password" not in options("buffer")
    with pytest.raises(ValueError, match="redis_password"):
        serve_command("buffer", redis_password="x")
    with pytest.raises(ValueError, match="grpc_prot"):
        serve_command("reward", grpc_prot=1)
    assert serve_command("reward", job_file="j", workers=None) == ["serve", "reward",
                                                                     "--job-file", "j"]


def parses(command: list[str]) -> dict:
    """The values the CLI reads from `serve <service> ...` (parsed, not run)."""
    assert command[0] == "serve"
    service = SERVE.commands[command[1]]
    return service.make_context(command[1], list(command[2:])).params


def test_the_operators_command_lines_parse_with_the_cli():
    job = load_manifest(ROOT / "examples" / "gpu-cluster.yaml")
    config = OperatorConfig(image="example.org/asyncrl:test")
    buffer = builders.buffer_deployment(job, config)["spec"]["template"]["spec"]
    rollout = builders.rollout_deployment(job, config)["spec"]["template"]["spec"]
    reward = builders.reward_deployment(job, config)["spec"]["template"]["spec"]
    for pod in (buffer, rollout, reward):
        params = parses(pod["containers"][0]["args"])
        assert params["job_file"] == Path(builders.JOB_FILE)
    trainer = builders.trainer_statefulset(job, config)["spec"]["template"]["spec"]
    args = next(c for c in trainer["containers"] if c["name"] == "trainer")["args"]
    params = parses(args[args.index("serve"):])
    assert params["grpc_port"] == builders.TRAINER_PORT and params["consumer"] == "$(POD_NAME)"


def test_the_local_runners_trainer_command_parses_with_the_cli(tmp_path):
    local = LocalJob(load_manifest(ROOT / "examples" / "tiny.yaml"),
                     RunOptions(run_dir=tmp_path / "run"))
    command = local._trainer_command("asyncrl", "127.0.0.1:1", "127.0.0.1:2")
    params = parses(command[1:])
    assert (params["buffer_address"], params["reward_address"]) == ("127.0.0.1:1", "127.0.0.1:2")
