"""Prompts of both datasets, scored through a real reward service."""

import pytest

from asyncrl.data import code_tasks
from asyncrl.model.policy import load_tokenizer
from asyncrl.data.prompts import build_prompts
from asyncrl.clients.reward import PromptScorer, RewardClient, reward_scorer
from asyncrl.spec import load_manifest
from support import ROOT
from support.reward import RewardThread


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_code_tasks_are_deterministic_and_their_tests_accept_a_right_answer():
    tasks = code_tasks.generate(30, seed=1, difficulty=5)
    assert tasks == code_tasks.generate(30, seed=1, difficulty=5)
    affine = next(t for t in tasks if "`f(x)`" in t.question)
    a, b = [int(w) for w in affine.question.replace(".", " ").split() if w.isdigit()]
    namespace = {}
    exec(f"def f(x):\n    return {a} * x + {b}\n{affine.test_code}", namespace)  # our own code
    with pytest.raises(AssertionError):
        exec(f"def f(x):\n    return {a} * x\n{affine.test_code}", {})


@pytest.mark.parametrize("example", ["arith.yaml", "code.yaml"])
def test_prompts_are_chat_formatted_and_split(example, tokenizer):
    spec = load_manifest(ROOT / "examples" / example).spec
    train, held_out = build_prompts(spec, tokenizer)
    assert len(held_out) == round(spec.dataset.num_prompts * spec.dataset.eval_fraction)
    assert len(train) + len(held_out) == spec.dataset.num_prompts
    text = tokenizer.decode(train[0].prompt_ids)
    assert text.startswith("<|im_start|>") and text.rstrip().endswith("assistant")
    assert {i.prompt_id for i in train}.isdisjoint({i.prompt_id for i in held_out})


def test_prompt_scorer_scores_math_and_code_through_the_reward_service(tokenizer):
    import asyncio

    code_spec = load_manifest(ROOT / "examples/code.yaml").spec
    code_item = next(i for i in build_prompts(code_spec, tokenizer)[0]
                     if "`f(x)`" in i.reference.question)
    a, b = [int(w) for w in code_item.reference.question.replace(".", " ").split() if w.isdigit()]
    right = f"Here:\n```python\ndef f(x):\n    return {a} * x + {b}\n```"
    wrong = "```python\ndef f(x):\n    return 0\n```"
    arith_spec = load_manifest(ROOT / "examples/arith.yaml").spec
    math_item = build_prompts(arith_spec, tokenizer)[0][0]
    service = RewardThread(code_spec.reward).start()
    try:
        async def score():
            client = RewardClient(service.address, service.job)
            scorer = PromptScorer(client, tokenizer)
            encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
            code = await scorer.score(code_item, [encode(right), encode(wrong)])
            math = await scorer.score(math_item, [encode(f"so \\boxed{{{math_item.reference}}}"),
                                                  encode("\\boxed{-1}")])
            await client.close()
            return code, math

        code, math = asyncio.run(score())
    finally:
        service.close()
    assert code == [1.0, 0.0] and math == [1.0, 0.0]


def test_the_service_and_a_worker_without_it_score_the_same_responses_alike(tokenizer):
    """A rollout worker or trainer given no reward address scores in-process with the reward
    service's own scorer, never with a rule of its own."""
    import asyncio

    spec = load_manifest(ROOT / "examples/arith.yaml").spec
    item = build_prompts(spec, tokenizer)[0][0]
    answer = item.reference
    texts = [f"so \\boxed{{{answer}}}", f"The answer is {answer}.", f"\\boxed{{{answer}.0}}",
             f"\\boxed{{\\frac{{{2 * answer}}}{{2}}}}", f"\\boxed{{{answer + 1}}}",
             f"{answer} apples, so \\boxed{{{answer - 1}}}", "no answer at all", f"{answer:,}"]
    responses = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    service = RewardThread(spec.reward).start()

    async def score_both():
        scores = []
        for address in (service.address, None):
            reward = reward_scorer(address, service.job, spec.reward)
            try:
                scores.append(await PromptScorer(reward, tokenizer).score(item, responses))
            finally:
                await reward.close()
        return scores

    try:
        through_service, in_process = asyncio.run(score_both())
    finally:
        service.close()
    assert through_service == in_process
    assert through_service[:4] == [1.0] * 4 and through_service[4:6] == [0.0, 0.0]


def test_a_cut_response_earns_reward_truncated_reward_whatever_it_stated(tokenizer):
    """reward.truncatedReward: a response cut at maxNewTokens that stated the right answer
    before the cut scores 1 without it and the set value with it; one that ended keeps its
    score."""
    import asyncio

    spec = load_manifest(ROOT / "examples/arith.yaml").spec
    item = build_prompts(spec, tokenizer)[0][0]
    answer = item.reference
    texts = [f"The answer is {answer}.", f"The answer is {answer}.\nLet me check: {answer} + 1",
             f"The answer is {answer + 1}."]
    responses = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    cut = [False, True, True]

    async def score(truncated_reward):
        reward = reward_scorer(None, "job", spec.reward)
        try:
            scorer = PromptScorer(reward, tokenizer, truncated_reward=truncated_reward)
            return await scorer.score(item, responses, cut=cut)
        finally:
            await reward.close()

    assert asyncio.run(score(None)) == [1.0, 1.0, 0.0]
    assert asyncio.run(score(0.0)) == [1.0, 0.0, 0.0]
    assert asyncio.run(score(-0.5)) == [1.0, -0.5, -0.5]


def test_a_wrong_stated_answer_earns_the_format_score_in_training_only(tokenizer):
    """reward.math.formatScore: in the rollout's scorer a response that states a wrong answer
    scores it, a right one 1, one with no answer 0, and a cut one reward.truncatedReward; the
    evaluations' scorer counts right answers alone."""
    import asyncio

    from asyncrl.evaluation import job_scorer

    spec = load_manifest(ROOT / "examples/arith.yaml").spec
    spec.reward.math.format_score = 0.1
    item = build_prompts(spec, tokenizer)[0][0]
    answer = item.reference
    texts = [f"So \\boxed{{{answer}}}.", f"So \\boxed{{{answer + 1}}}.", "I cannot tell.",
             f"So \\boxed{{{answer + 1}}}. Then"]
    responses = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    cut = [False, False, False, True]

    async def score(training):
        reward = reward_scorer(None, "job", spec.reward)
        try:
            return await job_scorer(reward, spec, tokenizer, training=training).score(
                item, responses, cut=cut)
        finally:
            await reward.close()

    assert asyncio.run(score(True)) == [1.0, 0.1, 0.0, 0.0]
    assert asyncio.run(score(False)) == [1.0, 0.0, 0.0, 0.0]
