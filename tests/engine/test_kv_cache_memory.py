"""rollout.kvCacheMemoryFraction: the torch engine's slots sized to a share of the device's
memory, and SGLang's --mem-fraction-static."""

import pytest
import torch

from asyncrl.engine.kv_cache import SlotKVCache, slot_bytes, slots_that_fit
from asyncrl.launch.sglang import sglang_launch_command
from asyncrl.rollout.server import sglang_command
from asyncrl.platform.settings import RolloutSettings
from asyncrl.spec.job import RLJobSpec
from support.tiny_model import tiny_model


def test_a_slot_is_what_the_cache_allocates_for_one_request():
    model = tiny_model(1, 256)
    cache = SlotKVCache(num_layers=model.config.num_hidden_layers, num_slots=3,
                        num_kv_heads=model.config.num_key_value_heads, max_length=40,
                        head_dim=model.config.hidden_size // model.config.num_attention_heads,
                        dtype=torch.bfloat16)
    allocated = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    assert slot_bytes(model.config, 40, torch.bfloat16) * 3 == allocated


def test_slots_shrink_to_the_budget_and_none_is_an_error_naming_the_field():
    assert slots_that_fit(64, 10_000, 100) == 64
    assert slots_that_fit(64, 1_000, 100) == 10
    with pytest.raises(ValueError, match="rollout.kvCacheMemoryFraction leaves 0 MiB"):
        slots_that_fit(64, 99, 100)


def job(**rollout):
    return RLJobSpec.model_validate({
        "model": {"source": "tiny-random"}, "dataset": {"kind": "arith"},
        "algorithm": {"groupSize": 2, "batchSize": 2}, "rollout": rollout,
        "reward": {"kind": "math"}})


def test_the_fraction_is_a_share_and_reaches_sglang(tmp_path):
    for bad in (0, 1, 1.5):
        with pytest.raises(ValueError, match="kvCacheMemoryFraction|kv_cache_memory_fraction"):
            job(kvCacheMemoryFraction=bad)
    spec = job(kvCacheMemoryFraction=0.4, engine="sglang",
               placement={"gpus": 1, "nodeSelector": {"pool": "gpu"}})
    (tmp_path / "job.yaml").write_text("kind: RLJob\n")  # only its existence is checked here
    command = sglang_command(RolloutSettings(job_file=str(tmp_path / "job.yaml")), spec)
    assert command[command.index("--mem-fraction-static") + 1] == "0.4"
    assert "--mem-fraction-static" not in sglang_launch_command(job(), model_path="m", port=1)


def test_the_rollout_worker_runs_as_many_requests_as_its_share_of_memory_holds(caplog):
    """On this CPU: a share of the machine's memory that holds 3.5 slots gives 3 of the 64
    asked for, said in the log; a share under one slot stops the worker naming the field."""
    import os

    from asyncrl.rollout.server import _slots_within_memory

    model = tiny_model(1, 256)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_slot = slot_bytes(model.config, 2048, torch.float32)
    cpu = torch.device("cpu")
    assert _slots_within_memory(job(), model, 64, 2048, cpu) == 64  # unset: as asked
    assert _slots_within_memory(job(kvCacheMemoryFraction=0.5), model, 64, 2048, cpu) == 64
    three = job(kvCacheMemoryFraction=3.5 * per_slot / total)
    assert _slots_within_memory(three, model, 64, 2048, cpu) == 3
    assert "holds 3 of the 64 requests" in caplog.text
    with pytest.raises(ValueError, match="rollout.kvCacheMemoryFraction leaves"):
        _slots_within_memory(job(kvCacheMemoryFraction=0.5 * per_slot / total), model, 64,
                             2048, cpu)
