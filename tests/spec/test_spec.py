"""The RLJob spec: defaults, camelCase, rules, quantities, error lines, examples."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl import spec
from asyncrl.spec import (
    RLJob,
    RLJobSpec,
    ManifestError,
    load_manifest,
    parse_manifest,
    parse_quantity,
    read_manifest,
)
from asyncrl.spec.errors import format_errors, issues, yaml_lines
from support import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
BROKEN = ROOT / "tests" / "data" / "broken-rljob.yaml"


def manifest(**spec_fields) -> dict:
    return {
        "apiVersion": "asyncrl.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "job"},
        "spec": spec_fields,
    }


def errors_of(data: dict) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        parse_manifest(data)
    return format_errors(caught.value)


def only_error(data: dict) -> str:
    lines = errors_of(data)
    assert len(lines) == 1, lines
    return lines[0]


# --------------------------------------------------------------------------- defaults


def test_minimal_manifest_gets_every_default():
    job = parse_manifest(manifest())
    s = job.spec
    assert s.model.source == "smollm2-135m-instruct" and s.model.dtype == "float32"
    assert (s.model.tiny.hidden_size, s.model.tiny.num_layers, s.model.tiny.num_heads,
            s.model.tiny.num_kv_heads, s.model.tiny.intermediate_size) == (64, 2, 4, 2, 128)
    assert (s.dataset.kind, s.dataset.num_prompts) == ("arith", 2000)
    assert s.dataset.eval_fraction == 0.05 and s.dataset.difficulty == 2
    a = s.algorithm
    assert (a.advantage_estimator, a.group_size, a.batch_size, a.max_staleness) == ("grpo", 8, 8, 4)
    assert (a.clip_eps, a.clip_eps_high, a.effective_clip_eps_high) == (0.2, None, 0.2)
    assert (a.dual_clip, a.behaviour_weight_cap, a.behaviour_cap_mode) == (None, 5.0, "mask")
    assert a.decoupled is True and a.batch_norm_advantages is False
    assert a.proximal == "recompute"
    assert (a.learning_rate, a.weight_decay, a.max_grad_norm, a.max_steps) == (1e-6, 0.0, 1.0, 100)
    assert (a.kl.coef, a.kl.estimator) == (0.0, "k3")
    r = s.rollout
    assert (r.engine, r.replicas, r.max_concurrent_rollouts, r.max_new_tokens) == (
        "torch", 1, 16, 256)
    assert (r.temperature, r.top_p, r.top_k) == (1.0, 1.0, -1)
    assert r.resources.requests == {} and r.placement.gpus == 0
    assert (s.reward.kind, s.reward.math.extract) == ("math", ["boxed"])
    c = s.reward.code
    assert (c.timeout_seconds, c.memory_mb, c.max_processes, c.max_file_size_mb) == (5, 512, 16, 16)
    assert c.allow_unsafe_no_network_namespace is False
    b = s.buffer
    assert (b.redis.url, b.redis.password_secret, b.redis.tls, b.redis.persistence) == (
        None, None, False, "aof")
    assert (b.lease_seconds, b.ack_timeout_seconds) == (30, 300)
    t = s.trainer
    assert (t.backend, t.replicas, t.processes_per_replica, t.micro_batch_max_tokens) == (
        "pytorch", 1, 1, 4096)
    assert (t.checkpoint_every, t.eval_every) == (10, 10)
    assert s.suspend is False and job.status is None


def test_spec_can_be_left_out_and_mutable_defaults_are_not_shared():
    first = parse_manifest({k: v for k, v in manifest().items() if k != "spec"})
    second = RLJobSpec()
    first.spec.reward.math.extract.append("last_number")
    assert second.reward.math.extract == ["boxed"]


def test_constants():
    assert (spec.GROUP, spec.VERSION, spec.KIND, spec.PLURAL) == (
        "asyncrl.io", "v1alpha1", "RLJob", "rljobs")


# --------------------------------------------------------------------------- camelCase


def test_camel_case_round_trip():
    data = manifest(
        algorithm={"clipEpsHigh": 0.28, "behaviourWeightCap": None, "kl": {"coef": 0.01}},
        rollout={"maxNewTokens": 64, "topK": 20,
                 "placement": {"nodeSelector": {"pool": "gpu"}, "gpus": 1,
                               "tolerations": [{"key": "gpu", "operator": "Exists",
                                                "effect": "NoExecute", "tolerationSeconds": 30}]},
                 "engine": "sglang", "resources": {"requests": {"cpu": "500m", "memory": 2**30}}},
        buffer={"redis": {"url": "rediss://r:6380", "tls": True,
                          "passwordSecret": {"name": "redis", "key": "password"}}},
    )
    job = parse_manifest(data)
    assert job.spec.algorithm.clip_eps_high == 0.28
    assert job.spec.algorithm.behaviour_weight_cap is None
    assert job.spec.rollout.placement.tolerations[0].toleration_seconds == 30
    assert job.spec.buffer.redis.password_secret.key == "password"

    dumped = job.to_manifest()
    assert dumped["spec"]["algorithm"]["clipEpsHigh"] == 0.28
    assert dumped["spec"]["algorithm"]["behaviourWeightCap"] is None  # null stays "cap off"
    assert dumped["spec"]["rollout"]["placement"]["nodeSelector"] == {"pool": "gpu"}
    assert dumped["metadata"] == {"name": "job"} and "status" not in dumped
    assert all("_" not in key for key in _keys(dumped["spec"]) if key not in ("nvidia.com/gpu",))
    assert parse_manifest(dumped) == job


def _keys(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key not in ("requests", "limits", "nodeSelector"):
                yield key
                yield from _keys(value)
    elif isinstance(node, list):
        for item in node:
            yield from _keys(item)


def test_manifests_accept_only_camel_case_but_python_accepts_names():
    line = only_error(manifest(algorithm={"group_size": 4}))
    assert line.startswith("spec.algorithm.group_size: unknown field")
    assert "did you mean `groupSize`?" in line
    assert RLJobSpec(algorithm={"group_size": 4}).algorithm.group_size == 4


def test_operator_may_parse_whole_objects_from_the_api_server():
    data = manifest()
    data["metadata"].update(uid="1", resourceVersion="7", generation=3, namespace="ml",
                            creationTimestamp="2025-01-01T00:00:00Z", managedFields=[{}])
    data["status"] = {"phase": "Running", "policyVersion": 3, "kopf": {"progress": {}},
                      "conditions": [{"type": "Ready", "status": "True",
                                      "lastTransitionTime": "2025-01-01T00:00:00Z"}]}
    job = parse_manifest(data)
    assert job.metadata.generation == 3 and job.status.policy_version == 3
    assert job.status.conditions[0].last_transition_time.year == 2025


# --------------------------------------------------------------------------- rules


@pytest.mark.parametrize(
    ("spec_fields", "path", "fix"),
    [
        ({"rollout": {"engine": "sglang"}}, "spec.rollout.placement.gpus",
         "set spec.rollout.placement.gpus to 1 or more"),
        ({"reward": {"kind": "code"}}, "spec.reward.kind", "set reward.kind: math"),
        ({"dataset": {"kind": "code"}}, "spec.reward.kind", "set reward.kind: code"),
        ({"buffer": {"redis": {"tls": True}}}, "spec.buffer.redis.tls",
         "remove tls, or give the url of an external Redis that serves TLS (rediss://)"),
        ({"trainer": {"microBatchMaxTokens": 100}}, "spec.trainer.microBatchMaxTokens",
         "raise trainer.microBatchMaxTokens"),
        ({"rollout": {"topK": 0}}, "spec.rollout.topK", "use -1 to turn top-k off"),
        ({"algorithm": {"behaviourWeightCap": 0.5}}, "spec.algorithm.behaviourWeightCap",
         "set behaviourWeightCap to 1 or more (the default is 5), or behaviourCapMode: clamp"),
        ({"buffer": {"redis": {"url": "redis://r:6379", "tls": True}}}, "spec.buffer.redis.url",
         "use a rediss:// url"),
        ({"rollout": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
         "spec.rollout.resources.limits", "set placement.gpus"),
        ({"trainer": {"resources": {"requests": {"memory": "4Gi"}, "limits": {"memory": "2Gi"}}}},
         "spec.trainer.resources.limits.memory", "raise limits.memory to at least 4Gi"),
        ({"rollout": {"placement": {"tolerations": [{"operator": "Equal", "value": "x"}]}}},
         "spec.rollout.placement.tolerations[0].operator", "set operator: Exists"),
        ({"rollout": {"placement": {"tolerations": [{"key": "k", "operator": "Exists",
                                                     "value": "v"}]}}},
         "spec.rollout.placement.tolerations[0].value", "remove value"),
        ({"rollout": {"placement": {"tolerations": [{"key": "k", "tolerationSeconds": 5}]}}},
         "spec.rollout.placement.tolerations[0].tolerationSeconds", "set effect: NoExecute"),
        ({"model": {"tiny": {"hiddenSize": 64, "numHeads": 3}}}, "spec.model.tiny.numHeads",
         "divides hiddenSize"),
        ({"reward": {"math": {"extract": ["boxed", "boxed"]}}}, "spec.reward.math.extract",
         "list each rule once"),
        ({"reward": {"kind": "python"}}, "spec.reward.python", "add reward.python"),
        ({"reward": {"kind": "http"}}, "spec.reward.http", "add reward.http"),
        ({"reward": {"python": {"function": "mine:score"}}}, "spec.reward.python",
         "remove reward.python, or set kind: python"),
        ({"reward": {"kind": "python", "python": {"function": "mine:score", "volume": "r"}}},
         "spec.reward.python.path", "set path to the folder of your module"),
        ({"algorithm": {"proximal": "loglinear", "decoupled": False}}, "spec.algorithm.proximal",
         "remove proximal, or set decoupled: true"),
        ({"algorithm": {"proximal": "loglinear", "ppoMinibatches": 2}},
         "spec.algorithm.proximal", "set ppoMinibatches and ppoEpochs to 1"),
        ({"algorithm": {"groupSize": 2, "batchSize": 2, "ppoMinibatches": 5}},
         "spec.algorithm.ppoMinibatches", "set ppoMinibatches to at most 4"),
        ({"algorithm": {"decoupled": False, "rolloutCorrection": {"truncate": 2}}},
         "spec.algorithm.rolloutCorrection", "remove rolloutCorrection, or set decoupled: true"),
        ({"algorithm": {"rolloutCorrection": {"maskLow": 2, "maskHigh": 0.5}}},
         "spec.algorithm.rolloutCorrection.maskLow", "set maskLow below maskHigh"),
        ({"algorithm": {"rolloutCorrection": {"level": "sequence"}}},
         "spec.algorithm.rolloutCorrection.level", "set truncate (e.g. 2) or maskHigh"),
        ({"algorithm": {"overlongPenalty": {"bufferTokens": 300}}, "rollout": {
            "maxNewTokens": 256}}, "spec.algorithm.overlongPenalty.bufferTokens",
         "set bufferTokens to at most 256, e.g. a quarter of it (64)"),
        ({"algorithm": {"overlongPenalty": {"bufferTokens": 16}}, "rollout": {"workflow": {
            "kind": "episode", "function": "mine:run"}}}, "spec.algorithm.overlongPenalty",
         "remove algorithm.overlongPenalty, or shape the length in the episode's own reward"),
        ({"reward": {"truncatedReward": 0}, "rollout": {"workflow": {
            "kind": "episode", "function": "mine:run"}}}, "spec.reward.truncatedReward",
         "remove reward.truncatedReward, or score cut turns in the episode's own reward"),
        ({"reward": {"math": {"formatScore": 0.1}}, "rollout": {"workflow": {
            "kind": "episode", "function": "mine:run"}}}, "spec.reward.math.formatScore",
         "remove reward.math.formatScore, or reward the form in the episode's own reward"),
        ({"rollout": {"workflow": {"kind": "episode"}}}, "spec.rollout.workflow.function",
         "set function to 'package.module:name' of your async def episode(client, row)"),
        ({"rollout": {"workflow": {"function": "mine.episode:run"}}},
         "spec.rollout.workflow.function", "remove function, or set kind: episode"),
        ({"rollout": {"workflow": {"maxTurns": 4}}}, "spec.rollout.workflow.maxTurns",
         "remove maxTurns, or set kind: episode"),
        ({"rollout": {"workflow": {"egress": ["10.0.0.0/8"]}}}, "spec.rollout.workflow.egress",
         "remove egress, or set kind: episode"),
        ({"rollout": {"workflow": {"kind": "episode", "function": "mine:run", "volume": "code"}}},
         "spec.rollout.workflow.path", "set path to the folder of your module on the volume"),
        ({"rollout": {"workflow": {"kind": "episode", "function": "mine:run", "volume": "code",
                                   "path": "/usr/lib/mine"}}},
         "spec.rollout.workflow.path", "put the files under a folder of their own"),
        ({"rollout": {"workflow": {"kind": "episode", "function": "mine:run",
                                   "egress": ["10.0.0.1/8"]}}},
         "spec.rollout.workflow.egress[0]", "write the network, 10.0.0.0/8"),
        ({"rollout": {"workflow": {"kind": "episode", "function": "mine:run",
                                   "egress": ["203.0.113.7"]}}},
         "spec.rollout.workflow.egress[0]", "write 203.0.113.7/32"),
        ({"rollout": {"workflow": {"kind": "episode", "function": "mine:run",
                                   "egress": ["FD00::/8"]}}},
         "spec.rollout.workflow.egress[0]", "write fd00::/8"),
        ({"dataset": {"kind": "file", "path": "/data/train.jsonl", "volume": "prompts",
                      "fields": {"answer": "answer"}},
          "rollout": {"workflow": {"kind": "episode", "function": "mine:run",
                                   "path": "/data/episodes", "volume": "episode-code"}}},
         "spec.rollout.workflow.path", "put the episode code under another first folder"),
    ],
)
def test_cross_field_rules(spec_fields, path, fix):
    line = only_error(manifest(**spec_fields))
    assert line.startswith(f"{path}: "), line
    assert fix in line.split("; fix: ", 1)[1], line


def test_a_file_format_named_as_the_dataset_kind_says_to_use_kind_file():
    lines = errors_of(manifest(dataset={"kind": "jsonl", "path": "/data/p.jsonl"}))
    assert lines == [
        'spec.dataset.kind: jsonl files are read by kind file (any of jsonl, json, parquet, '
        'csv; the format comes from the file name) (got "jsonl"); fix: set kind: file and '
        'path: <your file>'], lines


def test_megatron_backend_is_accepted_with_its_parallel_sizes():
    job = parse_manifest(manifest(trainer={"backend": "megatron"}))
    assert job.spec.trainer.backend == "megatron"
    assert (job.spec.trainer.megatron.tensor_parallel,
            job.spec.trainer.megatron.pipeline_parallel) == (1, 1)
    # SmolLM2's 9 heads and 3 key/value heads split three ways; 6 processes: data parallel 2.
    job = parse_manifest(manifest(trainer={"backend": "megatron", "replicas": 2,
                                           "processesPerReplica": 3,
                                           "megatron": {"tensorParallel": 3}}))
    assert job.spec.trainer.megatron.tensor_parallel == 3


@pytest.mark.parametrize(("model", "trainer", "expected"), [
    # SmolLM2-135M: 9 heads, 3 key/value heads, 30 layers.
    ({}, {"megatron": {"tensorParallel": 2}, "processesPerReplica": 2},
     "spec.trainer.megatron.tensorParallel: tensorParallel 2 does not divide the model's 9 "
     "attention heads and 3 key/value heads (got 2); fix: use one of 1, 3"),
    ({}, {"megatron": {"pipelineParallel": 4}, "processesPerReplica": 4},
     "spec.trainer.megatron.pipelineParallel: pipelineParallel 4 does not divide the model's 30 "
     "layers (got 4); fix: use one of 1, 2, 3, 5, 6, 10, 15, 30"),
    # The tiny model's shape comes from its own fields.
    ({"source": "tiny-random", "tiny": {"numHeads": 4, "numKvHeads": 2}},
     {"megatron": {"tensorParallel": 4}, "processesPerReplica": 4},
     "spec.trainer.megatron.tensorParallel: tensorParallel 4 does not divide the model's 4 "
     "attention heads and 2 key/value heads (got 4); fix: use one of 1, 2"),
    ({}, {"megatron": {"tensorParallel": 3}, "processesPerReplica": 2},
     'spec.trainer.megatron: 2 trainer processes (replicas x processesPerReplica) cannot be '
     'split into groups of tensorParallel x pipelineParallel = 3 (got {"tensorParallel": 3}); '
     'fix: use a process count that 3 divides'),
    ({}, {"megatron": {"pipelineParallel": 2}, "processesPerReplica": 2},
     "spec.trainer.megatron.pipelineParallel: pipelineParallel 2 is not implemented yet (got 2); "
     "fix: set pipelineParallel: 1 (tensorParallel and data parallel split the work)"),
    ({"dtype": "bfloat16"}, {},
     "spec.model.dtype: bf16 autocast trains Megatron-Core's layers on CUDA only, and this "
     "trainer runs on CPUs (trainer.placement.gpus is 0) (got \"bfloat16\"); fix: use dtype: "
     "float32, or give the trainer GPUs"),
    ({}, {"computeDtype": "bfloat16"},
     "spec.trainer.computeDtype: bf16 autocast trains Megatron-Core's layers on CUDA only, and "
     "this trainer runs on CPUs (trainer.placement.gpus is 0) (got \"bfloat16\"); fix: use "
     "computeDtype: float32, or give the trainer GPUs"),
    ({}, {"sharding": "fsdp"},
     "spec.trainer.sharding: sharding fsdp is the pytorch backend's (FSDP); Megatron-Core splits "
     'a model with megatron.tensorParallel and pipelineParallel (got "fsdp"); fix: set '
     "sharding: none"),
    ({}, {"activationCheckpointing": True},
     "spec.trainer.activationCheckpointing: activationCheckpointing is implemented for the "
     "pytorch backend only (got true); fix: remove it, or set backend: pytorch"),
])
def test_megatron_parallel_sizes_are_checked_against_the_model_naming_the_field(
        model, trainer, expected):
    line = only_error(manifest(model=model, trainer={"backend": "megatron", **trainer}))
    assert line == expected


def test_megatron_settings_without_the_megatron_backend_are_refused():
    # They would be ignored by the pytorch trainer.
    line = only_error(manifest(trainer={"megatron": {"tensorParallel": 3}}))
    assert line == ('spec.trainer.megatron: trainer.megatron is read only with backend: '
                    'megatron (got {"tensorParallel": 3}); fix: remove it, or set backend: '
                    'megatron')


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("batch_norm", [False, True])
def test_a_group_of_one_is_refused_because_it_can_never_learn(estimator, batch_norm):
    import torch

    from asyncrl.algorithms.advantages import compute_advantages

    # What the rule is about: one response per prompt makes every advantage exactly 0.
    rewards = torch.tensor([[1.0], [0.0], [0.5], [1.0]])
    assert not compute_advantages(rewards, estimator, batch_norm).any()

    line = only_error(manifest(algorithm={"advantageEstimator": estimator, "groupSize": 1,
                                          "batchNormAdvantages": batch_norm}))
    problem, fix = line.split("; fix: ", 1)
    assert problem.startswith("spec.algorithm.groupSize: with one response per prompt every "
                              "advantage is 0"), line
    assert "can never learn" in problem and "(got 1)" in problem
    assert fix == "set groupSize to 2 or more (the default is 8)"


@pytest.mark.parametrize(("rollout", "field", "fix"), [
    ({"temperature": 0}, "temperature", "use a temperature above 0, e.g. 1.0 (the default)"),
    ({"temperature": 0.0}, "temperature", "use a temperature above 0, e.g. 1.0 (the default)"),
    ({"topK": 1}, "topK", "use -1 to turn top-k off, or 2 or more"),
])
def test_greedy_rollouts_are_refused_because_they_can_never_learn(rollout, field, fix):
    line = only_error(manifest(rollout=rollout))
    problem, given_fix = line.split("; fix: ", 1)
    assert problem.startswith(f"spec.rollout.{field}: "), line
    assert "every advantage is 0; the job can never learn" in problem, line
    assert given_fix == fix


def test_proximal_takes_recompute_or_loglinear():
    line = only_error(manifest(algorithm={"proximal": "approx"}))
    problem, fix = line.split("; fix: ", 1)
    assert problem == "spec.algorithm.proximal: must be 'recompute' or 'loglinear' " \
                      '(got "approx")', line
    assert fix == "use one of: recompute, loglinear"
    job = parse_manifest(manifest(algorithm={"proximal": "loglinear"}))
    assert job.spec.algorithm.proximal == "loglinear"


def test_behaviour_cap_below_one_is_allowed_when_it_clamps():
    job = parse_manifest(manifest(algorithm={"behaviourWeightCap": 0.5,
                                             "behaviourCapMode": "clamp"}))
    assert job.spec.algorithm.behaviour_weight_cap == 0.5
    assert parse_manifest(manifest(algorithm={"behaviourWeightCap": 1})).spec.algorithm \
        .behaviour_weight_cap == 1


def test_gpus_need_a_node_pool():
    line = only_error(manifest(trainer={"placement": {"gpus": 2}}))
    assert line.startswith("spec.trainer.placement.nodeSelector: 2 GPUs per pod"), line
    assert "nodeSelector" in line.split("; fix: ", 1)[1], line


def test_trainer_processes_need_a_gpu_each_when_gpus_are_used():
    line = only_error(manifest(trainer={"processesPerReplica": 4, "placement": {
        "gpus": 2, "nodeSelector": {"pool": "gpu"}}}))
    assert line.startswith("spec.trainer.processesPerReplica: 4 processes per pod need a GPU"), line
    assert "at most 2" in line.split("; fix: ", 1)[1], line
    # On CPUs any number of processes is fine (gloo).
    assert parse_manifest(manifest(trainer={"processesPerReplica": 4})).spec.trainer \
        .processes_per_replica == 4


def test_rules_that_hold():
    job = parse_manifest(manifest(
        dataset={"kind": "code"}, reward={"kind": "code"},
        buffer={"redis": {"url": "rediss://r:6380/0", "tls": True}},
        rollout={"engine": "sglang", "placement": {"gpus": 1, "nodeSelector": {"pool": "gpu"}}},
        trainer={"placement": {"gpus": 8, "nodeSelector": {"pool": "gpu"}}},
        algorithm={"clipEps": 0.2, "clipEpsHigh": 0.1},  # clipEpsHigh < clipEps is allowed
    ))
    assert job.spec.algorithm.effective_clip_eps_high == 0.1


def test_a_rollout_is_one_completion_unless_the_workflow_is_an_episode():
    workflow = parse_manifest(manifest()).spec.rollout.workflow
    assert (workflow.kind, workflow.function, workflow.path, workflow.volume) == (
        "single_turn", None, None, None)
    assert (workflow.max_turns, workflow.max_episode_tokens, workflow.timeout_seconds,
            workflow.turn_discount, workflow.egress) == (8, None, 300.0, 1.0, [])
    job = parse_manifest(manifest(rollout={"workflow": {
        "kind": "episode", "function": "tools.search:episode", "path": "/episodes/tools",
        "volume": "episode-code", "maxTurns": 4, "maxEpisodeTokens": 2048,
        "timeoutSeconds": 60, "turnDiscount": 0.9,
        "egress": ["10.20.0.0/16", "203.0.113.7/32", "fd00::/8"]}}))
    workflow = job.spec.rollout.workflow
    assert (workflow.kind, workflow.function, workflow.path, workflow.volume) == (
        "episode", "tools.search:episode", "/episodes/tools", "episode-code")
    assert (workflow.max_turns, workflow.max_episode_tokens, workflow.timeout_seconds,
            workflow.turn_discount) == (4, 2048, 60.0, 0.9)
    assert workflow.egress == ["10.20.0.0/16", "203.0.113.7/32", "fd00::/8"]
    # Dumped with every default, both kinds read back unchanged.
    for dumped in (job, parse_manifest(manifest())):
        assert parse_manifest(dumped.to_manifest()).spec == dumped.spec


@pytest.mark.parametrize(("workflow", "field"), [
    ({"kind": "multi_turn"}, "kind"),
    ({"kind": "episode", "function": "no_function_named"}, "function"),
    ({"kind": "episode", "function": "m:f", "maxTurns": 0}, "maxTurns"),
    ({"kind": "episode", "function": "m:f", "maxEpisodeTokens": 0}, "maxEpisodeTokens"),
    ({"kind": "episode", "function": "m:f", "timeoutSeconds": 0}, "timeoutSeconds"),
    ({"kind": "episode", "function": "m:f", "turnDiscount": 0}, "turnDiscount"),
    ({"kind": "episode", "function": "m:f", "turnDiscount": 1.5}, "turnDiscount"),
    ({"kind": "episode", "function": "m:f", "path": "/e/m", "volume": "Bad_Claim"}, "volume"),
    ({"kind": "episode", "function": "m:f", "egress": ["example.org/32"]}, "egress[0]"),
])
def test_workflow_field_bounds(workflow, field):
    line = only_error(manifest(rollout={"workflow": workflow}))
    assert line.startswith(f"spec.rollout.workflow.{field}: "), line


def test_the_dataset_and_the_episode_code_may_share_one_claim():
    job = parse_manifest(manifest(
        dataset={"kind": "file", "path": "/data/train.jsonl", "volume": "shared",
                 "fields": {"answer": "answer"}},
        rollout={"workflow": {"kind": "episode", "function": "mine:run",
                              "path": "/data/episodes", "volume": "shared"}}))
    assert job.spec.rollout.workflow.volume == job.spec.dataset.volume == "shared"


def test_section_errors_do_not_hide_each_other():
    lines = errors_of(manifest(rollout={"engine": "sglang"}, algorithm={"clipEps": 0}))
    assert [line.split(":")[0] for line in lines] == ["spec.algorithm.clipEps",
                                                      "spec.rollout.placement.gpus"]


# --------------------------------------------------------------------------- quantities


@pytest.mark.parametrize("good", ["500m", "2", 2, 0, "1.5", "4Gi", "512Mi", "1e3", "100k", ".5",
                                  "+1"])
def test_valid_quantities(good):
    job = parse_manifest(manifest(trainer={"resources": {"requests": {"cpu": good}}}))
    assert job.spec.trainer.resources.requests["cpu"] == good


@pytest.mark.parametrize(
    ("bad", "problem", "fix"),
    [
        ("two", "is not a Kubernetes quantity", '"500m"'),
        ("4GB", "is not a Kubernetes quantity", '"4Gi"'),
        ("", "is not a Kubernetes quantity", "quantity"),
        (0.5, "a fractional number", 'quote it: "0.5"'),
        (-1, "must not be negative", "positive"),
        ("-2Gi", "must not be negative", "positive"),
        (True, "must be a Kubernetes quantity", "quantity"),
        ([1], "must be a Kubernetes quantity", "quantity"),
    ],
)
def test_invalid_quantities_name_the_key(bad, problem, fix):
    line = only_error(manifest(rollout={"resources": {"limits": {"cpu": bad}}}))
    assert line.startswith(f"spec.rollout.resources.limits.cpu: {problem}"), line
    assert fix in line, line


def test_quantity_keys_with_dots_are_quoted_in_paths():
    line = only_error(manifest(reward={"resources": {"requests": {"example.com/fpga": "x"}}}))
    assert line.startswith('spec.reward.resources.requests["example.com/fpga"]: ')


@pytest.mark.parametrize(("text", "value"), [
    ("500m", "0.5"), ("2", "2"), (3, "3"), ("1Ki", "1024"), ("2Gi", str(2 * 2**30)),
    ("1.5k", "1500"), ("1e3", "1000"), ("100n", "1E-7"), ("2Ei", str(2 * 2**60)),
])
def test_parse_quantity(text, value):
    from decimal import Decimal

    assert parse_quantity(text) == Decimal(value)


@pytest.mark.parametrize("text", ["-1", "1.5.5", "2 Gi", "abc", "", True, 1.5])
def test_parse_quantity_refuses_what_the_api_server_refuses(text):
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)


# --------------------------------------------------------------------------- error lines


def test_broken_manifest_error_lines():
    with pytest.raises(ValidationError) as caught:
        load_manifest(BROKEN)
    lines = format_errors(caught.value, lines=yaml_lines(BROKEN.read_text()))
    text = "\n".join(lines)
    expected = {
        "metadata.name": "e.g. my-job",
        "spec.dataset.path": "remove path, or set kind: file",
        "spec.algorithm.advantageEstimator": "use one of: grpo, dr_grpo, rloo",
        "spec.algorithm.groupSize": "set an integer >= 2",
        "spec.algorithm.clipEpsilon": "remove it - did you mean `clipEps`?",
        "spec.algorithm.learningRate": "use a number",
        "spec.rollout.resources.requests.cpu": "quantity",
        "spec.trainer.groupSize": "it belongs at spec.algorithm.groupSize",
    }
    for path, fix in expected.items():
        matching = [line for line in lines if f": {path}: " in line]
        assert len(matching) == 1, (path, text)
        assert fix in matching[0].split("; fix: ")[1], matching[0]
    assert len(lines) == len(expected), text
    assert all(line.startswith("line ") for line in lines)
    numbers = [int(line.split(":")[0].split()[1]) for line in lines]
    assert numbers == sorted(numbers)
    assert '(got "two")' in text and "(got 0)" in text


def test_error_parts():
    (issue,) = issues(_caught(manifest(algorithm={"clipEps": -0.1})))
    assert (issue.path, issue.value) == ("spec.algorithm.clipEps", "-0.1")
    assert issue.problem == "must be greater than 0"
    assert issue.fix == "set a number > 0 and < 1"

    (issue,) = issues(_caught(manifest(dataset={"evalFraction": 0.9})))
    assert issue.fix == "set a number from 0 to 0.5"

    (issue,) = issues(_caught(manifest(algorithm={"advantageEstimator": "GRPO"})))
    assert issue.fix == "use one of: grpo, dr_grpo, rloo - did you mean `grpo`?"

    (issue,) = issues(_caught(manifest(buffer={"redis": {"passwordSecret": {"name": "s"}}})))
    assert issue.path == "spec.buffer.redis.passwordSecret.key" and issue.value is None
    assert issue.fix == "add it (Key within the Secret)"

    (issue,) = issues(_caught(manifest(rollout={"maxNewTokens": "lots"})))
    assert issue.fix == "use a whole number, e.g. 256 (the default)"

    (issue,) = issues(_caught(manifest(rollout="fast")))
    assert issue.fix.startswith("write it as a mapping")

    (issue,) = issues(_caught(manifest(suspend="maybe")))
    assert issue.fix == "use true or false"


def test_wrong_api_version_and_kind():
    data = manifest()
    data.update(apiVersion="asyncrl.io/v1", kind="Job")
    lines = errors_of(data)
    assert lines[0].startswith("apiVersion: ") and "fix: use asyncrl.io/v1alpha1" in lines[0]
    assert lines[1].startswith("kind: ") and "fix: use RLJob" in lines[1]


def _caught(data: dict) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        parse_manifest(data)
    return caught.value


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [1\n", "not valid YAML: line 2"),
        ("", "empty"),
        ("apiVersion: a\n---\napiVersion: b\n", "holds 2 YAML documents"),
        ("- 1\n- 2\n", "the top level is a list, expected a mapping"),
        ("kind: RLJob\nkind: RLJob\n", "duplicate key 'kind'"),
    ],
)
def test_unreadable_manifests(tmp_path, text, message):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ManifestError, match=message):
        read_manifest(path)


def test_missing_file(tmp_path):
    with pytest.raises(ManifestError, match="no such file"):
        load_manifest(tmp_path / "nope.yaml")


def test_exponent_floats_read_as_numbers(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: asyncrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: j}\n"
                    "spec: {algorithm: {learningRate: 1e-6}}\n")
    assert read_manifest(path)["spec"]["algorithm"]["learningRate"] == 1e-6


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"arith.yaml", "code.yaml", "tiny.yaml",
                                          "gpu-cluster.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path):
    job = load_manifest(path)
    assert isinstance(job, RLJob)
    assert parse_manifest(job.to_manifest()) == job


def test_example_settings():
    arith = load_manifest(ROOT / "examples/arith.yaml")
    tiny = load_manifest(ROOT / "examples/tiny.yaml")
    assert arith.spec.model.source == "smollm2-135m-instruct" and arith.spec.reward.kind == "math"
    assert tiny.spec.model.source == "tiny-random" and tiny.spec.algorithm.max_steps <= 5
    gpu = load_manifest(ROOT / "examples/gpu-cluster.yaml")
    assert gpu.spec.rollout.engine == "sglang" and gpu.spec.rollout.placement.gpus >= 1
    assert gpu.spec.buffer.redis.url and gpu.spec.buffer.redis.password_secret
    assert gpu.spec.rollout.placement.tolerations and gpu.spec.trainer.placement.node_selector


def test_the_rollout_engine_computes_in_its_own_dtype_or_the_models():
    def engine(model, rollout):
        return parse_manifest(manifest(model=model, rollout=rollout)).spec.rollout_compute_dtype

    assert engine({}, {}) == "float32"
    assert engine({"dtype": "bfloat16"}, {}) == "bfloat16"
    assert engine({}, {"computeDtype": "bfloat16"}) == "bfloat16"
    assert engine({}, {"computeDtype": "auto"}) == "auto"  # resolved on the rollout's device
    assert any("spec.rollout.computeDtype" in e for e in errors_of(
        manifest(rollout={"computeDtype": "float16"})))


def test_the_trainer_computes_in_its_own_dtype_or_the_models():
    from asyncrl.trainer.step import UpdateConfig

    def compute(model, trainer):
        return UpdateConfig.from_spec(parse_manifest(manifest(model=model, trainer=trainer)).spec)

    assert compute({}, {}).compute_dtype == "float32"
    assert compute({"dtype": "bfloat16"}, {}).compute_dtype == "bfloat16"
    # bf16 matmuls in the trainer, float32 weights for the rollout engines.
    assert compute({}, {"computeDtype": "bfloat16"}).compute_dtype == "bfloat16"
    assert compute({"dtype": "bfloat16"}, {"computeDtype": "float32"}).compute_dtype == "float32"
    # Chosen by the trainer on its device (asyncrl.platform.devices.trainer_compute_dtype).
    assert compute({}, {"computeDtype": "auto"}).compute_dtype == "auto"
    assert not compute({}, {}).activation_checkpointing
    assert compute({}, {"activationCheckpointing": True}).activation_checkpointing
