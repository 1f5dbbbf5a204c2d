"""The causal layer's associative memory (`config.associative_memory`): the chunked delta rule equals the
token-by-token rule (with `associative_decay`, the gated rule), in the state it leaves and in what each token reads
after its own write; no token reads a later one, the cache stays flat and streaming equals one pass, and the encoder
refuses it."""

import pytest
import torch
import torch.nn.functional as F
from ran_testing import CONFIG_ERROR, randomize_, tiny_config

from ran_hf import RANCache, RANConfig, RANForCausalLM, associative_memory
from ran_hf.associative_memory import delta_write, read_after_writes, unit_lower_inverse


def token_by_token(state, keys, values, betas, log_decays=None, queries=None):
    """S <- a_t (S - beta_t k_t (k_t^T S)) + beta_t k_t v_t^T, one token after another (a_t = 1 without decays); with
    `queries`, also what each reads after its write, q_t^T S_t."""
    reads = []
    for t in range(keys.shape[-2]):
        key, value, beta = keys[..., t, :], values[..., t, :], betas[..., t]
        if log_decays is not None:
            state = log_decays[..., t, None, None].exp() * state
        erased = state - beta[..., None, None] * key[..., :, None] * (key[..., None, :] @ state)
        state = erased + beta[..., None, None] * key[..., :, None] * value[..., None, :]
        if queries is not None:
            reads.append((queries[..., t, None, :] @ state)[..., 0, :])
    return state if queries is None else (state, torch.stack(reads, dim=-2))


@pytest.mark.parametrize("decays", [False, True], ids=["delta-rule", "gated"])
def test_the_chunked_write_and_reads_equal_the_delta_rule_token_by_token(decays):
    """The state after a window and what each slot's query reads after its own write; a slot that writes nothing
    reads what the slot before it left."""
    generator = torch.Generator().manual_seed(0)
    state = torch.randn(2, 3, 8, 8, generator=generator, dtype=torch.float64)
    keys = F.normalize(torch.randn(2, 3, 7, 8, generator=generator, dtype=torch.float64), dim=-1)
    values = torch.randn(2, 3, 7, 8, generator=generator, dtype=torch.float64)
    betas = torch.rand(2, 3, 7, generator=generator, dtype=torch.float64)
    betas[..., 2] = 0  # a slot that writes nothing
    log_decays = -3 * torch.rand(2, 3, 7, generator=generator, dtype=torch.float64) if decays else None
    if decays:
        log_decays[..., 2] = 0  # (as a slot that writes nothing has)
    queries = F.normalize(torch.randn(2, 3, 7, 8, generator=generator, dtype=torch.float64), dim=-1)
    after, corrected = delta_write(state, keys, values, betas, log_decays)
    expected_state, expected_reads = token_by_token(state, keys, values, betas, log_decays, queries)
    torch.testing.assert_close(after, expected_state)
    torch.testing.assert_close(read_after_writes(queries, state, keys, corrected, log_decays), expected_reads)


def test_a_log_decay_of_zero_is_the_delta_rule_and_the_export_form_agrees(monkeypatch):
    """Decays of 1 change nothing; the form an export runs (the matmul inverse instead of the triangular solve) gives
    the gated write the token-by-token rule gives."""
    generator = torch.Generator().manual_seed(3)
    state = torch.randn(1, 2, 4, 4, generator=generator, dtype=torch.float64)
    keys = F.normalize(torch.randn(1, 2, 5, 4, generator=generator, dtype=torch.float64), dim=-1)
    values = torch.randn(1, 2, 5, 4, generator=generator, dtype=torch.float64)
    betas = torch.rand(1, 2, 5, generator=generator, dtype=torch.float64)
    log_decays = -2 * torch.rand(1, 2, 5, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(
        delta_write(state, keys, values, betas, torch.zeros_like(betas)), delta_write(state, keys, values, betas)
    )
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    torch.testing.assert_close(
        delta_write(state, keys, values, betas, log_decays)[0], token_by_token(state, keys, values, betas, log_decays)
    )


@pytest.mark.parametrize("size", [1, 2, 7, 16, 37])
def test_the_matmul_inverse_an_export_runs_is_the_triangular_inverse(size):
    """Under `torch.export` the chunked write inverts I + A in matmuls (ONNX has no triangular solve): the inverse of
    unit lower-triangular matrices of any size, powers of two or not."""
    generator = torch.Generator().manual_seed(size)
    matrix = torch.eye(size, dtype=torch.float64) + torch.randn(3, size, size, generator=generator).double().tril(-1)
    torch.testing.assert_close(unit_lower_inverse(matrix), torch.linalg.inv(matrix))


def test_a_stored_binding_is_recalled_exactly():
    """One write with beta 1 of unit key k and value v makes a read with query k return v, whatever was there."""
    generator = torch.Generator().manual_seed(1)
    keys = F.normalize(torch.randn(1, 1, 1, 8, generator=generator, dtype=torch.float64), dim=-1)
    values = torch.randn(1, 1, 1, 8, generator=generator, dtype=torch.float64)
    state, _ = delta_write(torch.randn(1, 1, 8, 8, dtype=torch.float64), keys, values, torch.ones(1, 1, 1))
    torch.testing.assert_close(keys @ state, values)


def memory_model(seed=0, **overrides):
    fields = {"is_causal": True, "associative_memory": True, **overrides}
    return randomize_(RANForCausalLM(tiny_config(**fields)), seed=seed).eval()


@pytest.mark.parametrize("overrides", [{}, {"associative_decay": True}, {"window_overlap": 2}], ids=str)
def test_a_window_longer_than_a_write_chunk_is_written_chunk_after_chunk_exactly(monkeypatch, overrides):
    """A window of more slots than `WRITE_CHUNK` is written in chunks (the last one shorter), each from the state the
    one before left: the same logits and cache as one chunk per window, and as the decoding step's token-by-token
    rule."""
    model = memory_model(6, window_size=11, **overrides).double()
    ids = torch.randint(1, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = model(ids, use_cache=True)
        monkeypatch.setattr(associative_memory, "WRITE_CHUNK", 4)  # windows of 11 (or 13) slots: 4 + 4 + 3 (or 5)
        chunked = model(ids, use_cache=True)
        cache, steps = None, []
        for token in ids.split(1, dim=1):
            outputs = model(token, past_key_values=cache, use_cache=True)
            cache = outputs.past_key_values
            steps.append(outputs.logits)
    torch.testing.assert_close(chunked.logits, whole.logits, atol=1e-10, rtol=0)
    torch.testing.assert_close(torch.cat(steps, dim=1), chunked.logits, atol=1e-10, rtol=0)
    for layer, chunked_layer in zip(whole.past_key_values.layers, chunked.past_key_values.layers):
        torch.testing.assert_close(chunked_layer.binding_state, layer.binding_state, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"associative_key_conv": 0}, {"window_overlap": 1}, {"memory_review": False}, {"associative_decay": True}],
    ids=str,
)
def test_no_token_reads_a_later_one(overrides):
    model = memory_model(**overrides)
    ids = torch.randint(1, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 11:] = torch.randint(1, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before, after = model(ids).logits, model(changed).logits
    torch.testing.assert_close(before[:, :11], after[:, :11], atol=1e-6, rtol=0)
    assert (before[:, 12:] - after[:, 12:]).abs().max() > 1e-3


def test_every_token_reads_the_memory_its_own_window_included():
    """Turning the memory's read off changes every token, the first window's too: a token reads the writes of the
    tokens before it in its window, and its own."""
    model = memory_model()
    window = model.config.window_size
    ids = torch.randint(1, model.config.vocab_size, (2, 3 * window), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reading = model(ids).logits
        for layer in model.model.layers:
            layer.associative_memory.read_scale.zero_()
        silent = model(ids).logits
    assert (reading - silent).abs().amax(-1).min() > 1e-4


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"associative_key_conv": 0},
        {"window_overlap": 2},
        {"memory_review_cells": 1},
        {"window_overlap": 2, "associative_key_conv": 4},
        {"window_overlap": 2, "associative_decay": True},
    ],
    ids=str,
)
def test_streaming_equals_one_pass_and_the_cache_stays_flat(overrides):
    model = memory_model(3, **overrides)
    ids = torch.randint(1, model.config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        cache, pieces, sizes = None, [], []
        for start, end in ((0, 5), (5, 6), (6, 17), (17, 18), (18, 29)):
            outputs = model(ids[:, start:end], past_key_values=cache, use_cache=True)
            cache = outputs.past_key_values
            pieces.append(outputs.logits)
            sizes.append(cache.layers[0].binding_state.shape)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)
    assert len(set(sizes)) == 1  # (B, H, d, d) whatever the length


@pytest.mark.parametrize("overrides", [{}, {"associative_key_conv": 3}, {"associative_decay": True}], ids=str)
def test_a_left_padded_batch_reads_as_each_sequence_alone(overrides):
    model = memory_model(4, window_overlap=1, **overrides)
    lengths, total = [17, 9], 17
    ids = torch.zeros(2, total, dtype=torch.long)
    mask = torch.zeros(2, total, dtype=torch.long)
    sequences = [torch.randint(1, model.config.vocab_size, (n,)) for n in lengths]
    for row, sequence in enumerate(sequences):
        ids[row, total - len(sequence) :], mask[row, total - len(sequence) :] = sequence, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for row, sequence in enumerate(sequences):
            alone = model(sequence[None]).logits[0]
            torch.testing.assert_close(batched[row, total - len(sequence) :], alone, atol=1e-5, rtol=0)


def test_gradients_reach_the_write_strengths_and_the_memory_trains():
    model = memory_model(5)
    model.train()
    ids = torch.randint(1, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    model(ids, labels=ids).loss.backward()
    memory = model.model.layers[0].associative_memory
    assert memory.write_strength.weight.grad.abs().sum() > 0 and memory.read_scale.grad.abs().sum() > 0


def test_the_key_convolution_is_a_causal_convolution_within_the_window():
    """Each written key mixes itself and the `associative_key_conv` - 1 slots before it in its window, per channel,
    as torch's grouped conv1d with left padding computes it."""
    model = memory_model(6, associative_key_conv=3)
    memory = model.model.layers[0].associative_memory
    heads, head_dim = memory.num_heads, memory.head_dim
    keys = torch.randn(2, heads, 7, head_dim, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        taps = memory.key_conv  # (c, H, 1, d); tap j weighs the key j slots before
        channels = keys.permute(0, 1, 3, 2).reshape(2, heads * head_dim, 7)
        weight = taps.flip(0).permute(1, 3, 2, 0).reshape(heads * head_dim, 1, 3)
        expected = F.conv1d(F.pad(channels, (2, 0)), weight, groups=heads * head_dim)
        expected = F.normalize(expected.reshape(2, heads, head_dim, 7).transpose(-1, -2), dim=-1)
        torch.testing.assert_close(memory.written_keys(keys), expected, atol=1e-6, rtol=0)


def test_the_key_convolution_starts_as_the_identity_and_trains():
    """At initialisation a model with the convolution computes what the same weights compute without it; its taps
    then get gradients, the earlier slots' included."""
    torch.manual_seed(7)
    convolved = RANForCausalLM(tiny_config(is_causal=True, associative_memory=True, associative_key_conv=3))
    plain = RANForCausalLM(tiny_config(is_causal=True, associative_memory=True, associative_key_conv=0))
    plain.load_state_dict({k: v for k, v in convolved.state_dict().items() if "key_conv" not in k})
    ids = torch.randint(1, plain.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(convolved.eval()(ids).logits, plain.eval()(ids).logits, atol=1e-6, rtol=0)
    convolved.train()(ids, labels=ids).loss.backward()
    taps = convolved.model.layers[0].associative_memory.key_conv.grad
    assert taps[1:].abs().sum() > 0
    with pytest.raises(CONFIG_ERROR, match="`associative_key_conv` convolves the keys of the associative memory"):
        tiny_config(is_causal=True, associative_memory=False, associative_key_conv=3)


def test_the_decay_starts_slow_in_some_heads_fast_in_others_and_trains():
    """Each head's decay rate per token starts between 1e-4 and 1e-2 (softplus of its bias), whatever the token; the
    decay's weights then get gradients; without the memory the field is refused."""
    torch.manual_seed(9)
    model = RANForCausalLM(tiny_config(is_causal=True, associative_memory=True, associative_decay=True))
    memory = model.model.layers[0].associative_memory
    rates = F.softplus(memory.decay_bias.detach().double())
    torch.testing.assert_close(rates, torch.logspace(-4, -2, memory.num_heads, dtype=torch.float64))
    ids = torch.randint(1, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(8))
    model.train()(ids, labels=ids).loss.backward()
    assert memory.decay.weight.grad.abs().sum() > 0 and memory.decay_bias.grad.abs().sum() > 0
    with pytest.raises(CONFIG_ERROR, match="`associative_decay` decays the associative memory"):
        tiny_config(is_causal=True, associative_memory=False, associative_decay=True)


def test_the_encoder_refuses_it_and_a_cache_of_a_model_without_it_is_refused():
    with pytest.raises(CONFIG_ERROR, match="`associative_memory` and `cutoffs` belong to the causal LM"):
        RANConfig(associative_memory=True)
    plain = RANForCausalLM(tiny_config(is_causal=True, associative_memory=False)).eval()
    cache = plain(torch.ones(1, 5, dtype=torch.long), use_cache=True).past_key_values
    with pytest.raises(CONFIG_ERROR, match="associative_memory"):
        memory_model()(torch.ones(1, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    assert isinstance(cache, RANCache)
