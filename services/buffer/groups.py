"""What a well-formed group is, checked on its encoded bytes.

A put group holds tens of thousands of token ids, log-probs and versions. Decoding them into
one Python object each costs milliseconds per group, more than the rest of a put, so the
buffer reads the group as an EncodedGroup (buffer.proto): upb parses the structure and hands
over each sample's packed token fields as bytes, which are checked together in a few numpy
passes over the group's token bytes. A group whose token fields are not packed (valid
protobuf, written by no common library), that holds a varint of 5 bytes or more (a negative
id, a version past 2**28) or that fails a check is decoded in full and checked element by
element, which also words the error for the sample at fault.

A group holds algorithm.groupSize episodes: a single-turn sample is an episode of its own, and
a multi-turn episode whose turns did not merge into one sequence gives several samples, each
after the first marked continues_episode. A sample's response_mask (the model's tokens vs the
episode's environment tokens) is empty or has one entry per response token; the tokens it
masks still carry the version of the model token before them, so the oldest version is read
over every response token alike.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from asyncrl.buffer.store import InvalidArgument, JobConfig
from asyncrl.v1 import buffer_pb2, common_pb2


class _Unchecked(Exception):
    """The fast path cannot vouch for the group; the full decode decides."""


def check_group(data: bytes, job: JobConfig) -> tuple[str, int]:
    """Checks an encoded Group put for `job`; returns its group id and oldest token version.
    Raises InvalidArgument naming the field at fault."""
    try:
        group = buffer_pb2.EncodedGroup.FromString(data)
    except DecodeError as exc:
        raise InvalidArgument(f"group is not an encoded asyncrl.v1.Group: {exc}") from None
    if not group.group_id:
        raise InvalidArgument("group.group_id is empty")
    _check_episodes([sample.continues_episode for sample in group.samples], job)
    try:
        return group.group_id, _oldest_version(group)
    except _Unchecked:
        try:
            decoded = common_pb2.Group.FromString(data)
        except DecodeError as exc:
            raise InvalidArgument(f"group is not an encoded asyncrl.v1.Group: {exc}") from None
        return group.group_id, check_decoded(decoded)


def _check_episodes(continues: list[bool], job: JobConfig) -> None:
    """A group is job.group_size episodes; each sample that continues an episode belongs to
    the one before it, so the first sample may not."""
    if continues and continues[0]:
        raise InvalidArgument(
            "group.samples[0].continues_episode is true: a group's first sample starts an "
            "episode (set continues_episode only on the later samples of an episode)"
        )
    episodes = continues.count(False)
    if episodes != job.group_size:
        raise InvalidArgument(
            f"group has {episodes} episodes ({len(continues)} samples, each sample that "
            f"continues an episode marked continues_episode); job {job.name!r} has "
            f"algorithm.groupSize {job.group_size}: put whole groups"
        )


def _oldest_version(group: buffer_pb2.EncodedGroup) -> int:
    fields, logprob_bytes, masks = _token_fields(group)
    going_on = np.frombuffer(b"".join(fields), np.uint8) >= 0x80  # a varint goes on past it
    ends = list(accumulate(map(len, fields)))
    starts = [0, *ends[:-1]]
    # Each field must end where its last varint does. No varint may be 5 bytes or longer:
    # a token id that long may be negative as int32, a version is past 2**28 (or negative).
    last_bytes = [end - 1 for start, end in zip(starts, ends) if end > start]
    if going_on[last_bytes].any() or _four_in_a_row(going_on):
        raise _Unchecked

    def varints(field: int) -> int:  # its bytes less those a varint goes on past
        start, end = starts[field], ends[field]
        return end - start - int(np.count_nonzero(going_on[start:end]))

    for sample, (logprobs, mask) in enumerate(zip(logprob_bytes, masks)):
        prompt, responses, versions = 3 * sample, 3 * sample + 1, 3 * sample + 2
        count = varints(responses)
        # A prompt field that is not empty holds a varint at least (it ends on one).
        if ends[prompt] == starts[prompt] or varints(versions) != count or logprobs != 4 * count:
            raise _Unchecked
        if len(mask) not in (0, count):  # packed bools, one byte each (checked below)
            raise _Unchecked
    mask_bytes = np.frombuffer(b"".join(masks), np.uint8)
    if len(mask_bytes) and mask_bytes.max() >= 0x80:  # a bool as a longer varint: none writes it
        raise _Unchecked
    return _smallest(b"".join(fields[2::3]))


def _token_fields(group: buffer_pb2.EncodedGroup) -> tuple[list[bytes], list[int], list[bytes]]:
    """Each sample's prompt ids, response ids and token versions (packed varints, in that
    order), each sample's bytes of log-probs, and each sample's response mask (packed bools)."""
    fields, logprob_bytes, masks = [], [], []
    for sample in group.samples:
        if len(UnknownFieldSet(sample)):  # unpacked token fields, or fields newer than ours
            raise _Unchecked
        for chunks in (sample.prompt_ids, sample.response_ids, sample.token_versions):
            fields.append(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        logprob_bytes.append(sum(map(len, sample.behaviour_logprobs)))
        masks.append(b"".join(sample.response_mask))
    return fields, logprob_bytes, masks


def _four_in_a_row(going_on: np.ndarray) -> bool:
    pairs = going_on[:-1] & going_on[1:]
    return bool((pairs[:-2] & pairs[2:]).any())


def _smallest(data: bytes) -> int:
    """The smallest of the varints in `data` (each under 5 bytes), 0 for none."""
    raw = np.frombuffer(data, np.uint8)
    if not len(raw):
        return 0
    if raw.max() < 0x80:  # one byte each (versions under 128)
        return int(raw.min())
    ends = np.flatnonzero(raw < 0x80)
    # Each varint read back from its last byte, which holds the highest 7 bits; zero bytes
    # in front end the first varint.
    raw = np.concatenate([np.zeros(4, np.uint8), raw])
    ends += 4
    values = raw[ends].astype(np.int64)
    inside = np.ones(len(ends), bool)
    for back in range(1, 4):
        byte = raw[ends - back]
        inside &= byte >= 0x80
        values = np.where(inside, (values << 7) | (byte & 0x7F), values)
    return int(values.min())


def check_decoded(group: common_pb2.Group) -> int:
    """The token checks on a decoded group, one element at a time; its oldest token version."""
    oldest = None
    for index, sample in enumerate(group.samples):
        where = f"group.samples[{index}]"
        if not sample.prompt_ids:
            raise InvalidArgument(f"{where}.prompt_ids is empty")
        n = len(sample.response_ids)
        if len(sample.behaviour_logprobs) != n or len(sample.token_versions) != n:
            raise InvalidArgument(
                f"{where}: response_ids, behaviour_logprobs and token_versions need one entry "
                f"per response token (got {n}, {len(sample.behaviour_logprobs)}, "
                f"{len(sample.token_versions)})"
            )
        if sample.response_mask and len(sample.response_mask) != n:
            raise InvalidArgument(
                f"{where}.response_mask has {len(sample.response_mask)} entries for {n} "
                f"response tokens: give one per response token (true where the model "
                f"generated it), or none when every token is the model's"
            )
        if min(sample.prompt_ids) < 0 or (n and min(sample.response_ids) < 0):
            raise InvalidArgument(f"{where} has a negative token id")
        if n:
            low = min(sample.token_versions)
            if low < 0:
                raise InvalidArgument(f"{where}.token_versions has a negative version")
            oldest = low if oldest is None else min(oldest, low)
    return oldest or 0
