"""The buffer checks a put group on its encoded bytes (asyncrl.buffer.groups): for every group,
well formed or not, it must decide exactly as the element-by-element check of the decoded
group does, with the same error."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.buffer import groups
from asyncrl.buffer.groups import check_decoded, check_group
from asyncrl.buffer.store import InvalidArgument, JobConfig
from asyncrl.v1 import buffer_pb2, common_pb2

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
        response_mask=draw(st.lists(st.booleans(), max_size=response + 1)),
        reward=1.0, finish_reason="stop",
    )


# Well-formed samples, as workers put them: ids of every varint length a real vocabulary has
# (and the largest int32), versions of one to three bytes (and some past the fast path's).
ordinary_ids = st.one_of(st.integers(0, 200_000), st.sampled_from([127, 128, 16383, 16384]))
ordinary_versions = st.one_of(st.integers(0, 300), st.sampled_from([127, 128, 16383, 16384]))
large_ids = st.one_of(ordinary_ids, st.just(2**31 - 1))
large_versions = st.one_of(ordinary_versions, st.sampled_from([2**28, 2**40, 2**63 - 1]))


@st.composite
def well_formed_samples(draw, ids=ordinary_ids, versions=ordinary_versions):
    response = draw(st.integers(0, 6))
    return common_pb2.Trajectory(
        prompt_ids=draw(st.lists(ids, min_size=1, max_size=4)),
        response_ids=draw(st.lists(ids, min_size=response, max_size=response)),
        behaviour_logprobs=[-0.5] * response,
        token_versions=draw(st.lists(versions, min_size=response, max_size=response)),
        # None (every token the model's), or one entry per response token.
        response_mask=draw(st.one_of(st.just([]), st.lists(st.booleans(), min_size=response,
                                                             max_size=response))),
        reward=1.0, finish_reason="stop",
    )


@st.composite
def flawed_samples(draw):
    """A well-formed sample with one thing wrong."""
    sample = draw(well_formed_samples())
    flaw = draw(st.sampled_from(["empty prompt", "negative id", "extra log-prob", "extra version",
                                 "missing version", "negative version", "extra mask entry"]))
    if flaw == "extra mask entry":
        sample.response_mask[:] = [True] * (len(sample.response_ids) + 1)
    elif flaw == "empty prompt":
        del sample.prompt_ids[:]
    elif flaw == "negative id":
        sample.prompt_ids.append(draw(st.sampled_from([-1, -(2**31)])))
    elif flaw == "extra log-prob":
        sample.behaviour_logprobs.append(-1.0)
    elif flaw == "extra version":
        sample.token_versions.append(0)
    else:  # one more response token, its version missing or negative
        sample.response_ids.append(1)
        sample.behaviour_logprobs.append(-1.0)
        if flaw == "negative version":
            sample.token_versions.append(-1)
    return sample


def outcome(check):
    try:
        return check()
    except InvalidArgument as exc:
        return str(exc)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(samples(), well_formed_samples(large_ids, large_versions),
                          flawed_samples()), min_size=3, max_size=3))
def test_the_check_on_bytes_decides_as_the_decoded_check(group_samples):
    group = common_pb2.Group(group_id="g", samples=group_samples)
    assert outcome(lambda: check_group(group.SerializeToString(), JOB)) == \
        outcome(lambda: ("g", check_decoded(group)))


@settings(max_examples=300, deadline=None)
@given(st.lists(well_formed_samples(), min_size=3, max_size=3))
def test_ordinary_groups_are_checked_on_their_bytes_alone(group_samples):
    """The oldest version of a well-formed group, read without decoding it."""
    group = common_pb2.Group(group_id="g", samples=group_samples)
    versions = [v for sample in group_samples for v in sample.token_versions]
    with mock.patch.object(groups, "common_pb2", None):  # the full decode would fail
        assert check_group(group.SerializeToString(), JOB) == ("g", min(versions, default=0))


@settings(max_examples=200, deadline=None)
@given(st.lists(well_formed_samples(large_ids, large_versions), min_size=3, max_size=3))
def test_well_formed_groups_with_large_values_are_accepted(group_samples):
    group = common_pb2.Group(group_id="g", samples=group_samples)
    versions = [v for sample in group_samples for v in sample.token_versions]
    assert check_group(group.SerializeToString(), JOB) == ("g", min(versions, default=0))


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


def test_a_token_field_that_ends_inside_a_varint_is_refused():
    """Packed ids whose last byte says another follows: no protobuf library reads that."""
    sample = buffer_pb2.EncodedTrajectory(
        prompt_ids=[b"\x01"], response_ids=[b"\x05\x85"], behaviour_logprobs=[b"\x00" * 4],
        token_versions=[b"\x00"])
    data = buffer_pb2.EncodedGroup(group_id="g", samples=[sample] * 3).SerializeToString()
    with pytest.raises(InvalidArgument, match="not an encoded asyncrl.v1.Group"):
        check_group(data, JOB)


@pytest.mark.parametrize("data", [b"\x0a\x05g", b"\x1a\x02\x0a\x85", b"\xff"])
def test_bytes_that_are_no_group_are_refused(data):
    with pytest.raises(InvalidArgument, match="not an encoded asyncrl.v1.Group"):
        check_group(data, JOB)


# Episodes: a group holds groupSize episodes; an episode whose turns did not merge into one
# sequence gives several samples, the later ones marked continues_episode.

EPISODES_JOB = JobConfig(name="j", max_staleness=1, batch_size=1, group_size=2)


def turn(versions: list[int], mask: list[bool] = (), continues: bool = False):
    """A sample of `len(versions)` response tokens."""
    return common_pb2.Trajectory(
        prompt_ids=[1, 2], response_ids=[3] * len(versions),
        behaviour_logprobs=[-0.5] * len(versions), token_versions=versions,
        response_mask=mask, continues_episode=continues, reward=1.0, finish_reason="stop")


def encoded(*samples) -> bytes:
    return common_pb2.Group(group_id="g", samples=samples).SerializeToString()


def test_a_group_of_two_episodes_in_three_samples_is_accepted():
    data = encoded(turn([4, 4, 4], [True, False, True]),
                   turn([5, 5], [True, True], continues=True),
                   turn([6]))
    with mock.patch.object(groups, "common_pb2", None):  # on the bytes alone
        assert check_group(data, EPISODES_JOB) == ("g", 4)


@pytest.mark.parametrize("samples", [
    [turn([4]), turn([5], continues=True)],              # one episode
    [turn([4]), turn([5]), turn([6])],                   # three episodes
    [turn([4]), turn([5]), turn([6]), turn([7], continues=True)],
])
def test_a_group_of_another_number_of_episodes_is_refused(samples):
    with pytest.raises(InvalidArgument, match=r"episodes .* algorithm.groupSize 2: put whole"):
        check_group(encoded(*samples), EPISODES_JOB)


def test_a_first_sample_that_continues_an_episode_is_refused():
    data = encoded(turn([4], continues=True), turn([5]), turn([6]))
    with pytest.raises(InvalidArgument, match=r"samples\[0\].continues_episode is true"):
        check_group(data, EPISODES_JOB)


@pytest.mark.parametrize("mask", [[True], [True, False, True, True]])
def test_a_response_mask_of_the_wrong_length_is_refused(mask):
    data = encoded(turn([4]), turn([4, 4, 4], mask))
    with pytest.raises(InvalidArgument, match=r"group.samples\[1\].response_mask has"):
        check_group(data, EPISODES_JOB)
    with pytest.raises(InvalidArgument, match=r"group.samples\[1\].response_mask has"):
        check_decoded(common_pb2.Group.FromString(data))


def test_a_mask_written_as_long_varints_is_read_by_the_full_decode():
    """Bools of two bytes each (valid protobuf no library writes): the bytes per token no longer
    count the entries, so the fast path leaves the group to the decoded check."""
    def with_mask(entries: bytes) -> bytes:
        sample = turn([4, 4]).SerializeToString() + b"\x4a" + _varint(len(entries)) + entries
        other = turn([4]).SerializeToString()
        return (b"\x0a\x01g" + b"\x1a" + _varint(len(sample)) + sample
                + b"\x1a" + _varint(len(other)) + other)

    assert check_group(with_mask(b"\x81\x00\x80\x00"), EPISODES_JOB) == ("g", 4)  # 2 entries
    with pytest.raises(InvalidArgument, match=r"samples\[0\].response_mask has 1 entries"):
        check_group(with_mask(b"\x81\x00"), EPISODES_JOB)


def test_masked_tokens_carry_real_versions_and_count_for_the_oldest():
    """An environment token takes the version of the model token before it: a real version,
    checked like any other and counted for the group's oldest version."""
    masked_oldest = encoded(turn([7, 3, 7], [True, False, True]), turn([8]))
    assert check_group(masked_oldest, EPISODES_JOB) == ("g", 3)
    unversioned = encoded(turn([7, -1, 7], [True, False, True]), turn([8]))
    with pytest.raises(InvalidArgument, match=r"samples\[0\].token_versions has a negative"):
        check_group(unversioned, EPISODES_JOB)
