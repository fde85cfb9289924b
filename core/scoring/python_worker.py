"""A worker process that runs a job's Python reward function:
`python -m asyncrl.scoring.python_worker <module:function> [folder]`.

It imports the function once, first adding `folder` (reward.python.path) to the import path,
and says ready; a function it cannot import or call as `fn(response=..., row=...)` is its
first and only line instead ({"error": ...}), which fails the reward service at start with
that message. Then each request {"response", "row_json"} is answered with
{"score": float, "extras": {name: float}} or {"failure": "exception" | "invalid_score",
"detail": ...}. An async function runs to completion on this worker's own event loop, kept
between calls. Time limits are the parent's: it kills a worker that does not answer in time.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import sys
import sysconfig
import traceback
from typing import Any, Callable, Mapping

from asyncrl.scoring.score_values import InvalidScore, as_number
from asyncrl.scoring.worker_protocol import Channel

_STDLIB = sysconfig.get_paths()["stdlib"]


class LoadError(Exception):
    """The reward function cannot be imported or called; the message says why."""


def load_function(target: str, folder: str | None = None) -> Callable:
    """The callable `target` ("package.module:name") names, `folder` first on the import path."""
    where = f"reward.python.function {target!r}"
    module_name, _, name = target.partition(":")
    if not module_name or not name:
        raise LoadError(f"{where}: expected 'package.module:name'")
    if folder is not None:
        if not os.path.isdir(folder):
            raise LoadError(f"{where}: reward.python.path {folder!r} is not a folder")
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any error while importing the user's module
        if not isinstance(exc, (ImportError, SyntaxError)):  # the module's own code raised
            traceback.print_exception(exc, file=sys.stderr)
        searched = f" (reward.python.path: {folder})" if folder else ""
        raise LoadError(f"{where}: cannot import {module_name}{searched}: "
                        f"{_describe(exc)}") from exc
    function = getattr(module, name, None)
    if function is None:
        raise LoadError(f"{where}: module {module_name} ({getattr(module, '__file__', '?')}) "
                        f"has no {name!r}")
    if not callable(function):
        raise LoadError(f"{where}: {name} is a {type(function).__name__}, not a function")
    try:
        inspect.signature(function).bind(response="", row={})
    except TypeError as exc:
        raise LoadError(f"{where}: cannot be called as {name}(response=..., row=...): "
                        f"{exc}") from exc
    except ValueError:  # no signature to inspect (some builtins): find out at the first call
        pass
    return function


def score_reply(value: Any) -> dict:
    """The reply for what the function returned: a number, or a mapping with a number
    'score' and other numbers (the extras)."""
    if isinstance(value, Mapping):
        if "score" not in value:
            keys = ", ".join(map(str, list(value)[:8]))
            raise InvalidScore(f"returned a dict without 'score' (keys: {keys})")
        extras = {str(key): as_number(item, f"extra {key!r}")
                  for key, item in value.items() if key != "score"}
        return {"score": as_number(value["score"], "'score'"), "extras": extras}
    return {"score": as_number(value, "the return value"), "extras": {}}


def _describe(exc: BaseException) -> str:
    """One line, `Type: message (at file:line in function)`, the line being the innermost
    frame of the user's code (not of the standard library or this worker)."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if _users(frame.filename)]
    if frames:
        last = frames[-1]
        text += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return text[:500]


def _users(filename: str) -> bool:
    if filename.startswith("<") or filename == __file__:
        return False
    return not filename.startswith(_STDLIB) or "-packages" in filename


class _Caller:
    def __init__(self, function: Callable):
        self._function = function
        self._runner: asyncio.Runner | None = None
        self._shown_traceback = False

    def __call__(self, request: dict) -> dict:
        try:
            value = self._function(response=request["response"],
                                   row=json.loads(request["row_json"]))
            if inspect.isawaitable(value):
                value = self._loop().run(_awaited(value))
        except Exception as exc:  # noqa: BLE001 - the user's error is this response's score
            self._show(exc)
            return {"failure": "exception", "detail": _describe(exc)}
        try:
            return score_reply(value)
        except InvalidScore as exc:
            return {"failure": "invalid_score", "detail": str(exc)[:500]}

    def _loop(self) -> asyncio.Runner:
        if self._runner is None:
            self._runner = asyncio.Runner()
        return self._runner

    def _show(self, exc: Exception) -> None:
        # The first traceback of each worker goes to the service's log, in full.
        if not self._shown_traceback:
            self._shown_traceback = True
            print("the reward function raised (first error of this worker):", file=sys.stderr)
            traceback.print_exception(exc, file=sys.stderr)


async def _awaited(awaitable):
    return await awaitable


def main() -> None:
    channel = Channel()  # what the function prints goes to stderr
    target, folder = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    try:
        function = load_function(target, folder)
    except LoadError as exc:
        channel.refuse(str(exc))
    channel.serve(_Caller(function))


if __name__ == "__main__":
    main()
