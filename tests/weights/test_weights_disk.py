"""The snapshot format on its own (asyncrl.weights.disk): what the trainer writes, the engine
reads back and checks against the model. The engine's refusals over HTTP and in process are
tested with it (tests/engine/test_rollout_engine.py, tests/rollout/test_rollout_http.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.model.policy import tied_aliases
from asyncrl.weights.disk import (
    SNAPSHOT_FILE,
    SnapshotError,
    check_snapshot,
    read_snapshot,
    read_state_dict,
    write_snapshot,
)
from support.tiny_model import tiny_model

VOCAB = 64


@pytest.fixture
def model():
    return tiny_model(3, VOCAB)


def test_a_written_snapshot_is_a_hugging_face_directory_with_tied_weights_once(model, tmp_path):
    aliases = tied_aliases(model)
    assert aliases  # the tiny model ties lm_head to the embedding
    write_snapshot(tmp_path, model, model.state_dict(), torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    stored = load_file(tmp_path / SNAPSHOT_FILE)
    assert not set(aliases) & set(stored)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}

    # The engine's reader takes it as stored and finds it complete; the trainer's fills the
    # aliases in, so the whole state dict comes back.
    read = read_snapshot(tmp_path)
    assert read.keys() == stored.keys()
    assert check_snapshot(read, model.state_dict(), "snapshot") is read
    whole = read_state_dict(tmp_path, model)
    assert whole.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(whole[name], tensor.to(torch.bfloat16)), name


def test_a_snapshot_that_does_not_fit_the_model_is_refused_naming_why(model, tmp_path):
    expected = model.state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(SnapshotError, match=f"missing tensor {name!r}"):
        check_snapshot({k: v for k, v in expected.items() if k != name}, expected, "snapshot")
    with pytest.raises(SnapshotError, match="tensors this model does not"):
        check_snapshot({**expected, "extra.weight": torch.zeros(1)}, expected, "snapshot")
    with pytest.raises(SnapshotError, match=f"{name!r} has shape \\(3,\\)"):
        check_snapshot({**expected, name: torch.zeros(3)}, expected, "snapshot")
    with pytest.raises(SnapshotError, match="no safetensors snapshot there"):
        read_snapshot(tmp_path)
    (tmp_path / SNAPSHOT_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(SnapshotError, match=f"unreadable snapshot {SNAPSHOT_FILE!r}"):
        read_snapshot(tmp_path)
