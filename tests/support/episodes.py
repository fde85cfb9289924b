"""An episode function for the jobs the tests run with the tiny random model."""

import textwrap

# Two turns whatever the random model says; rewarded on the second answer's length, so the
# episodes of a group differ and every group carries a signal.
TWO_TURNS = textwrap.dedent("""
    async def episode(client, row):
        model = (await client.models.list()).data[0].id
        messages = [{"role": "user", "content": row["prompt"]}]
        first = await client.chat.completions.create(model=model, messages=messages,
                                                     max_tokens=8)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Once more, please."}]
        second = await client.chat.completions.create(model=model, messages=messages,
                                                      max_tokens=8)
        return float(len(second.choices[0].message.content) % 2)
""")
