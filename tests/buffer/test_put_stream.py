"""The client's PutGroups stream against buffers that misbehave, on a real gRPC server on
loopback: a call that ends without answering and one that never answers are each given up,
and the put is sent again on a new call until the outage bound."""

import asyncio

import grpc
import pytest

from asyncrl.clients import buffer as client_module
from asyncrl.clients.buffer import BufferClient
from asyncrl.platform.outage import OutageTooLong
from asyncrl.data.samples import Slot
from asyncrl.v1 import buffer_pb2
from support.buffer import make_group
from support.ports import free_port


async def _serve(handler) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "asyncrl.v1.Buffer", {"PutGroups": grpc.stream_stream_rpc_method_handler(
            handler, request_deserializer=buffer_pb2.PutGroupsRequest.FromString,
            response_serializer=buffer_pb2.PutGroupsResponse.SerializeToString)}),))
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    return server, address


async def _put_against(handler) -> list[int]:
    """Puts one group against a buffer whose PutGroups is `handler`; the puts each call got."""
    calls: list[int] = []

    async def counting(requests, context):
        calls.append(0)
        async for reply in handler(requests, calls):
            yield reply

    server, address = await _serve(counting)
    client = BufferClient(address, "job", "w", outage_seconds=1.5)
    try:
        with pytest.raises(OutageTooLong):
            await client.put(Slot("s"), make_group("g", 2))
    finally:
        await client.close()
        await server.stop(grace=None)
    return calls


def test_a_call_that_ends_without_an_answer_is_opened_again():
    async def ends(requests, calls):
        async for request in requests:
            calls[-1] += len(request.puts)
            return
        yield  # an async generator that answers nothing

    calls = asyncio.run(_put_against(ends))
    assert len(calls) >= 3 and all(puts == 1 for puts in calls)  # each try: a new call


def test_a_call_that_never_answers_is_given_up_after_the_put_timeout(monkeypatch):
    monkeypatch.setattr(client_module, "PUT_TIMEOUT_SECONDS", 0.3)

    async def silent(requests, calls):
        async for request in requests:
            calls[-1] += len(request.puts)
            await asyncio.sleep(3600)
        yield

    calls = asyncio.run(_put_against(silent))
    assert len(calls) >= 2 and all(puts == 1 for puts in calls)
