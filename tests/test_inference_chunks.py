"""Inference in chunks: the same outputs as one pass over all windows and tokens, and a peak that stays a few times
the size of the token states.

In inference (no gradients, eval mode) a RAN layer on the PyTorch path projects, rotates, attends and finishes its
tokens a chunk of windows or tokens at a time (`RANLayer.inference_chunk_features`), and frees what it has read, so
that a 1M-token document fits its memory budget (benchmarks/memory/memory_cpu.json). Forcing chunks of one row here
exercises every chunk boundary.
"""

import pytest
import torch
from benchmark_utils import LiveTensorPeak
from ran_testing import pad_batch, random_ids, randomize_, tiny_config

from ran_hf import RANConfig, RANForCausalLM, RANModel
from ran_hf.ran_layer import RANLayer


WHOLE = 10**12  # more features than any test input: every chunk is all rows
CONFIGS = [
    pytest.param({}, id="encoder"),
    pytest.param({"window_overlap": 2, "cell_pooling": "mean"}, id="encoder-overlap"),
    pytest.param({"layer_design": "learnable_memory"}, id="encoder-residual-stream"),
    pytest.param({"memory_review": False}, id="encoder-no-review"),
    pytest.param({"attn_implementation": "eager"}, id="encoder-eager"),
    pytest.param({"is_causal": True}, id="causal"),
    pytest.param({"is_causal": True, "associative_memory": True}, id="causal-associative"),
]


def forward(model, chunk_features, monkeypatch, *inputs, **kwargs):
    monkeypatch.setattr(RANLayer, "inference_chunk_features", chunk_features)
    with torch.no_grad():
        return model(*inputs, **kwargs)


def batch(seed=0):
    sequences = [random_ids(n, 61, seed + n) for n in (23, 9, 31)]
    return pad_batch(sequences, side="left")


@pytest.mark.parametrize("fields", CONFIGS)
def test_inference_in_chunks_of_one_row_equals_one_pass(fields, monkeypatch):
    causal = fields.get("is_causal", False)
    model = randomize_((RANForCausalLM if causal else RANModel)(tiny_config(**fields)))
    ids, mask = batch()
    whole = forward(model, WHOLE, monkeypatch, ids, attention_mask=mask)
    chunked = forward(model, 1, monkeypatch, ids, attention_mask=mask)
    for name, value in whole.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(chunked[name], value, rtol=1e-4, atol=1e-5, msg=name)
    with torch.enable_grad():  # with gradients nothing is chunked
        tracked = model(ids, attention_mask=mask)
    for name, value in whole.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            torch.testing.assert_close(tracked[name].detach(), value, rtol=1e-4, atol=1e-5, msg=name)


def test_a_cached_continuation_in_chunks_equals_one_pass(monkeypatch):
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True)))
    ids, mask = batch(seed=3)
    logits = {}
    for features in (WHOLE, 1):
        first = forward(model, features, monkeypatch, ids[:, :17], attention_mask=mask[:, :17], use_cache=True)
        rest = forward(
            model, features, monkeypatch, ids[:, 17:], attention_mask=mask, past_key_values=first.past_key_values
        )
        logits[features] = torch.cat([first.logits, rest.logits], dim=1)
    torch.testing.assert_close(logits[1], logits[WHOLE], rtol=1e-4, atol=1e-5)


def test_eager_attention_weights_are_returned_whole(monkeypatch):
    """Asked for, the window attention's weights exist whole: that pass attends all windows at once."""
    model = randomize_(RANModel(tiny_config(attn_implementation="eager")))
    ids, mask = batch()
    whole = forward(model, WHOLE, monkeypatch, ids, attention_mask=mask, output_attentions=True)
    chunked = forward(model, 1, monkeypatch, ids, attention_mask=mask, output_attentions=True)
    assert len(chunked.attentions) == len(whole.attentions) == 2
    for chunked_weights, whole_weights in zip(chunked.attentions, whole.attentions):
        torch.testing.assert_close(chunked_weights, whole_weights)
    torch.testing.assert_close(chunked.last_hidden_state, whole.last_hidden_state)


def test_inference_peak_is_a_few_times_the_token_states(monkeypatch):
    """The most bytes the tensors of an inference pass hold at once, in units of its (T, D) float32 token states:
    8.3 at 65,536 tokens (hidden 128, window 256, the benchmark's model), where it was 17.4 when the per-token tail
    kept its half a dozen (T, D) intermediates alive together and the window projections lived through the whole
    layer. Here chunks of 1,024 tokens make 16,384 tokens as many chunks as 65,536 have."""
    monkeypatch.setattr(RANLayer, "inference_chunk_features", 2**17)
    torch.manual_seed(0)
    config = RANConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=32,
        window_size=256,
        min_window_size=16,
    )
    model = RANModel(config).eval()
    num_tokens = 16384
    ids = torch.randint(1, config.vocab_size, (1, num_tokens))
    with torch.no_grad(), LiveTensorPeak() as tensors:
        model(ids)
    token_states = num_tokens * config.hidden_size * 4
    assert tensors.peak_bytes / token_states < 11
