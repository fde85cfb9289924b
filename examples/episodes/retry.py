"""A multi-turn episode where the environment answers: the model may try again after "That is
not right." Rewarded on its final answer, half as much on the second try.

Use it with (see retry.yaml beside this file):

    rollout:
      workflow:
        kind: episode
        function: retry:episode
        path: examples/episodes

The rollout worker calls `episode(client, row)` for each of a prompt's groupSize episodes.
`client` is an `openai.AsyncOpenAI` whose calls are recorded and trained on: the model's
answers are in the loss, the environment's replies are not. `row` is the dataset row; for
the generated arith dataset {"prompt_id", "prompt", "answer"}.
"""

from answers import is_right

TRIES = 2
RETRY = "That is not right. Try again, and give the final answer as \\boxed{N}."


async def episode(client, row: dict) -> float:
    model = (await client.models.list()).data[0].id
    messages = [{"role": "user", "content": row["prompt"]}]
    for attempt in range(TRIES):
        reply = await client.chat.completions.create(model=model, messages=messages)
        answer = reply.choices[0].message.content or ""
        if is_right(answer, row["answer"]):
            return 0.5 ** attempt
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": RETRY}]
    return 0.0

