"""Two gloo ranks, each with half the global batch, must apply the same update as one
process with the whole batch."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.trainer.step import PolicyUpdater, UpdateConfig
from support.trainer import make_samples, tiny_model

STEPS = 2
# SGD, not Adam: Adam's update is invariant to the gradient's scale, so it would hide a
# rank that averages gradients instead of summing them.


def _train(samples_per_step, rank_slice=slice(None)):
    model = tiny_model()
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.5), UpdateConfig(
        micro_batch_max_tokens=24))
    stats = [updater.step(samples[rank_slice]) for samples in samples_per_step]
    return model.state_dict(), stats


def _rank(rank, world_size, rendezvous, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world_size)
    try:
        batches = [make_samples(8, seed=step) for step in range(STEPS)]
        state, stats = _train(batches, slice(rank, None, world_size))
        torch.save({"state": state, "stats": stats}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(tmp_path):
    mp.spawn(_rank, args=(2, tmp_path / "rendezvous", tmp_path), nprocs=2, join=True)
    single_state, single_stats = _train([make_samples(8, seed=step) for step in range(STEPS)])
    initial = tiny_model().state_dict()
    assert any(not torch.equal(initial[n], v) for n, v in single_state.items())
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for name, value in single_state.items():
            torch.testing.assert_close(result["state"][name], value, atol=1e-6, rtol=1e-5,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
        for ours, theirs in zip(result["stats"], single_stats):
            assert ours["trained_tokens"] == theirs["trained_tokens"]
            assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
