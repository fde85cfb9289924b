import pytest
import torch

from asyncrl.model.policy import (
    SMOLLM2,
    TinyModelConfig,
    build_tiny_model,
    load_model,
    load_tokenizer,
    packed_token_logprobs,
)
from asyncrl.model.packed_attention import PACKED_SDPA, use_packed_attention
from support.tiny_model import tiny_model


def _single(model, ids):
    return packed_token_logprobs(model, ids, torch.arange(ids.numel()), torch.tensor([0, ids.numel()]))


def test_packed_logprobs_match_each_sequence_alone():
    model = tiny_model(vocab_size=300).eval()
    sequences = [torch.randint(0, 300, (n,)) for n in (5, 1, 9, 3)]
    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(s.numel()) for s in sequences])
    cu_seqlens = torch.tensor([0, 5, 6, 15, 18])
    with torch.no_grad():
        packed = packed_token_logprobs(model, ids, positions, cu_seqlens)
        alone = torch.cat([_single(model, s) for s in sequences])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    # First token of every sequence has no prefix.
    assert packed[cu_seqlens[:-1]].abs().sum() == 0


def test_packed_attention_equals_the_block_diagonal_mask_in_values_and_gradients():
    """Packed SDPA (per-sequence attention) against transformers' SDPA over the whole packed
    row with its block-diagonal mask: the same log-probs and gradients. Without sequence
    boundaries (generation) the switched model computes exactly what SDPA does."""
    reference = tiny_model(vocab_size=300)
    packed = use_packed_attention(tiny_model(vocab_size=300))
    assert packed.config._attn_implementation == PACKED_SDPA
    assert reference.config._attn_implementation == "sdpa"
    sequences = [torch.randint(0, 300, (n,)) for n in (7, 2, 11, 4)]
    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(s.numel()) for s in sequences])
    cu_seqlens = torch.tensor([0, 7, 9, 20, 24])
    results = []
    for model in (reference, packed):
        logprobs = packed_token_logprobs(model, ids, positions, cu_seqlens, 0.7)
        (logprobs * torch.linspace(-1, 1, 24)).sum().backward()
        results.append((logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (expected, expected_grads), (got, grads) = results
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)  # |grad| ~ 10
    with torch.no_grad():
        prompt = sequences[2][None]
        generated = [m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=2)
                     for m in (reference, packed)]
        logits = [m(sequences[0][None]).logits for m in (reference, packed)]
    assert torch.equal(generated[0], generated[1])
    torch.testing.assert_close(logits[1], logits[0], atol=0, rtol=0)


def test_only_the_needed_logprobs_are_computed_and_they_are_the_same():
    """The trainer asks for the response tokens' log-probs only: the same values, zeros
    elsewhere, and the gradient reaches the model through exactly those."""
    model = tiny_model(vocab_size=300)
    sequences = [torch.randint(0, 300, (n,)) for n in (6, 4, 7)]
    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(s.numel()) for s in sequences])
    cu_seqlens = torch.tensor([0, 6, 10, 17])
    needed = torch.zeros(17, dtype=torch.bool)
    needed[[0, 3, 4, 5, 8, 9, 12, 16]] = True  # 0 starts a sequence: it has no prefix
    full = packed_token_logprobs(model, ids, positions, cu_seqlens, 0.8)
    part = packed_token_logprobs(model, ids, positions, cu_seqlens, 0.8, needed=needed)
    expected = torch.where(needed, full, torch.zeros_like(full))
    expected[0] = 0.0
    torch.testing.assert_close(part, expected.detach(), atol=1e-6, rtol=1e-6)
    assert (part[~needed] == 0).all() and (part[[3, 4, 5, 8, 9, 12, 16]] != 0).all()
    part.sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    none = packed_token_logprobs(model, ids, positions, cu_seqlens,
                                 needed=torch.zeros(17, dtype=torch.bool))
    assert none.shape == (17,) and (none == 0).all()


def test_recomputed_logits_and_checkpointed_layers_give_the_same_logprobs_and_gradients(
        monkeypatch):
    """Activation checkpointing (asyncrl.model.recompute): layers that keep only their inputs and
    logits made in blocks (of 4 positions here, so blocks split sequences) and recomputed in
    backward give what the plain forward gives, values and gradients, with a temperature and
    only some positions needed."""
    import asyncrl.model.recompute as recompute

    monkeypatch.setattr(recompute, "LOGIT_ROWS", 4)
    # Seeded: the order blocks add gradients in differs, so some inputs land nearer the
    # tolerance than others; these are the same in every run.
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 300, (n,), generator=generator) for n in (7, 2, 11, 4)]
    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(s.numel()) for s in sequences])
    cu_seqlens = torch.tensor([0, 7, 9, 20, 24])
    needed = torch.rand(24, generator=generator) < 0.7
    results = []
    for recomputed in (False, True):
        model = use_packed_attention(tiny_model(vocab_size=300)).eval()
        if recomputed:
            assert recompute.checkpoint_decoder_layers(model) == 2
        logprobs = packed_token_logprobs(model, ids, positions, cu_seqlens, 0.7, needed,
                                         recompute_logits=recomputed)
        (logprobs * torch.linspace(-1, 1, 24)).sum().backward()
        results.append((logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (expected, expected_grads), (got, grads) = results
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert (got[~needed] == 0).all()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("recomputed", [False, True])
def test_a_row_sharing_prefixes_gives_each_sequences_logprobs_and_gradients(recomputed,
                                                                          monkeypatch):
    """Three responses to one prompt and one sequence of its own, packed with the prompt once
    (its responses continue it): every response token's log-prob and every gradient are
    those of the row with each sequence whole, with a temperature, some positions only and,
    with activation checkpointing, logits recomputed in blocks that split sequences."""
    import asyncrl.model.recompute as recompute
    from asyncrl.algorithms.packing import pack_sequences, pack_sharing_prefixes

    monkeypatch.setattr(recompute, "LOGIT_ROWS", 4)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 300, (6,), generator=generator)
    sequences = [torch.cat([prompt, torch.randint(0, 300, (n,), generator=generator)])
                 for n in (3, 7, 1)] + [torch.randint(0, 300, (9,), generator=generator)]
    needed = [torch.arange(len(s)) >= 6 for s in sequences[:3]] + [torch.arange(9) >= 4]
    weights = [torch.rand(len(s), generator=generator) for s in sequences]
    tags = [torch.arange(len(s)) + 100 * i for i, s in enumerate(sequences)]
    fields = {"needed": needed, "weight": weights, "tag": tags}
    results = []
    for packed in (pack_sequences(sequences, fields),
                   pack_sharing_prefixes(sequences, [6, 6, 6, 0], fields)):
        model = use_packed_attention(tiny_model(vocab_size=300)).eval()
        if recomputed:
            recompute.checkpoint_decoder_layers(model)
        logprobs = packed_token_logprobs(
            model, packed.input_ids, packed.position_ids, packed.cu_seqlens, 0.7,
            packed.fields["needed"], recompute_logits=recomputed, continues=packed.continues)
        (logprobs * packed.fields["weight"]).sum().backward()
        wanted = packed.fields["needed"]
        results.append((packed, dict(zip(packed.fields["tag"][wanted].tolist(),
                                         logprobs[wanted].tolist())),
                        {n: p.grad for n, p in model.named_parameters()}))
    (whole, expected, expected_grads), (shared, got, grads) = results
    assert shared.num_tokens == whole.num_tokens - 2 * 6  # the prompt once, not three times
    assert shared.continues.tolist() == [-1, 0, 0, 0, -1]
    assert got.keys() == expected.keys() and len(got) == 3 + 7 + 1 + 5
    assert got == pytest.approx(expected, abs=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_row_sharing_prefixes_needs_packed_attention():
    from asyncrl.algorithms.packing import pack_sharing_prefixes

    prompt = torch.randint(0, 300, (4,))
    packed = pack_sharing_prefixes([torch.cat([prompt, torch.tensor([1, 2])])] * 2, [4, 4])
    with pytest.raises(ValueError, match="needs packed attention"):
        packed_token_logprobs(tiny_model(vocab_size=300),
                              packed.input_ids, packed.position_ids, packed.cu_seqlens,
                              continues=packed.continues)


def test_logits_are_recomputed_only_for_models_whose_logits_are_their_heads_output():
    model = tiny_model(vocab_size=300)
    model.config.model_type = "gemma2"  # soft-caps its logits after the head
    ids = torch.randint(0, 300, (6,))
    with pytest.raises(ValueError, match="gemma2"):
        packed_token_logprobs(model, ids, torch.arange(6), torch.tensor([0, 6]),
                              recompute_logits=True)


def test_logprobs_are_log_softmax_of_the_next_token_with_temperature():
    model = tiny_model(vocab_size=300).eval()
    ids = torch.randint(0, 300, (6,))
    with torch.no_grad():
        logits = model(ids[None]).logits[0] / 0.7
        expected = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
        got = packed_token_logprobs(model, ids, torch.arange(6), torch.tensor([0, 6]), 0.7)
    torch.testing.assert_close(got[1:], expected, atol=1e-5, rtol=1e-5)


def test_tiny_model_is_deterministic_by_seed():
    a = build_tiny_model(TinyModelConfig(seed=3), vocab_size=100)
    b = build_tiny_model(TinyModelConfig(seed=3), vocab_size=100)
    c = build_tiny_model(TinyModelConfig(seed=4), vocab_size=100)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_unknown_source_and_dtype_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.source"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="model.dtype"):
        load_model("tiny-random", dtype="float8")


@pytest.mark.slow
def test_smollm2_loads_from_the_packaged_gguf_and_answers():
    tokenizer = load_tokenizer(SMOLLM2)
    model = load_model(SMOLLM2).eval()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    messages = [{"role": "user", "content": "What is 2+3?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "5" in tokenizer.decode(out[0, ids.shape[1]:])


def _file_mappings(path) -> list[tuple[int, int]]:
    """The address ranges this process maps from `path` (Linux /proc/self/maps)."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loaded_parameters_own_their_memory_not_the_checkpoint_file(tmp_path, dtype):
    """A parameter left mapped from the checkpoint (copy on write) makes the first in-place
    update fault in every page: the first weight swap took seconds that way."""
    source = tiny_model(vocab_size=512)
    source.save_pretrained(tmp_path)
    checkpoint = (tmp_path / "model.safetensors").resolve()
    model = load_model(str(tmp_path), dtype=dtype)
    mapped = _file_mappings(checkpoint)
    inside = [name for name, p in model.named_parameters()
              if any(start <= p.data_ptr() < end for start, end in mapped)]
    assert inside == []
    expected = dict(source.named_parameters())
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, expected[name].to(parameter.dtype)), name
