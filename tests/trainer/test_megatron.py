"""The Megatron-Core trainer backend against the pytorch one, on a CPU: the weight mapping,
per-token log-probs, one decoupled-PPO update, the CPU shims' pin, and a whole job."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from transformers import LlamaForCausalLM

from asyncrl.model.policy import SMOLLM2, load_model, packed_token_logprobs
from asyncrl.model.packed_attention import use_packed_attention
from asyncrl.trainer.megatron import compat, hf_layout
from asyncrl.trainer.megatron.hf_layout import LlamaShape
from asyncrl.trainer.distributed import full_optimizer_state, load_full_state
from asyncrl.trainer.step import PolicyUpdater, TrainSample, UpdateConfig
from support import ROOT
from support.tiny_model import tiny_transformers_model
from support.trainer import make_samples, tiny_model

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")

# fp32 on a CPU: Megatron's attention (unfused softmax over an explicit mask) and transformers'
# SDPA add up in a different order; per-token log-probs agree to this.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def megatron_world():
    """Megatron's process groups over a world of one (as a single trainer process has)."""
    created = not dist.is_initialized()
    compat.initialize_parallel(1, 1, torch.device("cpu"))
    yield
    compat.destroy_parallel()
    if created:
        dist.destroy_process_group()


def _policy(hf_model):
    from asyncrl.trainer.megatron.policy import MegatronPolicy
    return MegatronPolicy.from_hf(hf_model, torch.device("cpu"))


def _untied_gqa_model() -> LlamaForCausalLM:
    """Untied embeddings and 3 query heads per key/value head (SmolLM2's ratio)."""
    return tiny_transformers_model(seed=3, vocab_size=96, hidden_size=48, intermediate_size=80,
                                   num_attention_heads=6, tie_word_embeddings=False)


def _packed_row(vocab: int, lengths: list[int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    needed = torch.rand(sum(lengths), generator=generator) > 0.3
    return ids, positions, bounds, needed


# --------------------------------------------------------------------------- the shims' pin


def test_the_cpu_shims_match_the_installed_megatron_core():
    # An upgrade that adds, moves or removes a torch.cuda.current_device() call the shim
    # covers must be looked at before the pin moves.
    from importlib.metadata import version

    assert version("megatron-core") == compat.MEGATRON_CORE_VERSION
    assert compat.count_current_device_calls() == compat.CURRENT_DEVICE_CALL_SITES


# --------------------------------------------------------------------------- weight mapping


@pytest.mark.parametrize("make", [tiny_model, _untied_gqa_model], ids=["tied", "untied-gqa"])
def test_hf_to_megatron_and_back_is_exact(megatron_world, make):
    hf = make()
    policy = _policy(hf)
    back = policy.hf_state_dict()
    state = hf.state_dict()
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    # Megatron holds each tensor once: a tied embedding is one parameter.
    assert sum(p.numel() for p in policy.parameters()) == sum(p.numel() for p in hf.parameters())


def test_fused_qkv_rows_are_grouped_per_key_value_head():
    hf = _untied_gqa_model()
    shape = LlamaShape.of(hf.config)
    fused = hf_layout.hf_to_megatron(hf.state_dict(), shape)["decoder.layers.0.self_attention.linear_qkv.weight"]
    attention = hf.model.layers[0].self_attn
    d = shape.head_dim
    # Group 1: query heads 3..5, then key head 1, then value head 1.
    group = fused[1 * 5 * d:2 * 5 * d]
    assert torch.equal(group[:3 * d], attention.q_proj.weight[3 * d:6 * d])
    assert torch.equal(group[3 * d:4 * d], attention.k_proj.weight[d:2 * d])
    assert torch.equal(group[4 * d:], attention.v_proj.weight[d:2 * d])


def test_qwen2_query_key_value_biases_round_trip():
    model = tiny_transformers_model("qwen2", vocab_size=64, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=1)
    state, shape = model.state_dict(), LlamaShape.of(model.config)
    assert shape.qkv_bias
    mapped = hf_layout.hf_to_megatron(state, shape)
    assert mapped["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (4 * 8 + 2 * 2 * 8,)
    back = hf_layout.megatron_to_hf(mapped, shape)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[name], state[name]) for name in state)


def test_transformer_engine_spec_names_fuse_each_norm_into_the_next_linear_layer():
    whole = hf_layout.hf_to_megatron(tiny_model().state_dict(), LlamaShape.of(tiny_model().config))
    fused = hf_layout.to_transformer_engine_names(whole)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in fused
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in fused
    assert not any(name.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight"))
                   for name in fused)
    assert "decoder.final_layernorm.weight" in fused  # a module of its own in both specs
    assert hf_layout.from_transformer_engine_names(fused).keys() == whole.keys()


@pytest.mark.parametrize("size", [2, 3])
def test_tensor_parallel_shards_put_back_together_exactly(size):
    hf = _untied_gqa_model()  # 6 heads, 2 kv heads: tensor parallel 2 divides both
    if size == 3:
        hf = tiny_transformers_model(vocab_size=96, hidden_size=36, intermediate_size=60,
                                     num_hidden_layers=1, num_attention_heads=3,
                                     num_key_value_heads=3, tie_word_embeddings=False)
    whole = hf_layout.hf_to_megatron(hf.state_dict(), LlamaShape.of(hf.config))
    for name, tensor in whole.items():
        parts = [hf_layout.shard(name, tensor, rank, size) for rank in range(size)]
        assert torch.equal(hf_layout.unshard(name, parts), tensor), name
    # A rank's linear_fc1 is its gate rows then its up rows (what Megatron's SwiGLU splits).
    fc1 = whole["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    mine = hf_layout.shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, size)
    assert torch.equal(mine, torch.cat([gate.chunk(size)[1], up.chunk(size)[1]]))


def test_a_local_models_shape_is_checked_when_the_trainer_loads_it():
    # The spec cannot know a local directory's shape; the trainer applies the same rule.
    from asyncrl.spec import parse_manifest
    from asyncrl.trainer.megatron.policy import megatron_policy

    job = parse_manifest({"apiVersion": "asyncrl.io/v1alpha1", "kind": "RLJob",
                          "metadata": {"name": "job"},
                          "spec": {"model": {"source": "/models/my-llama"},
                                   "trainer": {"backend": "megatron", "processesPerReplica": 4,
                                               "megatron": {"tensorParallel": 4}}}})
    with pytest.raises(ValueError) as caught:
        megatron_policy(job.spec, _untied_gqa_model(), torch.device("cpu"))
    assert str(caught.value) == (
        "spec.trainer.megatron.tensorParallel: tensorParallel 4 does not divide the model's 6 "
        "attention heads and 2 key/value heads; fix: use one of 1, 2")


# --------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("source", ["tiny", SMOLLM2])
def test_per_token_logprobs_equal_the_pytorch_backends(megatron_world, source):
    hf = tiny_model() if source == "tiny" else load_model(SMOLLM2)
    policy = _policy(hf)
    use_packed_attention(hf)
    ids, positions, bounds, needed = _packed_row(hf.config.vocab_size, [13, 40, 7, 25])
    with torch.no_grad():
        expected = packed_token_logprobs(hf, ids, positions, bounds, 0.7, needed)
        got = policy.packed_token_logprobs(ids, positions, bounds, 0.7, needed)
    assert torch.equal(got != 0, expected != 0)  # the same tokens, first ones and unneeded 0
    assert int((got != 0).sum()) > 40
    torch.testing.assert_close(got, expected, atol=LOGPROB_TOLERANCE, rtol=0)


# SGD: the update is the gradient times the rate, so equal weights after the step mean equal
# gradients. (Adam's first step is about lr x sign(gradient), which turns the last-bit
# differences of near-zero gradients into steps of the full rate.)
OPTIMIZER_LR = 50.0


def test_one_decoupled_ppo_update_matches_the_pytorch_backend(megatron_world):
    hf = tiny_model()
    policy = _policy(copy.deepcopy(hf))
    before = copy.deepcopy(hf.state_dict())
    samples = [TrainSample(s.input_ids, s.loss_mask, s.behaviour_logprobs, s.advantage, 2)
               for s in make_samples(8, behaviour_noise=1.0)]
    config = UpdateConfig(temperature=0.8, micro_batch_max_tokens=24)
    stats = []
    for model in (hf, policy):
        optimizer = torch.optim.SGD(model.parameters(), lr=OPTIMIZER_LR)
        stats.append(PolicyUpdater(model, optimizer, config).step(samples, version=3))
    pytorch, megatron = stats
    assert pytorch["micro_batches"] == megatron["micro_batches"] > 1
    assert megatron["loss"] == pytest.approx(pytorch["loss"], abs=1e-6)
    assert megatron["grad_norm"] == pytest.approx(pytorch["grad_norm"], rel=1e-4)
    after = policy.hf_state_dict()
    moved = max(float((hf.state_dict()[n] - before[n]).abs().max()) for n in before)
    assert moved > 1e-3  # a real step, so the comparison below means something
    for name, tensor in hf.state_dict().items():
        torch.testing.assert_close(after[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


def test_checkpointed_optimizer_state_is_the_pytorch_backends_and_loads_back(megatron_world):
    # One checkpoint format for both backends: AdamW's state keyed by the HF names.
    hf = tiny_model()
    policy = _policy(copy.deepcopy(hf))
    samples = make_samples(4, behaviour_noise=1.0)
    optimizers = []
    for model in (hf, policy):
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-3))
        PolicyUpdater(model, optimizers[-1], UpdateConfig()).step(samples)
    expected = full_optimizer_state(hf, optimizers[0])
    got = full_optimizer_state(policy, optimizers[1])
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for name, entry in expected["state"].items():
        assert got["state"][name]["step"] == entry["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["state"][name][key], entry[key], atol=1e-7,
                                       rtol=1e-3, msg=f"{name} {key}")
    # Restored into a fresh Megatron model, the next step is the one the first would take.
    restored = _policy(tiny_model())
    optimizer = torch.optim.AdamW(restored.parameters(), lr=5e-2)
    load_full_state(restored, optimizer, policy.hf_state_dict(), got)
    assert optimizer.param_groups[0]["lr"] == 1e-3
    for model, opt in ((policy, optimizers[1]), (restored, optimizer)):
        PolicyUpdater(model, opt, UpdateConfig()).step(samples)
    for name, tensor in policy.hf_state_dict().items():
        assert torch.equal(restored.hf_state_dict()[name], tensor), name


# --------------------------------------------------------------------------- tensor parallel


def _tensor_parallel_samples() -> list[TrainSample]:
    return [TrainSample(s.input_ids % 96, s.loss_mask, s.behaviour_logprobs, s.advantage, 2)
            for s in make_samples(6, seed=5, behaviour_noise=1.0)]


def _tensor_parallel_rank(rank: int, world: int, rendezvous: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    compat.initialize_parallel(world, 1, torch.device("cpu"))
    from asyncrl.trainer.megatron.policy import MegatronPolicy

    policy = MegatronPolicy.from_hf(_untied_gqa_model(), torch.device("cpu"))
    ids, positions, bounds, needed = _packed_row(96, [11, 30, 6])
    with torch.no_grad():
        logprobs = policy.packed_token_logprobs(ids, positions, bounds, 1.0, needed)
    # Both ranks compute on the same samples (they are tensor-parallel peers).
    optimizer = torch.optim.SGD(policy.parameters(), lr=OPTIMIZER_LR, momentum=0.9)
    stats = PolicyUpdater(policy, optimizer, UpdateConfig(max_grad_norm=0.5)).step(
        _tensor_parallel_samples(), version=3)
    state, optimizer_state = policy.hf_state_dict(), policy.hf_optimizer_state(optimizer)
    if rank == 0:
        torch.save({"logprobs": logprobs, "stats": stats, "state": state,
                    "optimizer": optimizer_state,
                    "shard": policy.gpt.decoder.layers[0].mlp.linear_fc1.weight.shape}, out)
    compat.destroy_parallel()
    dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_two_over_gloo_matches_the_pytorch_backend(tmp_path):
    out = tmp_path / "rank0.pt"
    mp.spawn(_tensor_parallel_rank, args=(2, str(tmp_path / "rendezvous"), str(out)), nprocs=2)
    result = torch.load(out)
    assert result["shard"] == (80, 48)  # half of gate and half of up: 2 x 40 rows
    hf = use_packed_attention(_untied_gqa_model())
    ids, positions, bounds, needed = _packed_row(96, [11, 30, 6])
    with torch.no_grad():
        expected = packed_token_logprobs(hf, ids, positions, bounds, 1.0, needed)
    torch.testing.assert_close(result["logprobs"], expected, atol=LOGPROB_TOLERANCE, rtol=0)

    # The same update in one process with the pytorch backend; the gradient norm is over
    # the whole model (clipped at 0.5, so a wrong norm would scale every step differently).
    optimizer = torch.optim.SGD(hf.parameters(), lr=OPTIMIZER_LR, momentum=0.9)
    stats = PolicyUpdater(hf, optimizer, UpdateConfig(max_grad_norm=0.5)).step(
        _tensor_parallel_samples(), version=3)
    assert stats["grad_norm"] > 0.5
    assert result["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
    assert result["stats"]["loss"] == pytest.approx(stats["loss"], abs=1e-6)
    for name, tensor in hf.state_dict().items():
        torch.testing.assert_close(result["state"][name], tensor, atol=1e-5, rtol=1e-4,
                                   msg=name)
    # The momentum, gathered from both ranks under the HF names, is the pytorch backend's.
    expected_optimizer = full_optimizer_state(hf, optimizer)
    assert result["optimizer"]["state"].keys() == expected_optimizer["state"].keys()
    for name, entry in expected_optimizer["state"].items():
        torch.testing.assert_close(result["optimizer"]["state"][name]["momentum_buffer"],
                                   entry["momentum_buffer"], atol=1e-6, rtol=1e-4, msg=name)


# --------------------------------------------------------------------------- a whole job


@pytest.mark.slow
@pytest.mark.parametrize(("processes", "transfer"), [(1, "distributed"), (2, "disk")],
                         ids=["one-process", "tensor-parallel-2"])
def test_asyncrl_run_trains_a_tiny_job_with_megatron_and_resumes(tmp_path, processes, transfer):
    job = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    job["spec"]["trainer"].update(backend="megatron", processesPerReplica=processes,
                                  megatron={"tensorParallel": processes},
                                  weightTransfer=transfer, computeDtype="auto")
    job_file = tmp_path / "tiny-megatron.yaml"
    job_file.write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    for steps in (2, 3):  # the second run resumes from the first's checkpoint (step 2)
        done = subprocess.run([ASYNCRL, "run", str(job_file), "--run-dir", str(run_dir),
                               "--steps", str(steps)], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["trained_tokens"] > 0 and r["backend"] == "megatron" for r in train)
    # auto on a CPU: float32 even where the CPU has native bf16 (Megatron autocasts on CUDA).
    assert {r["compute_dtype"] for r in train} == {"float32"}
    # Weights reach the rollout engine the way the spec says, broadcast or as snapshots (after
    # the restart, a version the engine is not yet in the group for goes to disk, as a
    # distributed transfer does when an engine is missing).
    assert [r["weight_transfer"] for r in train[:2]] == [transfer] * 2
    log = "".join(path.read_text() for path in (run_dir / "logs").glob("trainer*.log"))
    assert f"Megatron-Core {compat.MEGATRON_CORE_VERSION} GPTModel, local layer spec, " \
           f"tensor parallel {processes}" in log
    # Checkpoints (and disk snapshots) are Hugging Face directories the torch engine loads.
    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert load_model(str(checkpoint)).config.num_hidden_layers == 2
