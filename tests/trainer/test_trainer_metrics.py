"""The trainer's Prometheus gauges of a step's policy and optimiser signals and of an
evaluation's standard error (services/trainer/metrics.py): set from the records, and no
series before a record carries a value."""

import pytest

from asyncrl.trainer.metrics import TrainerMetrics

LABELS = {"rljob": "t"}
MISMATCH = {
    "asyncrl_trainer_mismatch_logprob_abs_mean_nats": 0.002,
    "asyncrl_trainer_mismatch_logprob_abs_max_nats": 0.25,
    "asyncrl_trainer_mismatch_k3_nats": 0.0001,
    "asyncrl_trainer_mismatch_outside_ratio": 0.01,
}


def _record(**fields) -> dict:
    base = {"trained_tokens": 10, "trained_samples": 2, "version": 1, "step_seconds": 0.3,
            "staleness": [0, 1], "reward_mean": 0.5, "loss": 0.1, "clip_fraction": 0.125}
    return base | fields


def _signals(**fields) -> dict:
    return _record(**{"entropy": 1.5, "response_length_mean": 12.5, "truncated_fraction": 0.25,
                      "learning_rate": 1e-6, "mismatch_tokens": 40, "mismatch_abs_mean": 0.002,
                      "mismatch_abs_max": 0.25, "mismatch_k3": 0.0001,
                      "mismatch_outside_fraction": 0.01} | fields)


def _value(metrics: TrainerMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, LABELS)


def test_a_step_record_sets_the_signal_gauges():
    metrics = TrainerMetrics("t")
    metrics.observe_step(_signals())
    assert _value(metrics, "asyncrl_trainer_entropy_nats") == 1.5
    assert _value(metrics, "asyncrl_trainer_response_length_mean_tokens") == 12.5
    assert _value(metrics, "asyncrl_trainer_truncated_responses_ratio") == 0.25
    assert _value(metrics, "asyncrl_trainer_clipped_tokens_ratio") == 0.125
    assert _value(metrics, "asyncrl_trainer_learning_rate") == 1e-6
    assert {name: _value(metrics, name) for name in MISMATCH} == MISMATCH


def test_a_step_without_tokens_of_the_current_version_leaves_the_mismatch_as_it_was():
    metrics = TrainerMetrics("t")
    unmeasured = dict(mismatch_tokens=0, mismatch_abs_mean=None, mismatch_abs_max=None,
                      mismatch_k3=None, mismatch_outside_fraction=None)
    metrics.observe_step(_record(**unmeasured))
    assert all(_value(metrics, name) is None for name in MISMATCH)  # no series, not a 0
    metrics.observe_step(_signals())
    metrics.observe_step(_signals(entropy=1.25) | unmeasured)
    assert {name: _value(metrics, name) for name in MISMATCH} == MISMATCH
    assert _value(metrics, "asyncrl_trainer_entropy_nats") == 1.25


def test_an_old_or_megatron_record_makes_no_series_for_what_it_lacks():
    metrics = TrainerMetrics("t")
    metrics.observe_step(_record())  # no entropy (Megatron), nor the newer fields
    for name in ("asyncrl_trainer_entropy_nats", "asyncrl_trainer_response_length_mean_tokens",
                 "asyncrl_trainer_learning_rate", "asyncrl_trainer_eval_stderr_ratio"):
        assert _value(metrics, name) is None, name
    assert _value(metrics, "asyncrl_trainer_clipped_tokens_ratio") == 0.125


@pytest.mark.parametrize("observe", ["step", "eval"])
def test_an_evaluation_sets_accuracy_and_its_standard_error(observe):
    metrics = TrainerMetrics("t")
    evaluation = {"eval_accuracy": 0.8125, "eval_stderr": 0.0309, "eval_problems": 160,
                  "eval_truncated_fraction": 0.0625}
    if observe == "step":
        metrics.observe_step(_record(**evaluation))
    else:
        metrics.observe_eval(evaluation)
    assert _value(metrics, "asyncrl_trainer_eval_accuracy_ratio") == 0.8125
    assert _value(metrics, "asyncrl_trainer_eval_stderr_ratio") == 0.0309
    assert _value(metrics, "asyncrl_trainer_eval_truncated_ratio") == 0.0625


def test_no_held_out_prompts_no_evaluation_series():
    metrics = TrainerMetrics("t")
    metrics.observe_eval({})
    assert _value(metrics, "asyncrl_trainer_eval_accuracy_ratio") is None
    assert _value(metrics, "asyncrl_trainer_eval_stderr_ratio") is None
    assert _value(metrics, "asyncrl_trainer_eval_truncated_ratio") is None
