"""The generated gRPC modules import, and every message survives a wire round trip with
every field set to a non-default value."""

import importlib

import pytest
from google.protobuf.descriptor import FieldDescriptor

MODULES = ["common", "buffer", "reward", "rollout", "trainer"]


def _messages():
    for name in MODULES:
        module = importlib.import_module(f"asyncrl.v1.{name}_pb2")
        for descriptor in module.DESCRIPTOR.message_types_by_name.values():
            yield pytest.param(getattr(module, descriptor.name), id=f"{name}.{descriptor.name}")


def _fill(message, depth=0):
    """Sets every field (and one member of each oneof, the first) to a distinct value."""
    seen_oneofs = set()
    for index, field in enumerate(message.DESCRIPTOR.fields, start=1):
        oneof = field.containing_oneof
        if oneof is not None:
            if oneof.name in seen_oneofs:
                continue
            seen_oneofs.add(oneof.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            key, value = (field.message_type.fields_by_name[name] for name in ("key", "value"))
            getattr(message, field.name)[_value(key, index)] = _value(value, index)
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth > 3:
                continue
            target = getattr(message, field.name)
            child = target.add() if field.is_repeated else target
            _fill(child, depth + 1)
            if not child.ListFields() and not field.is_repeated:
                child.SetInParent()
            continue
        value = _value(field, index)
        if field.is_repeated:
            getattr(message, field.name).extend([value, value])
        else:
            setattr(message, field.name, value)
    return message


def _value(field, index):
    if field.type == FieldDescriptor.TYPE_BOOL:
        return True
    if field.type == FieldDescriptor.TYPE_STRING:
        return f"value-{index}"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return bytes([index])
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1].number
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return index + 0.5
    return -index if field.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64) else index


@pytest.mark.parametrize("message_type", list(_messages()))
def test_round_trip_preserves_every_field(message_type):
    original = _fill(message_type())
    decoded = message_type.FromString(original.SerializeToString())
    assert decoded == original
    oneofs = {f.containing_oneof.name for f in message_type.DESCRIPTOR.fields if f.containing_oneof}
    expected = len(message_type.DESCRIPTOR.fields) - sum(
        len(message_type.DESCRIPTOR.oneofs_by_name[o].fields) - 1 for o in oneofs
    )
    assert len(decoded.ListFields()) == expected


def test_services_have_stubs_and_servicers():
    for name, service in [
        ("buffer", "Buffer"),
        ("reward", "Reward"),
        ("rollout", "RolloutControl"),
        ("trainer", "TrainerStatusService"),
    ]:
        grpc_module = importlib.import_module(f"asyncrl.v1.{name}_pb2_grpc")
        assert hasattr(grpc_module, f"{service}Stub")
        assert hasattr(grpc_module, f"{service}Servicer")
        assert hasattr(grpc_module, f"add_{service}Servicer_to_server")


def test_the_buffers_encoded_messages_read_and_write_the_clients_bytes():
    """The buffer reads PutGroupRequest as EncodedPutGroupRequest, a Group as EncodedGroup, and
    writes Batch as EncodedBatch (buffer.proto): the bytes must be each other's."""
    from asyncrl.v1 import buffer_pb2, common_pb2

    group = _fill(common_pb2.Group())
    request = buffer_pb2.PutGroupRequest(job="j", slot_id="s", group=group, acquire_next=True,
                                         worker="w")
    encoded = buffer_pb2.EncodedPutGroupRequest.FromString(request.SerializeToString())
    assert (encoded.job, encoded.slot_id, encoded.acquire_next, encoded.worker) == \
        ("j", "s", True, "w")
    assert common_pb2.Group.FromString(encoded.group) == group
    assert buffer_pb2.PutGroupRequest.FromString(encoded.SerializeToString()) == request
    view = buffer_pb2.EncodedGroup.FromString(encoded.group)
    assert common_pb2.Group.FromString(view.SerializeToString()) == group
    batch = buffer_pb2.EncodedBatch(batch_id="b", groups=[encoded.group] * 2, dropped_stale=1,
                                    redelivered=True)
    assert buffer_pb2.Batch.FromString(batch.SerializeToString()) == buffer_pb2.Batch(
        batch_id="b", groups=[group] * 2, dropped_stale=1, redelivered=True)
