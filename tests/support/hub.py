"""A stand-in for the Hugging Face Hub on loopback: the part of its HTTP API that
huggingface_hub's `snapshot_download` and `hf_hub_download` use (read from huggingface_hub
2.4's hf_api.py, file_download.py and utils/_http.py), so that tests download real models
through the real client without the internet.

    GET  /api/models/{repo}/revision/{revision}   repo_info: id, sha (the commit), siblings
    GET  /api/models/{repo}/tree/{revision}       list_repo_tree: files with size, git blob id
                                                  and, for LFS files (safetensors), sha256
    HEAD /{repo}/resolve/{revision}/{file}        file metadata: X-Repo-Commit, ETag (git blob
                                                  id; X-Linked-Etag = sha256 for LFS files),
                                                  Content-Length (X-Linked-Size for LFS)
    GET  /{repo}/resolve/{revision}/{file}        the bytes

Errors carry the X-Error-Code huggingface_hub turns into its exceptions: RepoNotFound (404),
RevisionNotFound (404), EntryNotFound (404), GatedRepo (401 without a token, 403 with a wrong
one; a gated repository's metadata stays public, as on the Hub). Set HF_ENDPOINT to `url`.

`HubStandIn(host=...)` serves on another address than loopback: pods on the real node reach
the host at its IP (tests/e2e).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: Files stored in git LFS on the Hub (their ETag is the sha256).
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


@dataclass
class HubRepo:
    files: dict[str, bytes]
    #: revision name (branch or tag) -> commit
    refs: dict[str, str]
    #: Requests must carry this token (Authorization: Bearer ...) to read files.
    gated_token: str | None = None
    downloads: list[str] = field(default_factory=list)

    def commit(self, revision: str) -> str | None:
        if revision in self.refs.values():
            return revision
        return self.refs.get(revision)


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class HubStandIn:
    """`with HubStandIn() as hub: hub.add_model("org/name", folder)`; `hub.url` is the
    endpoint. `stop()` closes the socket (a Hub that cannot be reached)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.repos: dict[str, HubRepo] = {}
        self._server = ThreadingHTTPServer((host, 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add_model(self, repo_id: str, folder: Path, *, revisions: tuple[str, ...] = ("main",),
                  gated_token: str | None = None) -> str:
        """Serves every file under `folder` as `repo_id` at `revisions` (one commit); returns
        the commit's id."""
        files = {str(p.relative_to(folder)): p.read_bytes()
                 for p in sorted(folder.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(repo_id.encode())
        for name, content in files.items():
            digest.update(name.encode() + git_blob_id(content).encode())
        commit = digest.hexdigest()
        self.repos[repo_id] = HubRepo(files, {r: commit for r in revisions}, gated_token)
        return commit

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=10)
        self._server.server_close()


def _handler(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):  # quiet: pytest shows failures, not every request
            pass

        def do_GET(self):
            self._answer(body=True)

        def do_HEAD(self):
            self._answer(body=False)

        def _answer(self, *, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            if path.startswith("/api/models/"):
                self._api(path.removeprefix("/api/models/"), body)
            elif "/resolve/" in path:
                self._resolve(path.lstrip("/"), body)
            else:
                self._error(404, "RepoNotFound", "no such route", body)

        def _api(self, rest: str, body: bool) -> None:
            # {org}/{name}/revision/{revision} or {org}/{name}/tree/{revision}
            parts = rest.split("/", 3)
            if len(parts) < 4 or parts[2] not in ("revision", "tree"):
                return self._error(404, "RepoNotFound", "no such route", body)
            repo_id, what, revision = f"{parts[0]}/{parts[1]}", parts[2], parts[3]
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", f"Repository {repo_id} not found", body)
            commit = repo.commit(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
            if what == "revision":
                data = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                        "gated": "manual" if repo.gated_token else False,
                        "siblings": [{"rfilename": name} for name in repo.files]}
            else:
                data = [_tree_entry(name, content) for name, content in repo.files.items()]
            self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"},
                       body)

        def _resolve(self, rest: str, body: bool) -> None:
            # {org}/{name}/resolve/{revision}/{file}
            repo_part, _, tail = rest.partition("/resolve/")
            repo = hub.repos.get(repo_part)
            if repo is None:
                return self._error(404, "RepoNotFound", f"Repository {repo_part} not found", body)
            if repo.gated_token is not None:
                given = self.headers.get("Authorization", "")
                if given != f"Bearer {repo.gated_token}":
                    status = 403 if given else 401
                    return self._error(status, "GatedRepo", "Access to this model is "
                                       "restricted: accept its conditions", body)
            revision, _, filename = tail.partition("/")
            commit = repo.commit(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
            content = repo.files.get(filename)
            if content is None:
                return self._error(404, "EntryNotFound", f"{filename} does not exist", body)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_id(content)}"',
                       "Content-Type": "application/octet-stream"}
            if filename.endswith(LFS_SUFFIXES):
                headers["X-Linked-Etag"] = f'"{hashlib.sha256(content).hexdigest()}"'
                headers["X-Linked-Size"] = str(len(content))
            if body:
                repo.downloads.append(filename)
            self._send(200, content, headers, body)

        def _error(self, status: int, code: str, message: str, body: bool) -> None:
            self._send(status, json.dumps({"error": message}).encode(),
                       {"X-Error-Code": code, "X-Error-Message": message,
                        "Content-Type": "application/json"}, body)

        def _send(self, status: int, content: bytes, headers: dict[str, str],
                  body: bool) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(content)))
            # One request per connection: after stop() no kept-alive connection answers.
            self.send_header("Connection", "close")
            self.close_connection = True
            self.end_headers()
            if body:
                self.wfile.write(content)

    return Handler


def _tree_entry(name: str, content: bytes) -> dict:
    entry = {"type": "file", "path": name, "size": len(content), "oid": git_blob_id(content)}
    if name.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(content).hexdigest(), "size": len(content),
                        "pointerSize": 134}
    return entry


def write_tiny_hub_model(folder: Path) -> Path:
    """A model directory as a Hub repository holds one: the job's tiny random model (SmolLM2's
    architecture and tokenizer, seed 0) saved with its tokenizer, plus files a download must
    leave behind (another format in a sub-folder, a pickle)."""
    from asyncrl.model.policy import TinyModelConfig, build_tiny_model, load_tokenizer

    tokenizer = load_tokenizer()
    build_tiny_model(TinyModelConfig(), vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"not for asyncrl")
    (folder / "pytorch_model.bin").write_bytes(b"not for asyncrl")
    return folder


def point_huggingface_hub_at(monkeypatch, hub: HubStandIn | None, cache: Path, *,
                             offline: bool = False) -> None:
    """This process' huggingface_hub on `hub` (None: nowhere) with its cache in `cache`.
    huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, at import: its constants are
    set too (asyncrl.model.hub reads HF_ENDPOINT at each call)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", hub.url if hub else "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    # No token saved by `hf auth login` on this machine takes part.
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(cache / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
