"""Checkpoints and `asyncrl export`: Hugging Face model directories that transformers loads
as they are (and peft, for a LoRA adapter), with tokenizer, generation config and a card
naming the job and step, computing the trained policy."""

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
from asyncrl.trainer.checkpoints import TrainerState, read_checkpoint, save_checkpoint
from asyncrl.trainer.export import ExportError, checkpoint_of
from asyncrl.trainer.export import export as write_export
from asyncrl.trainer.model_files import ModelFiles

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
    return run_dir, parse_manifest(manifest)


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


def card_header(directory: Path) -> dict:
    text = (directory / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_a_full_checkpoint_and_its_export_are_models_transformers_loads(tmp_path):
    run_dir, rljob = job(tmp_path, lora=False)
    spec = rljob.spec
    trained, tokenizer = load_policy(spec.model)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    checkpoint = save_checkpoint(
        trained, trained.state_dict(), {"state": {}, "param_groups": []}, run_dir,
        TrainerState(3, 3), files=ModelFiles.of(rljob, trained, tokenizer))
    # The files a serving stack needs do not get in the way of resuming.
    assert read_checkpoint(checkpoint, trained).state == TrainerState(3, 3)
    done = export(run_dir, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    engine = TorchEngine(trained.eval(), max_running_requests=1, max_sequence_length=32)
    future = engine.submit(PROMPT, SamplingParams(max_new_tokens=8, temperature=0,
                                                  ignore_eos=True))
    engine.run_until_idle()
    for directory in (checkpoint, tmp_path / "out"):
        loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
        torch.testing.assert_close(logits(loaded, PROMPT), logits(trained, PROMPT))
        loaded_tokenizer = AutoTokenizer.from_pretrained(directory)
        assert loaded_tokenizer.chat_template == tokenizer.chat_template
        assert loaded_tokenizer("12 + 30 =").input_ids == tokenizer("12 + 30 =").input_ids
        assert loaded.generation_config.eos_token_id == tokenizer.eos_token_id
        # Greedy tokens of the directory are the torch engine's for the same weights.
        assert future.result().output_ids == greedy(loaded, PROMPT)
        card = card_header(directory)
        assert card["library_name"] == "transformers"
        assert card["tags"] == ["asyncrl", "reinforcement-learning"]
        assert "base_model" not in card  # the tiny random model is on no Hub
        text = (directory / "README.md").read_text()
        assert "`exported`" in text and "`tiny-random`" in text and "step 3" in text


def test_a_lora_checkpoint_exports_as_its_adapter_or_merged(tmp_path):
    run_dir, rljob = job(tmp_path, lora=True)
    spec = rljob.spec
    base, tokenizer = load_policy(spec.model)
    wrapped = with_adapter(base, spec.model.lora, torch.float32)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if ".lora_" in name:
                parameter.copy_(0.05 * torch.randn_like(parameter))
    checkpoint = save_checkpoint(
        wrapped, adapter_state(wrapped), {"state": {}, "param_groups": []}, run_dir,
        TrainerState(2, 2), lora=spec.model.lora,
        files=ModelFiles.of(rljob, base, tokenizer))
    expected = logits(wrapped.eval(), PROMPT)

    write_export(checkpoint_of(run_dir, None), rljob, tmp_path / "adapter")
    # The checkpoint and its export are adapters with the tokenizer beside them.
    for directory in (checkpoint, tmp_path / "adapter"):
        fresh, _ = load_policy(spec.model)
        adapted = PeftModel.from_pretrained(fresh, str(directory)).eval()
        torch.testing.assert_close(logits(adapted, PROMPT), expected)
        assert AutoTokenizer.from_pretrained(directory).chat_template == tokenizer.chat_template
        assert card_header(directory)["library_name"] == "peft"
        assert "step 2" in (directory / "README.md").read_text()

    assert "merged" in write_export(checkpoint_of(run_dir, 2), rljob,
                                    tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, PROMPT), expected, atol=1e-4, rtol=0)
    assert card_header(tmp_path / "merged")["library_name"] == "transformers"
    assert "LoRA adapter merged" in (tmp_path / "merged" / "README.md").read_text()


def test_a_card_names_the_hub_model_a_job_started_from():
    from asyncrl.trainer.model_files import model_card

    header = yaml.safe_load(model_card("gsm8k", "Qwen/Qwen2.5-0.5B-Instruct", 40,
                                       adapter=False).split("---\n")[1])
    assert header["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    builtin = yaml.safe_load(model_card("arith", "smollm2-135m-instruct", 5,
                                        adapter=True).split("---\n")[1])
    assert builtin["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_what_cannot_be_exported_is_refused_saying_why(tmp_path):
    run_dir, rljob = job(tmp_path, lora=False)
    spec = rljob.spec
    with pytest.raises(ExportError, match="no checkpoints"):
        checkpoint_of(run_dir, None)
    model, _ = load_policy(spec.model)
    save_checkpoint(model, model.state_dict(), {"state": {}, "param_groups": []}, run_dir,
                    TrainerState(2, 2))
    with pytest.raises(ExportError, match="no checkpoint of step 9"):
        checkpoint_of(run_dir, 9)
    with pytest.raises(ExportError, match="export it without --merge"):
        write_export(checkpoint_of(run_dir, 2), rljob, tmp_path / "out", merge=True)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("")
    with pytest.raises(ExportError, match="not empty"):
        write_export(checkpoint_of(run_dir, 2), rljob, tmp_path / "taken")


def test_a_hub_model_at_a_revision_exports_offline_from_the_cache(tmp_path, monkeypatch):
    """model.revision names the snapshot: with the Hub off, export finds the model's tokenizer
    at that revision in the cache (there is no main to fall back on)."""
    from asyncrl.model.hub import download
    from support.hub import HubStandIn, point_huggingface_hub_at, write_tiny_hub_model

    repo, cache = "tiny-org/tiny-chat", tmp_path / "hf"
    with HubStandIn() as hub:
        hub.add_model(repo, write_tiny_hub_model(tmp_path / "repo"), revisions=("v1",))
        point_huggingface_hub_at(monkeypatch, hub, cache)
        download(repo, "v1")
    point_huggingface_hub_at(monkeypatch, None, cache, offline=True)
    manifest = {"apiVersion": "asyncrl.io/v1alpha1", "kind": "RLJob",
                "metadata": {"name": "exported"},
                "spec": {"model": {"source": repo, "revision": "v1"}}}
    rljob = parse_manifest(manifest)
    run_dir = tmp_path / "run"
    model, tokenizer = load_policy(rljob.spec.model)
    save_checkpoint(model, model.state_dict(), {"state": {}, "param_groups": []}, run_dir,
                    TrainerState(1, 1), files=ModelFiles.of(rljob, model, tokenizer))

    write_export(checkpoint_of(run_dir, None), rljob, tmp_path / "out")
    exported = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert exported("12 + 30 =").input_ids == tokenizer("12 + 30 =").input_ids
    assert card_header(tmp_path / "out")["base_model"] == repo
