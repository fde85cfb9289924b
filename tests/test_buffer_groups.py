"""The buffer checks a put group on its encoded bytes (asyncrl.buffer.groups): for every group,
well formed or not, it must decide exactly as the element-by-element check of the decoded
group does, with the same error."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.buffer.groups import check_decoded, check_group
from asyncrl.buffer.store import InvalidArgument, JobConfig
from asyncrl.v1 import common_pb2

JOB = JobConfig(name="j", max_staleness=1, batch_size=1, group_size=3)

# Mostly ordinary values, with the edges of each varint length and of the signed range.
token_ids = st.one_of(st.integers(0, 200_000),
                      st.sampled_from([-1, -(2**31), 2**31 - 1, 127, 128, 16383, 16384]))
versions = st.one_of(st.integers(0, 300),
                     st.sampled_from([-1, -(2**63), 2**63 - 1, 2**40, 16383, 16384]))


@st.composite
def samples(draw):
    response = draw(st.integers(0, 6))
    return common_pb2.Trajectory(
        prompt_ids=draw(st.lists(token_ids, max_size=4)),
        response_ids=draw(st.lists(token_ids, min_size=response, max_size=response)),
        behaviour_logprobs=[-0.5] * (response + draw(st.sampled_from([0, 0, 0, 1]))),
        token_versions=draw(st.lists(versions, min_size=response,
                                     max_size=response + draw(st.sampled_from([0, 0, 0, 1])))),
        reward=1.0, finish_reason="stop",
    )


def outcome(check):
    try:
        return check()
    except InvalidArgument as exc:
        return str(exc)


@settings(max_examples=400, deadline=None)
@given(st.lists(samples(), min_size=3, max_size=3))
def test_the_check_on_bytes_decides_as_the_decoded_check(group_samples):
    group = common_pb2.Group(group_id="g", samples=group_samples)
    assert outcome(lambda: check_group(group.SerializeToString(), JOB)) == \
        outcome(lambda: ("g", check_decoded(group)))


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def test_unpacked_token_fields_are_checked_too():
    """Valid protobuf that no common library writes: each response id as its own field."""
    sample = common_pb2.Trajectory(prompt_ids=[5], behaviour_logprobs=[-1.0, -1.0],
                                   token_versions=[3, 9]).SerializeToString()
    good = sample + b"".join(b"\x10" + _varint(v) for v in [7, 8])
    bad = sample + b"".join(b"\x10" + _varint(v) for v in [7, -8])

    def group(encoded_sample):
        return b"\x0a\x01g" + (b"\x1a" + _varint(len(encoded_sample)) + encoded_sample) * 3

    assert check_group(group(good), JOB) == ("g", 3)
    with pytest.raises(InvalidArgument, match=r"samples\[0\] has a negative token id"):
        check_group(group(bad), JOB)


@pytest.mark.parametrize("data", [b"\x0a\x05g", b"\x1a\x02\x0a\x85", b"\xff"])
def test_bytes_that_are_no_group_are_refused(data):
    with pytest.raises(InvalidArgument, match="not an encoded asyncrl.v1.Group"):
        check_group(data, JOB)
