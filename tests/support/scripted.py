"""A generate function (InferenceEngine.generate's signature) that answers with chosen text:
for the OpenAI-compatible API's tests, where a random model would never write a tool call or
a right answer."""

from __future__ import annotations

from asyncrl.engine.types import GenerationResult, SamplingParams


class Scripted:
    """Answers the k-th request with the tokens of `texts[k]` (the last text once they run
    out) then EOS, a real tokenizer round trip; records the prompts it was given. Every token
    has log-prob -0.5 and version 3."""

    def __init__(self, tokenizer, *texts: str):
        self.tokenizer = tokenizer
        self.answers = [tokenizer.encode(text, add_special_tokens=False)
                        + [tokenizer.eos_token_id] for text in texts]
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    @property
    def ids(self) -> list[int]:
        """The first answer's tokens."""
        return self.answers[0]

    async def __call__(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        answer = self.answers[min(len(self.prompts), len(self.answers) - 1)]
        self.prompts.append(prompt_ids)
        self.params.append(params)
        ids = answer[:params.max_new_tokens]
        return GenerationResult("scripted", prompt_ids, ids, [-0.5] * len(ids), [3] * len(ids),
                                "stop" if ids[-1] == self.tokenizer.eos_token_id else "length",
                                ids[-1])
