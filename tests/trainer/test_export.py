"""`asyncrl export`: a run's checkpoint as a Hugging Face model directory that transformers
loads as it is (and peft, for a LoRA adapter), computing the trained policy."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.model.lora import adapter_state, with_adapter
from asyncrl.model.policy import load_policy
from asyncrl.spec import parse_manifest
from asyncrl.trainer.checkpoints import TrainerState, save_checkpoint
from asyncrl.trainer.export import ExportError, checkpoint_of
from asyncrl.trainer.export import export as write_export

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
PROMPT = [1, 17, 300, 4005, 42]


def job(tmp_path: Path, lora: bool) -> tuple[Path, object]:
    manifest = {"apiVersion": "asyncrl.io/v1alpha1", "kind": "RLJob",
                "metadata": {"name": "exported"},
                "spec": {"model": {"source": "tiny-random",
                                   **({"lora": {"rank": 4, "alpha": 8}} if lora else {})}}}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(manifest))
    return run_dir, parse_manifest(manifest).spec


def export(run_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([ASYNCRL, "export", str(run_dir), str(out), *extra],
                          capture_output=True, text=True, timeout=300)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def greedy(model, ids, tokens=8):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                             min_new_tokens=tokens)
    return out[0, len(ids):].tolist()


def test_a_full_checkpoint_exports_as_a_model_transformers_loads(tmp_path):
    run_dir, spec = job(tmp_path, lora=False)
    trained, _ = load_policy(spec.model)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    save_checkpoint(trained, trained.state_dict(), {"state": {}, "param_groups": []}, run_dir,
                    TrainerState(3, 3))
    done = export(run_dir, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(logits(loaded, PROMPT), logits(trained.eval(), PROMPT))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template and loaded.generation_config.eos_token_id == \
        tokenizer.eos_token_id
    # Greedy tokens of the export are the torch engine's for the same weights.
    engine = TorchEngine(trained, max_running_requests=1, max_sequence_length=32)
    future = engine.submit(PROMPT, SamplingParams(max_new_tokens=8, temperature=0,
                                                  ignore_eos=True))
    engine.run_until_idle()
    assert future.result().output_ids == greedy(loaded, PROMPT)


def test_a_lora_checkpoint_exports_as_its_adapter_or_merged(tmp_path):
    run_dir, spec = job(tmp_path, lora=True)
    base, _ = load_policy(spec.model)
    wrapped = with_adapter(base, spec.model.lora, torch.float32)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if ".lora_" in name:
                parameter.copy_(0.05 * torch.randn_like(parameter))
    save_checkpoint(wrapped, adapter_state(wrapped), {"state": {}, "param_groups": []}, run_dir,
                    TrainerState(2, 2), lora=spec.model.lora)
    expected = logits(wrapped.eval(), PROMPT)

    write_export(checkpoint_of(run_dir, None), spec.model, tmp_path / "adapter")
    fresh, _ = load_policy(spec.model)
    adapted = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(logits(adapted, PROMPT), expected)

    assert "merged" in write_export(checkpoint_of(run_dir, 2), spec.model,
                                    tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, PROMPT), expected, atol=1e-4, rtol=0)


def test_what_cannot_be_exported_is_refused_saying_why(tmp_path):
    run_dir, spec = job(tmp_path, lora=False)
    with pytest.raises(ExportError, match="no checkpoints"):
        checkpoint_of(run_dir, None)
    model, _ = load_policy(spec.model)
    save_checkpoint(model, model.state_dict(), {"state": {}, "param_groups": []}, run_dir,
                    TrainerState(2, 2))
    with pytest.raises(ExportError, match="no checkpoint of step 9"):
        checkpoint_of(run_dir, 9)
    with pytest.raises(ExportError, match="export it without --merge"):
        write_export(checkpoint_of(run_dir, 2), spec.model, tmp_path / "out", merge=True)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("")
    with pytest.raises(ExportError, match="not empty"):
        write_export(checkpoint_of(run_dir, 2), spec.model, tmp_path / "taken")
