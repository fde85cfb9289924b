"""What a well-formed group is, checked on its encoded bytes.

A put group holds tens of thousands of token ids, log-probs and versions. Decoding them into
one Python object each costs milliseconds per group, more than the rest of a put, so the
buffer reads the group as an EncodedGroup (buffer.proto): upb parses the structure and hands
over each sample's packed token fields as bytes, which are counted and checked with whole-
buffer byte operations (bytes.translate, numpy). A group whose token fields are not packed
(valid protobuf, written by no common library) or that fails a check is decoded in full and
checked element by element, which also words the error for the sample at fault.
"""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from asyncrl.buffer.store import InvalidArgument, JobConfig
from asyncrl.v1 import buffer_pb2, common_pb2

_MAX_VARINT = 10  # bytes


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
    if len(group.samples) != job.group_size:
        raise InvalidArgument(
            f"group has {len(group.samples)} samples; job {job.name!r} has algorithm.groupSize "
            f"{job.group_size}: put whole groups"
        )
    try:
        return group.group_id, _oldest_version(group)
    except _Unchecked:
        try:
            decoded = common_pb2.Group.FromString(data)
        except DecodeError as exc:
            raise InvalidArgument(f"group is not an encoded asyncrl.v1.Group: {exc}") from None
        return group.group_id, check_decoded(decoded)


def _oldest_version(group: buffer_pb2.EncodedGroup) -> int:
    prompts, responses, versions, logprob_bytes = [], [], [], []
    for sample in group.samples:
        if len(UnknownFieldSet(sample)):  # unpacked token fields, or fields newer than ours
            raise _Unchecked
        prompts.append(_joined(sample.prompt_ids))
        responses.append(_joined(sample.response_ids))
        versions.append(_joined(sample.token_versions))
        logprob_bytes.append(sum(len(chunk) for chunk in sample.behaviour_logprobs))
    prompts, responses, versions = _Varints(prompts), _Varints(responses), _Varints(versions)
    for prompt, n, logprobs, v in zip(prompts.counts, responses.counts, logprob_bytes,
                                       versions.counts):
        if not prompt or logprobs != 4 * n or v != n:
            raise _Unchecked
    # A token id is negative (as int32) only in a varint of 5 bytes or more; real ids are
    # shorter, so ids are decoded only when such a varint is there.
    for ids in (prompts, responses):
        if ids.longest() >= 5 and (ids.values() & (1 << 31)).any():
            raise _Unchecked
    if not versions.data:
        return 0
    oldest = int(versions.values().view(np.int64).min())
    if oldest < 0:
        raise _Unchecked
    return oldest


def _joined(chunks) -> bytes:
    """A packed field's chunks as one; each must end where its last varint does."""
    for chunk in chunks:
        if chunk and chunk[-1] & 0x80:
            raise _Unchecked
    return b"".join(chunks)


class _Varints:
    """One packed varint field of every sample, joined: its varints per sample and, on demand,
    their values. A varint is bytes with the high bit set ended by one without it."""

    def __init__(self, fields: list[bytes]):
        self.data = b"".join(fields)
        self._raw = np.frombuffer(self.data, np.uint8)
        self._ends = np.flatnonzero(self._raw < 0x80)
        bounds = np.searchsorted(self._ends, np.cumsum([0] + [len(f) for f in fields]))
        self.counts = np.diff(bounds).tolist()

    def longest(self) -> int:
        """Bytes of the longest varint."""
        if not len(self._ends):
            return 0
        return int(max(self._ends[0] + 1, np.diff(self._ends).max(initial=0)))

    def values(self) -> np.ndarray:
        """The values (uint64). Each varint is read back from its last byte, which holds the
        highest 7 bits, one byte per pass: as many passes as the longest varint has bytes
        (1 or 2 for versions)."""
        longest = self.longest()
        if longest > _MAX_VARINT:
            raise _Unchecked
        # Zero bytes in front end a varint, so reading back from the first one stops there.
        raw = np.concatenate([np.zeros(longest, np.uint8), self._raw])
        ends = self._ends + longest
        values = raw[ends].astype(np.uint64)
        inside = np.ones(len(ends), bool)
        for back in range(1, longest):
            byte = raw[ends - back]
            inside &= byte >= 0x80
            values = np.where(inside, (values << np.uint64(7)) | (byte & 0x7F), values)
        return values


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
        if min(sample.prompt_ids) < 0 or (n and min(sample.response_ids) < 0):
            raise InvalidArgument(f"{where} has a negative token id")
        if n:
            low = min(sample.token_versions)
            if low < 0:
                raise InvalidArgument(f"{where}.token_versions has a negative version")
            oldest = low if oldest is None else min(oldest, low)
    return oldest or 0
