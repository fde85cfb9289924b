"""A job's sampling settings are read from its spec in one place (SamplingParams.from_spec),
for the rollout workers, the synchronous demo and the trainer's greedy evaluation."""

from asyncrl.engine.types import SamplingParams
from asyncrl.spec import load_manifest
from support import ROOT


def test_the_rollout_settings_of_the_spec_and_their_greedy_variant():
    spec = load_manifest(ROOT / "examples" / "arith.yaml").spec  # maxNewTokens 64, temperature 0.6
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"top_p": 0.9,
                                                                              "top_k": 20})})
    params = SamplingParams.from_spec(spec)
    assert params == SamplingParams(max_new_tokens=64, temperature=0.6, top_p=0.9, top_k=20)
    params.check()
    # Evaluation: the same response budget, greedy, nothing else of the rollout's sampling.
    assert SamplingParams.from_spec(spec, greedy=True) == SamplingParams(max_new_tokens=64,
                                                                         temperature=0)
