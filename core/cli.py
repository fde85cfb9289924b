"""The `asyncrl` command.

Each command is a small function registered on `app`; command groups (e.g. `serve rollout`)
are sub-apps added with `app.add_typer(...)`. Commands import heavy modules inside their body so
`asyncrl --help` and `asyncrl validate` stay fast.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

import asyncrl

app = typer.Typer(
    name="asyncrl",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"asyncrl {asyncrl.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Fully asynchronous RL for language models: run jobs locally or on Kubernetes."""


@app.command()
def validate(
    files: Annotated[
        list[Path],
        typer.Argument(metavar="FILE...", help="RLJob manifests (YAML), one job per file."),
    ],
) -> None:
    """Check RLJob manifests: every problem on one line with its field and a fix."""
    from pydantic import ValidationError

    from asyncrl.spec import ManifestError, parse_manifest, read_manifest
    from asyncrl.spec.errors import format_errors, yaml_lines

    failed = 0
    for path in files:
        try:
            job = parse_manifest(read_manifest(path))
        except ManifestError as exc:
            failed += 1
            typer.secho(f"{exc}", fg=typer.colors.RED)
        except ValidationError as exc:
            failed += 1
            problems = format_errors(exc, lines=yaml_lines(path.read_text(encoding="utf-8")))
            count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
            typer.secho(f"{path}: invalid ({count})", fg=typer.colors.RED)
            for problem in problems:
                typer.echo(f"  {problem}")
        else:
            if (not _dataset_checked(path, job) or not _model_checked(path, job)
                    or not _trackers_checked(path, job)):
                failed += 1
                continue
            typer.secho(f"{path}: valid", fg=typer.colors.GREEN)
    if failed:
        raise typer.Exit(code=1)


def _dataset_checked(path: Path, job) -> bool:
    """A file job's mapping checked against its files where they are on this machine (they
    may be paths in the pods' image or volume instead: then a note, not a failure)."""
    from asyncrl.data.files import DatasetError
    from asyncrl.data.preview import check_dataset, local_data_missing

    if job.spec.dataset.kind != "file":
        return True
    missing = local_data_missing(job.spec)
    if missing:
        typer.echo(f"{path}: dataset {missing} is not on this machine; its rows are checked "
                   "when the job starts")
        return True
    try:
        typer.echo(f"{path}: {check_dataset(job.spec)}")
    except DatasetError as exc:
        typer.secho(f"{path}: invalid dataset", fg=typer.colors.RED)
        typer.echo(f"  {exc}")
        return False
    return True


def _model_checked(path: Path, job) -> bool:
    """A Hub model asked for (nothing downloaded): a wrong id or revision, or a gated model
    without a token, fails; a Hub this machine cannot reach is a note (the operator
    downloads it in a cluster)."""
    from asyncrl.model.hub import HubModelError, check, hub_model

    repo_id = hub_model(job.spec.model.source)
    if repo_id is None:
        return True
    try:
        check(repo_id, job.spec.model.revision)
    except HubModelError as exc:
        if exc.permanent:
            typer.secho(f"{path}: invalid model", fg=typer.colors.RED)
            typer.echo(f"  {exc}")
            return False
        typer.echo(f"{path}: {exc}; it is checked again when the job starts")
    return True


def _trackers_checked(path: Path, job) -> bool:
    """Every tracker the job asks for is installed here (each is an optional extra)."""
    from asyncrl.trainer.tracking import missing_trackers

    missing = missing_trackers(job.spec.tracking)
    if missing:
        typer.secho(f"{path}: a tracker is not installed", fg=typer.colors.RED)
        for line in missing:
            typer.echo(f"  {line}")
    return not missing


def _model_or_exit(job) -> None:
    """A Hub model downloaded (tqdm shows the progress) or found in the cache before any
    service starts, so a wrong id, a gated model without a token or no network fails here
    in one line, not in every service's log."""
    from asyncrl.model.hub import HubModelError, download, hub_model

    repo_id = hub_model(job.spec.model.source)
    if repo_id is None:
        return
    try:
        download(repo_id, job.spec.model.revision)
    except HubModelError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None


@app.command()
def run(
    file: Annotated[Path, typer.Argument(help="RLJob manifest (the one kubectl apply takes).")],
    run_dir: Annotated[Optional[Path], typer.Option(
        help="Run folder (default runs/<job name>); rerun with the same folder to resume.")] = None,
    sync: Annotated[bool, typer.Option(
        "--sync", help="Synchronous baseline: η = 0, generation waits for training.")] = False,
    steps: Annotated[Optional[int], typer.Option(min=1, help="Override algorithm.maxSteps.")] = None,
    trainer_threads: Annotated[Optional[int], typer.Option(min=1)] = None,
    rollout_threads: Annotated[Optional[int], typer.Option(min=1)] = None,
    metrics: Annotated[bool, typer.Option(
        "--metrics", help="Every service serves Prometheus /metrics on a loopback port; "
        "RUN_DIR/prometheus/ gets targets.json (file_sd) and a prometheus.yml that scrapes "
        "them.")] = False,
    lend_cores: Annotated[bool, typer.Option(
        help="The trainer and the rollout worker compute with each other's threads while the "
        "other waits (a job with one of each on the CPU).")] = True,
    devices: Annotated[str, typer.Option(
        help="What the trainer and rollout compute on: auto (every GPU CUDA shows, else the "
        "CPU), cpu, or GPU indices such as 0 or 0,1 (the trainer takes the first, the rollout "
        "the next, or shares the trainer's when none is left). The job's placement is the "
        "cluster's; here this decides.")] = "auto",
) -> None:
    """Run a whole job on this machine: Redis, buffer, reward, trainer and rollout as processes."""
    import time

    from rich.console import Console
    from rich.live import Live

    from asyncrl.local.progress import RunProgress
    from asyncrl.local.report import read_metrics, write_plots, write_report
    from asyncrl.local.devices import DevicesError, parse_devices
    from asyncrl.local.runner import LocalJob, RunOptions, ServiceFailed, stop_on_signals

    job = _load_or_exit(file)
    _dataset_or_exit(job)
    _model_or_exit(job)
    if not _trackers_checked(file, job):
        raise typer.Exit(code=1)
    # Resolved once, here: every path handed to a service is absolute.
    run_dir = (run_dir or Path("runs") / job.metadata.name).resolve()
    console = Console()
    try:
        options = RunOptions(run_dir=run_dir, sync=sync,
                             max_steps=steps, trainer_threads=trainer_threads,
                             rollout_threads=rollout_threads, metrics=metrics,
                             lend_cores=lend_cores, devices=parse_devices(devices))
        local = LocalJob(job, options,
                         notify=lambda line: console.print(line, style="yellow", markup=False))
    except DevicesError as exc:
        console.print(str(exc), style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    max_steps = local.job.spec.algorithm.max_steps
    console.print(f"[bold]{job.metadata.name}[/]: {'sync' if sync else 'async'} run in "
                  f"{options.run_dir} (trainer {local.trainer_threads} / rollout "
                  f"{local.rollout_threads} threads); logs in {options.run_dir / 'logs'}")
    for line in local.rollout_lines() + local.device_lines() + local.lending_lines():
        console.print(line, markup=False)
    for line in local.gate_lines() + local.lifetime_lines():
        console.print(line, style="yellow", markup=False, soft_wrap=True)
    if metrics:
        console.print(f"metrics: Prometheus targets in {local.prometheus_dir / 'targets.json'}; "
                      f"scrape them with: prometheus --config.file="
                      f"{local.prometheus_dir / 'prometheus.yml'}", soft_wrap=True)
    episodes = job.spec.rollout.workflow.kind == "episode"
    progress = RunProgress(job.metadata.name, max_steps, job.spec.algorithm.group_size,
                           unit="episodes" if episodes else "samples")
    stop_on_signals()
    autoscaler = None
    if local.job.spec.rollout.autoscale is not None:
        from asyncrl.local.autoscale import LocalAutoscaler

        autoscaler = LocalAutoscaler(
            local, notify=lambda line: console.print(line, style="cyan", markup=False))
        if metrics:
            autoscaler.metrics.serve(local.metrics_ports["operator"], host="127.0.0.1")
    code = 0
    buffer_stats = None  # as the run ended, for the report
    deadline = local.job.spec.active_deadline_seconds
    try:
        started = time.monotonic()
        local.start()
        with Live(progress.table(None, None), console=console, refresh_per_second=2) as live:
            status = None
            while not local.trainer_done():
                local.check()
                if deadline and time.monotonic() - started > deadline:
                    raise DeadlineExceeded(f"the run passed activeDeadlineSeconds {deadline}")
                # The trainer's last answer is kept: once it exits it answers no more, and the
                # final frame must show where it ended, not "starting".
                status = local.trainer_status() or status
                if autoscaler is not None:
                    autoscaler.tick()
                live.update(progress.table(status, local.buffer_stats(),
                                           workers=_workers_row(local, autoscaler)))
                local.record_rollout_status()
                time.sleep(1.0)
            buffer_stats = local.buffer_stats()
            live.update(progress.table(progress.finished(status, read_metrics(options.run_dir)),
                                       buffer_stats))
    except KeyboardInterrupt:
        console.print(f"[yellow]stopped[/]; rerun the same command to resume from the last "
                      f"checkpoint in {options.run_dir}")
        code = 130
    except ServiceFailed as failure:
        console.print(f"[red]{failure}[/]; last lines of its log:\n{failure.log_tail}")
        code = 1
    except TimeoutError as exc:
        console.print(f"[red]{exc}[/]")
        code = 1
    except DeadlineExceeded as exc:
        console.print(f"[red]{exc}[/]; rerun the same command (with a later deadline) to "
                      f"resume from the last checkpoint in {options.run_dir}")
        code = 1
    finally:
        local.stop()
    records = read_metrics(options.run_dir)
    if records:
        write_plots(options.run_dir, records)
        report = write_report(options.run_dir, job.metadata.name, records, sync, buffer_stats)
        console.print(report.read_text())
    raise typer.Exit(code)


class DeadlineExceeded(Exception):
    """`asyncrl run` past the job's activeDeadlineSeconds."""


def _workers_row(local, autoscaler) -> str | None:
    """The live view's rollout workers row: with more than one, or autoscaling."""
    if autoscaler is None:
        running = len(local.rollout_workers)
        return str(running) if running > 1 else None
    last = autoscaler.last
    return f"{autoscaler.replicas} (autoscale: {last.reason if last else 'starting'})"


def _stop_on_sigterm() -> None:
    """`kill` (SIGTERM) stops a service like Ctrl-C does (its finally blocks run). Also makes
    Ctrl-C work when the shell started it in the background with SIGINT ignored."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


@app.command("train-demo")
def train_demo(
    file: Annotated[Path, typer.Argument(help="RLJob manifest with dataset.kind arith.")],
    steps: Annotated[
        int, typer.Option(min=1, help="Training steps (default: the job's algorithm.maxSteps).")
    ] = 0,
) -> None:
    """Train synchronously in one process (generate, score, update) to see the trainer learn."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from asyncrl.local.sync_demo import run_demo

    job = _load_or_exit(file)
    total = steps or job.spec.algorithm.max_steps
    console = Console()
    console.print(f"[bold]{job.metadata.name}[/]: {total} synchronous steps of "
                  f"{job.spec.algorithm.batch_size} prompts x {job.spec.algorithm.group_size} "
                  f"responses, model {job.spec.model.source}")
    columns = (*Progress.get_default_columns()[:2], MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("training", total=total)

        def report(result) -> None:
            s = result.stats
            progress.console.print(
                f"step {result.step:>3}  reward {result.reward_mean:.3f}  loss {s['loss']:+.4f}  "
                f"clip {s['clip_fraction']:.3f}  generate {result.generate_seconds:5.1f}s  "
                f"train {s['step_seconds']:5.1f}s ({s['trained_tokens'] / s['step_seconds']:.0f} tok/s)"
            )
            progress.advance(task)

        run_demo(job.spec, total, report)


def _load_or_exit(path: Path):
    """The manifest at `path`, or its errors printed and exit code 1."""
    from pydantic import ValidationError

    from asyncrl.spec import ManifestError, parse_manifest, read_manifest
    from asyncrl.spec.errors import format_errors, yaml_lines

    try:
        return parse_manifest(read_manifest(path))
    except ManifestError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
    except ValidationError as exc:
        typer.secho(f"{path}: invalid", fg=typer.colors.RED, err=True)
        for problem in format_errors(exc, lines=yaml_lines(path.read_text(encoding="utf-8"))):
            typer.echo(f"  {problem}", err=True)
    raise typer.Exit(code=1)


def _dataset_or_exit(job) -> None:
    """A file job's dataset opened and every row checked before any service starts, so a
    bad file fails here, naming file, row and field, not in a worker's log."""
    from asyncrl.data.files import DatasetError
    from asyncrl.data.preview import check_dataset

    if job.spec.dataset.kind != "file":
        return
    try:
        check_dataset(job.spec)
    except DatasetError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None


data_app = typer.Typer(help="Look at a job's prompts.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("preview")
def data_preview(
    file: Annotated[Path, typer.Argument(help="RLJob manifest.")],
    count: Annotated[int, typer.Option("--count", "-n", min=1, help="Prompts to show.")] = 3,
    split: Annotated[str, typer.Option(help="train or eval prompts.")] = "train",
    lengths: Annotated[bool, typer.Option(
        "--lengths", help="Also tokenize every prompt of the split and count those longer "
        "than dataset.maxPromptTokens (which the job drops).")] = False,
) -> None:
    """Show a job's first prompts exactly as the model sees them (template and chat template
    applied), with token counts and references."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.progress import Progress
    from rich.text import Text

    from asyncrl.data.files import DatasetError
    from asyncrl.data.preview import describe, prompt_lengths
    from asyncrl.model.policy import load_tokenizer
    from asyncrl.data.prompts import build_prompts

    if split not in ("train", "eval"):
        typer.secho(f"--split {split!r}: use train or eval", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    job = _load_or_exit(file)
    console = Console()
    tokenizer = load_tokenizer(job.spec.model.source, job.spec.model.revision)
    try:
        train, held_out = build_prompts(job.spec, tokenizer)
        prompts = train if split == "train" else held_out
        console.print(f"[bold]{job.metadata.name}[/]: {len(train)} training and "
                      f"{len(held_out)} evaluation prompts; showing the first "
                      f"{min(count, len(prompts))} {split} prompts")
        for index in range(min(count, len(prompts))):
            header, text = describe(prompts[index], tokenizer, prompts.max_prompt_tokens)
            console.print(Panel(Text(text), title=header, title_align="left"))
        if lengths:
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("tokenizing", total=len(prompts))
                found = prompt_lengths(prompts, lambda: progress.advance(task))
            limit = prompts.max_prompt_tokens
            console.print(f"{found.count} {split} prompts: longest {found.longest} tokens, mean "
                          f"{found.mean:.0f}" + (f"; {found.too_long} longer than "
                                                 f"maxPromptTokens {limit} (dropped)"
                                                 if limit is not None else ""))
    except DatasetError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None


serve_app = typer.Typer(
    help="Run one service process (the command the operator puts in each pod).",
    no_args_is_help=True,
)
app.add_typer(serve_app, name="serve")


@serve_app.callback()
def _service_setup() -> None:
    """Services log one line per event to stderr (the pod log, or the run folder's logs/).

    In a pod the service is PID 1, for which the kernel ignores SIGTERM unless a handler is
    installed: without one, every pod stop would wait out the grace period and end in SIGKILL.
    SIGTERM therefore stops a service as Ctrl-C does (its finally blocks close servers and
    connections); the reward service installs its own, gentler handlers on top."""
    import logging

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _stop_on_sigterm()


def _add_serve_command(name: str, help: str) -> None:
    """`asyncrl serve <name>`: one option per field of the service's settings
    (asyncrl.platform.settings), with its description and default; an option left out falls back to
    its ASYNCRL_* environment variable, then to the default, as the settings read them."""
    import inspect
    import types
    import typing

    from asyncrl.platform.settings import SERVICES, flag, is_flag

    settings_class = SERVICES[name]

    def option_type(annotation):
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        return str if typing.get_origin(annotation) is typing.Literal else annotation

    parameters = []
    for field_name, field in settings_class.model_fields.items():
        if not is_flag(settings_class, field_name):
            continue
        env = f"{settings_class.model_config['env_prefix']}{field_name.upper()}"
        default = "required" if field.is_required() else field.get_default()
        option = typer.Option(None, flag(field_name),
                              show_default=False if default is None else str(default),
                              help=f"{field.description or ''} Env: {env}.")
        parameters.append(inspect.Parameter(
            field_name, inspect.Parameter.KEYWORD_ONLY, default=option,
            annotation=Optional[option_type(field.annotation)]))

    def command(**values) -> None:
        import importlib

        given = {key: value for key, value in values.items() if value is not None}
        settings = _settings_or_exit(settings_class, **given)
        from asyncrl.data.files import DatasetError

        try:
            importlib.import_module(_SERVE_MODULES[name]).serve(settings)
        except DatasetError as exc:  # a bad dataset: one line naming file, row and field
            raise SystemExit(f"{name}: {exc}") from None

    command.__signature__ = inspect.Signature(parameters)
    command.__doc__ = help
    serve_app.command(name)(command)


#: The module whose `serve(settings)` runs each service (imported only when it runs).
_SERVE_MODULES = {"buffer": "asyncrl.buffer.server", "reward": "asyncrl.reward.server",
                  "rollout": "asyncrl.rollout.server", "trainer": "asyncrl.trainer.service"}

_add_serve_command("rollout", """The rollout worker: the job's engine (torch in process, or an
    SGLang server it launches), the rollout workflow, weight following, HTTP (SGLang-compatible)
    and gRPC status.""")
_add_serve_command("buffer", """The buffer: staleness gate, batches and versions, all state in
    Redis. The Redis password, if any, is read from ASYNCRL_REDIS_PASSWORD (a Secret in
    Kubernetes).""")
_add_serve_command("reward", """The reward service: math answer verification, unit tests in a
    code sandbox, a user's Python function in worker processes, or an HTTP scoring endpoint.""")
_add_serve_command("trainer", """The trainer: batches from the buffer, decoupled PPO updates,
    published weights. Under torchrun, one rank of a data-parallel (or FSDP-sharded)
    trainer.""")


def _settings_or_exit(settings_class, **values):
    """Typed, checked service settings, or every problem printed and exit code 2."""
    from pydantic import ValidationError

    try:
        return settings_class(**values)
    except ValidationError as exc:
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"])
            typer.secho(f"--{field.replace('_', '-')}: {error['msg']}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)


@app.command("operator")
def run_operator(
    namespace: Annotated[list[str], typer.Option(
        "--namespace", "-n", envvar="ASYNCRL_OPERATOR_NAMESPACES",
        help="Watch only these namespaces (repeatable); default: the whole cluster.")] = [],
    image: Annotated[str, typer.Option(
        envvar="ASYNCRL_IMAGE", help="Image of the asyncrl services' pods that request no "
        "GPUs (the Dockerfile's `service` target).")] = "",
    gpu_image: Annotated[str, typer.Option(
        envvar="ASYNCRL_GPU_IMAGE", help="Image of the pods whose component requests GPUs, "
        "rollout and trainer (the `service-gpu` target: CUDA torch, SGLang).")] = "",
    redis_image: Annotated[str, typer.Option(envvar="ASYNCRL_REDIS_IMAGE")] = "",
    run_volume_size: Annotated[str, typer.Option(
        envvar="ASYNCRL_RUN_VOLUME_SIZE", help="Size of each job's run volume (PVC).")] = "",
    redis_volume_size: Annotated[str, typer.Option(
        envvar="ASYNCRL_REDIS_VOLUME_SIZE",
        help="Size of a managed Redis' append-only-file volume (PVC).")] = "",
    storage_class: Annotated[Optional[str], typer.Option(
        envvar="ASYNCRL_STORAGE_CLASS", help="StorageClass of run volumes (ReadWriteMany); "
        "default: the cluster's default.")] = None,
    interval: Annotated[float, typer.Option(
        envvar="ASYNCRL_OPERATOR_INTERVAL", min=0.5,
        help="Seconds between refreshes of each RLJob's figures from its buffer and trainer "
        "(the API is written only when they change; children are watched, not polled).")
    ] = 10.0,
    resync_interval: Annotated[float, typer.Option(
        envvar="ASYNCRL_OPERATOR_RESYNC_INTERVAL", min=0.5,
        help="Seconds between full reconciles of every RLJob, a safety net behind the "
        "watches.")] = 600.0,
    buffer_stats: Annotated[bool, typer.Option(
        envvar="ASYNCRL_OPERATOR_BUFFER_STATS",
        help="Read policy version, samples/s and staleness from each job's buffer "
        "(reachable when the operator runs in the cluster).")] = True,
    liveness: Annotated[Optional[str], typer.Option(
        envvar="ASYNCRL_OPERATOR_LIVENESS",
        help="Serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz.")] = None,
    network_policies: Annotated[bool, typer.Option(
        envvar="ASYNCRL_OPERATOR_NETWORK_POLICIES",
        help="Give each job NetworkPolicies: only its own pods reach its Redis and buffer, "
        "reward pods get no egress.")] = True,
    reward_seccomp_profile: Annotated[str, typer.Option(
        envvar="ASYNCRL_REWARD_SECCOMP_PROFILE",
        help="Seccomp profile of reward pods: RuntimeDefault, Unconfined or Localhost:<path>.")
    ] = "RuntimeDefault",
    gpu_tolerations: Annotated[Optional[str], typer.Option(
        envvar="ASYNCRL_GPU_TOLERATIONS",
        help="JSON list of tolerations for GPU pods whose spec gives none; default: "
        "tolerate the nvidia.com/gpu taint.")] = None,
    hub_endpoint: Annotated[Optional[str], typer.Option(
        envvar="HF_ENDPOINT", help="The Hugging Face Hub (or mirror) that jobs' Hub models "
        "are downloaded from; default: huggingface_hub's.")] = None,
    leader_election: Annotated[bool, typer.Option(
        envvar="ASYNCRL_OPERATOR_LEADER_ELECTION",
        help="Reconcile only while holding a Lease (for several operator replicas).")] = False,
    lease_name: Annotated[str, typer.Option(envvar="ASYNCRL_OPERATOR_LEASE_NAME")] = "asyncrl-operator",
    lease_namespace: Annotated[str, typer.Option(
        envvar="POD_NAMESPACE", help="Namespace of the Lease (in a pod: its own).")] = "default",
    metrics_port: Annotated[int, typer.Option(
        envvar="ASYNCRL_OPERATOR_METRICS_PORT", min=0, max=65535,
        help="Serve Prometheus /metrics on this port (the rollout autoscaler's signal per "
        "job); 0: none.")] = 0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run the RLJob operator (kopf) against the current kubeconfig or in-cluster."""
    import threading

    import kopf

    from asyncrl.operator import handlers, kube
    from asyncrl.operator.builders import OperatorConfig
    from asyncrl.operator.leader import Leadership, LeaseSettings

    from asyncrl.operator.builders import seccomp_profile

    try:
        seccomp_profile(reward_seccomp_profile)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--reward-seccomp-profile") from None
    defaults = OperatorConfig()
    handlers.configure_operator(OperatorConfig(
        reward_seccomp_profile=reward_seccomp_profile,
        image=image or defaults.image, gpu_image=gpu_image or defaults.gpu_image,
        redis_image=redis_image or defaults.redis_image,
        run_volume_size=run_volume_size or defaults.run_volume_size,
        redis_volume_size=redis_volume_size or defaults.redis_volume_size,
        run_volume_storage_class=storage_class, network_policies=network_policies,
        gpu_tolerations=(_parse_tolerations(gpu_tolerations) if gpu_tolerations is not None
                         else defaults.gpu_tolerations),
        hub_endpoint=hub_endpoint or None,
    ), interval=interval, resync_interval=resync_interval, buffer_stats=buffer_stats)
    kopf.configure(verbose=verbose)
    if metrics_port:
        handlers.STATE.metrics.serve(metrics_port)
    stop_flag: threading.Event | None = None
    leadership = None
    if leader_election:
        kube.api_client()  # loads the credentials the election's client uses
        leadership = Leadership(LeaseSettings(name=lease_name, namespace=lease_namespace)).start()
        leadership.wait_to_lead()
        stop_flag = leadership.stop_flag
    kopf.run(standalone=True, clusterwide=not namespace, namespaces=namespace,
             liveness_endpoint=liveness, stop_flag=stop_flag)
    if leadership is not None and leadership.lost.is_set():
        raise typer.Exit(code=1)  # restarted by Kubernetes, as a follower


def _parse_tolerations(text: str) -> tuple[dict, ...]:
    """--gpu-tolerations: a JSON list of Kubernetes tolerations, checked before anything runs."""
    from kubernetes.client import V1Toleration

    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON ({exc.msg} at column {exc.colno}); expected e.g. "
                                 '[{"key": "nvidia.com/gpu", "operator": "Exists"}]',
                                 param_hint="--gpu-tolerations") from None
    allowed = set(V1Toleration.attribute_map.values())
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise typer.BadParameter("expected a JSON list of toleration objects",
                                 param_hint="--gpu-tolerations")
    for index, item in enumerate(items):
        unknown = set(item) - allowed
        if unknown:
            raise typer.BadParameter(f"item {index}: unknown field(s) {sorted(unknown)}; a "
                                     f"toleration has {sorted(allowed)}",
                                     param_hint="--gpu-tolerations")
    return tuple(items)


class OutputFormat(str, enum.Enum):
    yaml = "yaml"
    json = "json"


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="The run's folder (runs/<job> by default).")],
    out: Annotated[Path, typer.Argument(help="A new folder for the model.")],
    step: Annotated[Optional[int], typer.Option(
        help="The checkpoint of this step (default: the newest).")] = None,
    merge: Annotated[bool, typer.Option(
        "--merge", help="LoRA: write the base with the adapter merged, a plain model "
        "(default: the adapter as a peft directory).")] = False,
    job: Annotated[Optional[Path], typer.Option(
        help="The job's manifest (default: RUN_DIR/config.yaml, which `asyncrl run` "
        "writes).")] = None,
) -> None:
    """Write a run's checkpoint as a Hugging Face model directory (weights, config,
    tokenizer, generation config) that transformers, vLLM and SGLang load."""
    from asyncrl.trainer.export import ExportError, checkpoint_of
    from asyncrl.trainer.export import export as write_export

    manifest = job or run_dir / "config.yaml"
    if not manifest.is_file():
        typer.secho(f"{manifest} not found: name the job's manifest with --job",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1)
    loaded = _load_or_exit(manifest)
    try:
        checkpoint = checkpoint_of(run_dir, step)
        written = write_export(checkpoint, loaded, out, merge=merge)
    except ExportError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"{out}: {written}, from {checkpoint}")


@app.command("eval")
def evaluate(
    file: Annotated[Path, typer.Argument(help="The job's RLJob manifest: its reward, prompts "
                                         "and sampling settings.")],
    models: Annotated[list[str], typer.Option(
        "--model", help="What to score: a run folder (its newest checkpoint; RUN_DIR@N: step "
        "N), a checkpoint folder, a folder `asyncrl export` wrote (a model or a LoRA adapter), "
        "or base (the job's model.source). Twice: side by side.")],
    prompts: Annotated[Optional[Path], typer.Option(
        help="Score on this file's rows instead of the job's held-out prompts (a file job: "
        "its own field mapping; else rows with prompt and answer, or prompt and tests).")] = None,
    samples: Annotated[int, typer.Option(
        min=1, help="Responses per prompt: 1 is greedy (pass@1); k > 1 samples at the job's "
        "temperature (pass@1, pass@k, maj@k).")] = 1,
    limit: Annotated[Optional[int], typer.Option(
        min=1, help="Prompts to score (default: trainer.evalPrompts of the held-out set, "
        "every row of --prompts).")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="Folder for the JSON and Markdown results (default: RUN_DIR/eval beside a run, "
        "FOLDER-eval beside another folder, runs/<job>/eval for base).")] = None,
    devices: Annotated[str, typer.Option(
        help="auto (the first GPU CUDA shows, else the CPU), cpu, or a GPU index.")] = "auto",
) -> None:
    """Score models on a job's evaluation prompts with its reward, by the trainer's own
    evaluation code: pass@1 greedy, or pass@1, pass@k and maj@k over k samples."""
    from rich.console import Console
    from rich.progress import MofNCompleteColumn, Progress, TimeRemainingColumn

    from asyncrl.data.files import DatasetError
    from asyncrl.evaluation import held_out_prompts
    from asyncrl.local.devices import DevicesError, parse_devices, plan_devices, visible_gpus
    from asyncrl.local.eval_models import ModelArgumentError, resolve_model
    from asyncrl.local.evaluate import (default_out, evaluate_model, majority_note,
                                        markdown_table, prompts_file_spec, write_results)
    from asyncrl.model.policy import load_tokenizer

    job = _load_or_exit(file)
    spec, console = job.spec, Console()
    try:
        device = plan_devices(parse_devices(devices), visible_gpus()).trainer.device
        resolved = [resolve_model(text, spec.model) for text in models]
        if prompts is not None:
            spec = prompts_file_spec(spec, prompts)
        tokenizer = load_tokenizer(spec.model.source, spec.model.revision)
        items = held_out_prompts(spec, tokenizer, limit or (None if prompts is None else 10**9))
    except (DevicesError, ModelArgumentError, DatasetError) as exc:
        console.print(str(exc), style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if not items:
        console.print(f"{prompts or file}: no evaluation prompts (the held-out set is empty, "
                      "or every prompt is over dataset.maxPromptTokens): give --prompts FILE",
                      style="red", markup=False)
        raise typer.Exit(2)
    where = str(prompts) if prompts else f"{len(items)} held-out prompts"
    console.print(f"[bold]{job.metadata.name}[/]: {len(items)} prompts x {samples} "
                  f"{'greedy response' if samples == 1 else 'samples'} on {device}",
                  markup=True)
    records = []
    columns = (*Progress.get_default_columns()[:2], MofNCompleteColumn(), TimeRemainingColumn())
    for model in resolved:
        console.print(f"{model.label}: {model.where}", markup=False)
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(model.label, total=len(items) * samples)
            records.append(evaluate_model(spec, job.metadata.name, model, items, tokenizer,
                                          samples=samples, device=device,
                                          on_done=lambda: progress.advance(task)))
    note = majority_note(spec, samples)
    if note:
        console.print(note, style="yellow", markup=False)
    console.print(markdown_table(job.metadata.name, records, where), markup=False)
    target = out or default_out(job.metadata.name, resolved[0])
    json_path, table_path = write_results(target, job.metadata.name, records, where)
    console.print(f"written: {json_path} and {table_path}", markup=False, soft_wrap=True)


@app.command()
def crd(
    output: Annotated[
        OutputFormat, typer.Option("--output", "-o", help="Output format.")
    ] = OutputFormat.yaml,
) -> None:
    """Print the RLJob CustomResourceDefinition (kubectl apply -f - takes it)."""
    from asyncrl.spec.crd import build_crd

    definition = build_crd()
    if output is OutputFormat.json:
        typer.echo(json.dumps(definition, indent=2))
    else:
        import yaml

        typer.echo(yaml.safe_dump(definition, sort_keys=False, width=100).rstrip("\n"))


if __name__ == "__main__":  # pragma: no cover
    app()
