"""Two gloo ranks, each with half the global batch, must apply the same update as one
process with the whole batch; with a LoRA adapter (model.lora) too."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.model.lora import trained_model, with_adapter
from asyncrl.trainer.step import PolicyUpdater, UpdateConfig
from support.lora import LORA
from support.trainer import make_samples, tiny_model

STEPS = 2
# SGD, not Adam: Adam's update is invariant to the gradient's scale, so it would hide a
# rank that averages gradients instead of summing them.


def _model(lora: bool) -> torch.nn.Module:
    model = tiny_model()
    return trained_model(with_adapter(model, LORA, torch.float32)) if lora else model


def _train(samples_per_step, rank_slice=slice(None), lora=False):
    model = _model(lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    updater = PolicyUpdater(model, torch.optim.SGD(trained, lr=0.5), UpdateConfig(
        micro_batch_max_tokens=24))
    stats = [updater.step(samples[rank_slice]) for samples in samples_per_step]
    return model.state_dict(), stats


def _rank(rank, world_size, rendezvous, out_dir, lora):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world_size)
    try:
        batches = [make_samples(8, seed=step) for step in range(STEPS)]
        state, stats = _train(batches, slice(rank, None, world_size), lora)
        torch.save({"state": state, "stats": stats}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_two_gloo_ranks_match_one_process(tmp_path, lora):
    mp.spawn(_rank, args=(2, tmp_path / "rendezvous", tmp_path, lora), nprocs=2, join=True)
    single_state, single_stats = _train([make_samples(8, seed=step) for step in range(STEPS)],
                                        lora=lora)
    initial = _model(lora).state_dict()
    assert any(not torch.equal(initial[n], v) for n, v in single_state.items())
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for name, value in single_state.items():
            torch.testing.assert_close(result["state"][name], value, atol=1e-6, rtol=1e-5,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
        for ours, theirs in zip(result["stats"], single_stats):
            assert ours["trained_tokens"] == theirs["trained_tokens"]
            assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
