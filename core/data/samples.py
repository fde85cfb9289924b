"""The sample path's data types, shared by rollout, buffer and trainer: a rollout slot granted
by the staleness gate, one scored response (Trajectory) and the group of n responses to one
prompt that the buffer stores and the trainer consumes. Each converts to and from its protobuf
message (asyncrl.v1.common), which is what crosses the wire."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.v1 import common_pb2


@dataclass(frozen=True)
class Trajectory:
    """One response as the trainer consumes it (the protobuf Trajectory, as Python)."""

    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[int]
    reward: float
    finish_reason: str
    generate_seconds: float
    reward_seconds: float
    # 1 where the model generated the response token, 0 where an episode's environment or
    # tool wrote it; empty: every response token is the model's (a single-turn response).
    response_mask: list[int] = field(default_factory=list)
    # Part of the same episode as the sample before it in its group (an episode whose turns
    # did not merge into one sequence); single-turn samples are each their own episode.
    continues_episode: bool = False

    @property
    def loss_mask(self) -> list[int]:
        return loss_mask(self)

    @property
    def model_tokens(self) -> int:
        """The response tokens the model generated (those in the loss)."""
        return sum(map(bool, self.response_mask)) if self.response_mask else len(self.response_ids)

    def to_pb(self) -> common_pb2.Trajectory:
        return common_pb2.Trajectory(
            prompt_ids=self.prompt_ids, response_ids=self.response_ids,
            behaviour_logprobs=self.behaviour_logprobs, token_versions=self.token_versions,
            reward=self.reward, finish_reason=self.finish_reason,
            generate_seconds=self.generate_seconds, reward_seconds=self.reward_seconds,
            response_mask=[bool(m) for m in self.response_mask],
            continues_episode=self.continues_episode,
        )

    @classmethod
    def from_pb(cls, message: common_pb2.Trajectory) -> Trajectory:
        return cls(
            prompt_ids=list(message.prompt_ids), response_ids=list(message.response_ids),
            behaviour_logprobs=list(message.behaviour_logprobs),
            token_versions=list(message.token_versions), reward=message.reward,
            finish_reason=message.finish_reason, generate_seconds=message.generate_seconds,
            reward_seconds=message.reward_seconds,
            response_mask=[int(m) for m in message.response_mask],
            continues_episode=message.continues_episode,
        )


@dataclass(frozen=True)
class Group:
    """One prompt's groupSize responses, or groupSize episodes (an episode is one sample, or
    several when its turns did not merge: `Trajectory.continues_episode`)."""

    group_id: str
    prompt_id: str
    samples: list[Trajectory]
    started_unix_ms: int

    @property
    def episode_rewards(self) -> list[float]:
        return episode_rewards(self.samples)

    def to_pb(self) -> common_pb2.Group:
        return common_pb2.Group(
            group_id=self.group_id, prompt_id=self.prompt_id,
            samples=[s.to_pb() for s in self.samples], started_unix_ms=self.started_unix_ms,
        )

    @classmethod
    def from_pb(cls, message: common_pb2.Group) -> Group:
        return cls(message.group_id, message.prompt_id,
                   [Trajectory.from_pb(s) for s in message.samples], message.started_unix_ms)


@dataclass(frozen=True)
class Slot:
    slot_id: str
    # The prompt to generate for, as the buffer's prompt cursor (asyncrl.data.prompt_order).
    prompt_cursor: int = 0


# The rules below read a Trajectory or its protobuf message alike.


def loss_mask(sample) -> list[int]:
    """1 on the model's tokens, 0 on the prompt and on an episode's environment tokens, over
    prompt + response."""
    response = len(sample.response_ids)
    if not sample.response_mask:
        return [0] * len(sample.prompt_ids) + [1] * response
    if len(sample.response_mask) != response:
        raise ValueError(f"a sample's response_mask has {len(sample.response_mask)} entries for "
                         f"{response} response tokens: it needs one per response token")
    return [0] * len(sample.prompt_ids) + [int(bool(m)) for m in sample.response_mask]


def episode_of_each(samples) -> list[int]:
    """Each sample's episode within its group (0, 1, ...): a sample marked continues_episode
    belongs to the episode of the sample before it."""
    episodes: list[int] = []
    for sample in samples:
        if not episodes:
            episodes.append(0)
        else:
            episodes.append(episodes[-1] + (0 if sample.continues_episode else 1))
    return episodes


def episode_rewards(samples) -> list[float]:
    """Each episode's reward: that of its last sample."""
    last: dict[int, float] = {}
    for episode, sample in zip(episode_of_each(samples), samples):
        last[episode] = sample.reward
    return list(last.values())
