"""One place per service maps exceptions to gRPC status codes: a decorator for async servicer
methods, built from the service's own `status_for(exception) -> (code, message)`."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable

import grpc

log = logging.getLogger(__name__)

StatusFor = Callable[[Exception], "tuple[grpc.StatusCode, str]"]


def map_errors(status_for: StatusFor, service: str):
    """Every failure of a decorated method (a coroutine, or an async generator that streams
    its replies) becomes a status with its message, never a crash of the server; unexpected
    ones (INTERNAL) are also logged with their traceback."""

    def decorate(method):
        async def abort(context, exc: Exception):
            code, message = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("%s %s failed", service, method.__name__)
            await context.abort(code, message)

        if inspect.isasyncgenfunction(method):
            @functools.wraps(method)
            async def streaming(self, request, context):
                try:
                    async for reply in method(self, request, context):
                        yield reply
                except Exception as exc:  # noqa: BLE001
                    await abort(context, exc)

            return streaming

        @functools.wraps(method)
        async def wrapper(self, request, context):
            try:
                return await method(self, request, context)
            except Exception as exc:  # noqa: BLE001
                await abort(context, exc)

        return wrapper

    return decorate
