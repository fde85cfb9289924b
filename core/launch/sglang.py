"""Launching an SGLang server for a rollout replica (engine: sglang, on GPU node pools).

`sglang_launch_command` is a pure function from the job spec to the command line;
`tests/support/sglang_requests.py` parses its flags with SGLang's own argument parser
(`ServerArgs.add_cli_args`). `SGLangServer` runs that command as a child process and waits for
/health. Flags, all checked against SGLang 0.5.23's server arguments:

- `--model-path`, `--host`, `--port`;
- `--tp-size`: the replica's GPUs (`rollout.placement.gpus`), one tensor-parallel rank each;
- `--dtype`: `rollout.computeDtype`, else `model.dtype`;
- `--max-running-requests`: this replica's share of `rollout.maxConcurrentRollouts` (which is
  job-wide, in prompts) times `algorithm.groupSize` (each prompt is n requests);
- `--skip-tokenizer-init`: token-in/token-out, `input_ids` in and `output_ids` out;
- `--weight-version`: the policy version of the initial weights, so every response carries
  an integer version from the start (SGLang's default is the string "default");
- `--random-seed`;
- `--mem-fraction-static` only when given (otherwise SGLang sizes its KV cache itself);
- with `model.lora`: `--enable-lora` (its /load_lora_adapter and /unload_lora_adapter, and
  `lora_path` in /generate), `--max-lora-rank` and `--lora-target-modules` from the spec (with
  no adapter at start SGLang needs both to size its adapter memory), and
  `--max-loras-per-batch` (`MAX_LORAS_PER_BATCH`).

Pausing, continuing, aborting and /update_weights_from_disk need no flag in SGLang 0.5.23.
"""

from __future__ import annotations

import collections
import importlib.util
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

from asyncrl.platform.settings import SGLANG_STARTUP_SECONDS
from asyncrl.spec import RLJobSpec

#: The SGLang release whose flags and request models this module and the client are checked
#: against (scripts/sglang_check_env.sh installs it).
SGLANG_VERSION = "0.5.23"
#: The interpreter that has SGLang, when it is not this one (set by the GPU image).
SGLANG_PYTHON_ENV = "ASYNCRL_SGLANG_PYTHON"
#: Adapters one batch may mix (SGLang counts the base as one): the version served, and during
#: a swap the one it replaces, whose last requests may still run.
MAX_LORAS_PER_BATCH = 2


def tensor_parallel_size(gpus: int) -> int:
    """An SGLang replica's tensor-parallel ranks: one per GPU of its pod."""
    return max(gpus, 1)


def groups_per_replica(spec: RLJobSpec) -> int:
    """Prompts (groups) one rollout replica generates at once: its share of the job-wide
    rollout.maxConcurrentRollouts, so that replicas share the limit instead of the first to ask
    taking all of it. With autoscale the share of its fewest replicas, which the job may
    scale down to."""
    rollout = spec.rollout
    replicas = rollout.autoscale.min_replicas if rollout.autoscale else rollout.replicas
    return math.ceil(rollout.max_concurrent_rollouts / replicas)


def max_running_requests(spec: RLJobSpec) -> int:
    """Requests one replica runs at once: its share of the job-wide prompt limit, times the
    responses per prompt."""
    return groups_per_replica(spec) * spec.algorithm.group_size


def _sglang_dtype(setting: str) -> str:
    """A job's dtype setting as SGLang's --dtype: SGLang serves GPUs only, where auto is
    bf16 (asyncrl.platform.devices.resolve_dtype)."""
    return "bfloat16" if setting == "auto" else setting


def sglang_launch_command(
    spec: RLJobSpec,
    *,
    model_path: str,
    port: int,
    host: str = "0.0.0.0",
    python: str | None = None,
    initial_version: int = 0,
    seed: int = 0,
    mem_fraction_static: float | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`python -m sglang.launch_server ...` for one rollout replica of the job `spec`
    (`load_manifest(path).spec`). `extra_args` are appended as they are. `python` defaults to
    $ASYNCRL_SGLANG_PYTHON (the GPU image keeps SGLang in its own environment), else this
    interpreter."""
    python = python or os.environ.get(SGLANG_PYTHON_ENV) or sys.executable
    if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    command = [
        python, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tensor_parallel_size(spec.rollout.placement.gpus)),
        "--dtype", _sglang_dtype(spec.rollout_compute_dtype),
        "--max-running-requests", str(max_running_requests(spec)),
        "--skip-tokenizer-init",
        "--weight-version", str(initial_version),
        "--random-seed", str(seed),
    ]
    if mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(mem_fraction_static)]
    if (lora := spec.model.lora) is not None:
        command += ["--enable-lora", "--max-lora-rank", str(lora.rank),
                    "--lora-target-modules", *lora.target_modules,
                    "--max-loras-per-batch", str(MAX_LORAS_PER_BATCH)]
    return command + list(extra_args)


class SGLangUnavailableError(RuntimeError):
    """SGLang is not installed for the interpreter that would run it."""


class SGLangServer:
    """An SGLang server as a child process: `start()` launches `command` and waits for
    /health; `stop()` ends it and the processes it forked (SIGTERM to its process group, then
    SIGKILL). Usable as a context manager.

    The child's output is kept (the last `log_lines` lines) and quoted when it fails to come
    up, so the cause is in the error.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        url: str,
        startup_timeout: float = SGLANG_STARTUP_SECONDS,
        env: dict[str, str] | None = None,
        log_lines: int = 60,
    ):
        self.command = list(command)
        self.url = url.rstrip("/")
        self.startup_timeout = startup_timeout
        self._env = env
        self._log: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    @classmethod
    def for_job(
        cls, spec: RLJobSpec, *, model_path: str, port: int,
        startup_timeout: float = SGLANG_STARTUP_SECONDS, **command_options,
    ) -> SGLangServer:
        """The server for one rollout replica, reached on loopback; `command_options` go to
        `sglang_launch_command`."""
        command = sglang_launch_command(spec, model_path=model_path, port=port, **command_options)
        return cls(command, url=f"http://127.0.0.1:{port}", startup_timeout=startup_timeout)

    @property
    def returncode(self) -> int | None:
        """The server's exit code once it has ended; None while it runs (or before start)."""
        return None if self._process is None else self._process.poll()

    @property
    def log_tail(self) -> str:
        return "\n".join(self._log)

    def _check_installed(self) -> None:
        """A clear error, before anything starts, when the command runs SGLang's launcher
        with an interpreter that has no sglang."""
        python = self.command[0]
        if self.command[1:3] != ["-m", "sglang.launch_server"]:
            return
        if python == sys.executable:
            found = importlib.util.find_spec("sglang") is not None
        else:
            probe = [python, "-c", "import importlib.util, sys; "
                     "sys.exit(importlib.util.find_spec('sglang') is None)"]
            found = subprocess.run(probe, capture_output=True).returncode == 0
        if not found:
            raise SGLangUnavailableError(
                f"rollout engine sglang needs the sglang package, which {python} cannot "
                f"import; install it in the rollout image (pip install 'sglang=={SGLANG_VERSION}'"
                ") or use engine: torch"
            )

    def start(self) -> SGLangServer:
        self._check_installed()
        self._process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(self._env or {})},
            # Its own process group: SGLang forks scheduler and detokenizer processes,
            # and stop() ends them with it.
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _read_output(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self._log.append(line.rstrip("\n"))

    def _wait_healthy(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(base_url=self.url, timeout=10.0) as http:
            while True:
                code = self._process.poll()
                if code is not None:
                    if self._reader is not None:
                        self._reader.join(timeout=5)
                    raise RuntimeError(
                        f"SGLang exited with code {code} before becoming healthy; "
                        f"last output:\n{self.log_tail}"
                    )
                try:
                    if http.get("/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"SGLang at {self.url} was not healthy within "
                        f"{self.startup_timeout:g}s; last output:\n{self.log_tail}"
                    )
                time.sleep(1.0)

    def stop(self, timeout: float = 30.0) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            self._signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        # Children may outlive the launcher; the group goes in any case.
        self._signal_group(process, signal.SIGKILL)
        process.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    @staticmethod
    def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()
