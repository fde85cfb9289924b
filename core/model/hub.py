"""Models by Hugging Face Hub id (`model.source: <org>/<name>`, `model.revision`).

`huggingface_hub` downloads them into its usual cache and resolves them from it; it reads
HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN itself. HF_ENDPOINT is read here, at each
call, and handed over as `endpoint=`. Its errors become `HubModelError`: one line naming the
field and the fix. What counts as a Hub id is `asyncrl.spec.model_source`'s rule, except that
a relative path existing on this machine stays a path.

Run as `python -m asyncrl.model.hub REPO REVISION READY_FILE` it is the operator's download
into the run volume (asyncrl.operator.builders.model): exit code 3 for an answer that no retry
changes (no such model or revision, gated), 1 for the rest (the network).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

from asyncrl.spec.model_source import hub_repo_id

#: What a job loads of a Hub repository: config, generation config, tokenizer and chat
#: template, the transformers safetensors weights (sharded or not). Each pattern starts with a
#: file name, so it matches at the repository's top only: other formats (onnx/, original/,
#: Mistral's consolidated.safetensors) stay behind.
ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
    "added_tokens.json", "vocab.*", "merges.txt", "chat_template.*", "model*.safetensors",
    "model.safetensors.index.json",
]
#: The operator's downloader exits with this for an answer no retry changes.
PERMANENT_EXIT = 3


class HubModelError(RuntimeError):
    """A Hub model that cannot be had. `permanent` when the Hub answered (no such model or
    revision, gated), False when it could not be asked (offline, unreachable)."""

    def __init__(self, message: str, *, permanent: bool):
        super().__init__(message)
        self.permanent = permanent


def hub_model(source: str) -> str | None:
    """The Hub repository id of `source` on this machine, or None (a builtin or a path)."""
    if Path(source).expanduser().exists():
        return None
    return hub_repo_id(source)


def download(repo_id: str, revision: str = "main", *, cache_dir: str | Path | None = None
             ) -> Path:
    """The model's snapshot directory in the cache, downloaded where missing (tqdm shows the
    progress); from the cache alone when offline (HF_HUB_OFFLINE=1)."""
    from huggingface_hub import snapshot_download

    with _explained(repo_id, revision):
        directory = Path(snapshot_download(
            repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS, cache_dir=cache_dir,
            endpoint=os.environ.get("HF_ENDPOINT") or None))
    if not (directory / "config.json").is_file() or not any(directory.glob("*.safetensors")):
        raise HubModelError(
            f"model.source {repo_id!r} (revision {revision}) has no config.json and "
            "safetensors weights at its top level, which asyncrl loads: choose a repository "
            "that has them (the model's safetensors version), or convert it and give its local "
            "path", permanent=True)
    return directory


def check(repo_id: str, revision: str = "main") -> None:
    """That the model can be had, downloading nothing (`asyncrl validate`): a dry run asks for
    the repository and its config.json's metadata, which a gated model refuses."""
    from huggingface_hub import snapshot_download

    with _explained(repo_id, revision):
        snapshot_download(repo_id, revision=revision, allow_patterns=["config.json"],
                          dry_run=True, endpoint=os.environ.get("HF_ENDPOINT") or None)


@contextmanager
def _explained(repo_id: str, revision: str):
    """huggingface_hub's errors, as a HubModelError naming the field and the fix."""
    from huggingface_hub.errors import DryRunError, HfHubHTTPError, LocalEntryNotFoundError

    try:
        yield
    except (LocalEntryNotFoundError, HfHubHTTPError, ConnectionError, DryRunError) as exc:
        # A dry run says only that the repository could not be asked; its cause says why.
        cause = exc.__cause__ if isinstance(exc, DryRunError) and exc.__cause__ else exc
        message, permanent = _message(cause, repo_id, revision)
        raise HubModelError(message, permanent=permanent) from exc


def _message(error: BaseException, repo: str, revision: str) -> tuple[str, bool]:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    token = ("the token in HF_TOKEN has no access to it" if os.environ.get("HF_TOKEN")
             else "no HF_TOKEN is set")
    # GatedRepoError is a RepositoryNotFoundError: it is asked first.
    if isinstance(error, GatedRepoError):
        return (f"model.source {repo!r} is a gated model and {token}: "
                f"accept its terms on {endpoint}/{repo}, then set HF_TOKEN to a token of "
                "that account (in a cluster: model.hubTokenSecret)"), True
    if isinstance(error, RepositoryNotFoundError):
        return (f"model.source {repo!r}: no such model on the Hub ({endpoint}), or it is "
                f"private and {token}: check the id <org>/<name> on its "
                f"Hub page, set HF_TOKEN for a private model, or write a local folder as a "
                f"path (./{repo})"), True
    if isinstance(error, RevisionNotFoundError):
        return (f"model.revision {revision!r} is no branch, tag or commit of {repo} on the "
                f"Hub ({endpoint}): use one its Hub page lists, or remove model.revision "
                "(main)"), True
    offline = constants.is_offline_mode()
    why = ("HF_HUB_OFFLINE is set" if offline
           else f"the Hub ({endpoint}) cannot be reached ({_first_line(error)})")
    fix = ("unset HF_HUB_OFFLINE (or download it once online)" if offline else
           "connect to the network, or set HF_ENDPOINT to a mirror you can reach")
    return (f"model.source {repo!r} (revision {revision}) is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and {why}: {fix}"), False


def _first_line(error: BaseException) -> str:
    cause = error.__cause__ or error.__context__ or error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


def main(argv: list[str]) -> int:
    """The operator's download: REPO REVISION READY_FILE. READY_FILE is written once the
    snapshot is complete; the rollout pods wait for it. Its error is the last line printed,
    which the pod's termination message (and so the RLJob's status) carries."""
    repo_id, revision, ready = argv
    ready_file = Path(ready)
    if ready_file.is_file():
        return 0
    try:
        directory = download(repo_id, revision)
    except HubModelError as exc:
        print(exc, file=sys.stderr, flush=True)
        return PERMANENT_EXIT if exc.permanent else 1
    ready_file.parent.mkdir(parents=True, exist_ok=True)
    staging = ready_file.with_name(f".{ready_file.name}.tmp")
    staging.write_text(f"{directory}\n")
    os.replace(staging, ready_file)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
