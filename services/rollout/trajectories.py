"""An episode's recorded completions as training samples.

Turns merge: a completion whose prompt extends an earlier completion's whole sequence (its
prompt and output) token-for-token continues that sequence. What lies between, the
environment's or a tool's text and the chat template's markers, joins the response masked out
of the loss (log-prob 0, the version of the model token before it); the completion's output
joins it in the loss. The trainer then runs the whole conversation in one forward. A
completion that extends nothing (the agent rewrote the history, or a sequence was already
extended by another completion) starts a sample of its own; the samples of one episode are
marked as such (`Trajectory.continues_episode`) and share its place in the group.

Rewards: the episode returns one number, which is its last completion's reward, or a dict of
rewards by response id. Going back from the last completion, each completion's reward is its
own (0 where none is given) plus `discount` times the next one's, so with the default discount
of 1 every turn shares the episode's reward. A sample's reward is that of its last completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.data.samples import Trajectory
from asyncrl.rollout.episode_record import Completion


@dataclass
class _Sequence:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    last: int = 0  # index of its last completion

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_environment(self, ids: list[int]) -> None:
        version = self.versions[-1] if self.versions else 0
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)

    def add_output(self, completion: Completion, index: int) -> None:
        result = completion.result
        self.response_ids += result.output_ids
        self.mask += [1] * len(result.output_ids)
        self.logprobs += result.output_logprobs
        self.versions += result.output_versions
        self.last = index


def turn_rewards(completions: list[Completion], rewards: float | dict[str, float],
                 discount: float = 1.0) -> list[float]:
    """Each completion's reward (see the module's docstring)."""
    if isinstance(rewards, dict):
        own = [float(rewards.get(c.response_id, 0.0)) for c in completions]
    else:
        own = [0.0] * (len(completions) - 1) + [float(rewards)]
    total, back = 0.0, []
    for value in reversed(own):
        total = value + discount * total
        back.append(total)
    return back[::-1]


def episode_samples(completions: list[Completion], rewards: float | dict[str, float], *,
                    discount: float = 1.0, seconds: float = 0.0) -> list[Trajectory]:
    """The training samples of one episode's completions (in the order they were made)."""
    if not completions:
        raise ValueError("an episode with no completions has nothing to train on")
    sequences: list[_Sequence] = []
    for index, completion in enumerate(completions):
        prompt = completion.prompt_ids
        sequence = max((s for s in sequences if len(s.ids) <= len(prompt)
                        and prompt[:len(s.ids)] == s.ids), key=lambda s: len(s.ids), default=None)
        if sequence is None:
            sequence = _Sequence(list(prompt))
            sequences.append(sequence)
        else:  # extended in place: what it was is a prefix of what it becomes
            sequence.add_environment(prompt[len(sequence.ids):])
        sequence.add_output(completion, index)
    per_turn = turn_rewards(completions, rewards, discount)
    return [
        Trajectory(
            prompt_ids=s.prompt_ids, response_ids=s.response_ids, behaviour_logprobs=s.logprobs,
            token_versions=s.versions, reward=per_turn[s.last],
            finish_reason=completions[s.last].result.finish_reason,
            generate_seconds=seconds, reward_seconds=0.0,
            # An all-ones mask is the single-turn sample's empty one.
            response_mask=s.mask if 0 in s.mask else [],
            continues_episode=position > 0,
        )
        for position, s in enumerate(sequences)
    ]
