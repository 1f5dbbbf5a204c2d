"""The seams of a RAN layer: window attention through Transformers' attention functions (and the weights it returns),
and the cell scan chosen by name from `ALL_SCAN_FUNCTIONS`."""

import logging

import pytest
import torch

from ran_hf import (
    RANForCausalLM,
    RANForMaskedLM,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
    ran_model,
)
from ran_hf.cell_scan import ALL_SCAN_FUNCTIONS, RANScanInterface, reference_cell_scan


LENGTHS = (13, 6)  # three windows (the last a merged tail) and two windows, right-padded


def batch(vocab_size=64):
    ids = torch.randint(1, vocab_size, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return ids, mask


@pytest.mark.parametrize("is_causal", [False, True], ids=["encoder", "causal"])
def test_eager_weights_are_what_each_token_read(make_config, is_causal):
    config = make_config(is_causal=is_causal)
    model = RANModel._from_config(config, attn_implementation="eager").eval()
    ids, mask = batch()
    attentions = model(ids, attention_mask=mask, output_attentions=True).attentions
    num_slots = config.window_size + (1 if is_causal else config.min_window_size) - 1
    assert len(attentions) == config.num_hidden_layers
    for weights in attentions:
        assert weights.shape == (2, config.num_attention_heads, max(LENGTHS), 1 + num_slots)
        real = mask.bool()[:, None, :].expand(-1, config.num_attention_heads, -1)
        torch.testing.assert_close(weights.sum(-1)[real], torch.ones(int(real.sum())))
        assert (weights[~real] == 0).all()
        if is_causal:
            # Token t of a window (slot t) reads the cell (key 0) and slots 0..t only.
            position_in_window = torch.arange(max(LENGTHS)) % config.window_size
            future = torch.arange(1 + num_slots)[None, :] > position_in_window[:, None] + 1  # (L, 1 + S)
            assert (weights[:, :, future] == 0).all()


@pytest.mark.parametrize("is_causal", [False, True], ids=["encoder", "causal"])
def test_eager_and_sdpa_compute_the_same(make_config, is_causal):
    config = make_config(is_causal=is_causal)
    torch.manual_seed(0)
    reference = RANModel._from_config(config, attn_implementation="eager").eval()
    ids, mask = batch()
    expected = reference(ids, attention_mask=mask).last_hidden_state
    model = RANModel._from_config(config, attn_implementation="sdpa").eval()
    model.load_state_dict(reference.state_dict())
    torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state, expected)


@pytest.mark.parametrize("is_causal", [False, True], ids=["encoder", "causal"])
def test_memory_review_weights_read_only_the_cells_a_token_may_read(make_config, is_causal):
    config = make_config(is_causal=is_causal)
    model = RANModel(config).eval()
    ids, mask = batch()
    outputs = model(ids, attention_mask=mask, output_attentions=True)
    window = torch.arange(max(LENGTHS)) // config.window_size
    for weights in outputs.memory_attentions:
        # The longest sequence has three windows (4 + 4 + 5: the tail merges), or four causal ones (4 + 4 + 4 + 1) plus
        # the starting cell, read first.
        num_cells = 5 if is_causal else 3
        assert weights.shape == (2, max(LENGTHS), num_cells)
        real = mask.bool()
        torch.testing.assert_close(weights.sum(-1)[real], torch.ones(int(real.sum())))
        assert (weights[~real] == 0).all()
        if is_causal:
            # A token of window w reads the starting cell and the cells of windows 0 .. w - 1.
            readable = torch.arange(num_cells)[None, :] <= window[:, None]  # (L, C)
            assert (weights[:, ~readable] == 0).all()
        else:
            assert (weights[1, :, 2:] == 0).all()  # the 6-token sequence has two windows


def test_sdpa_returns_memory_weights_and_warns_about_window_weights(make_config, caplog):
    model = RANModel._from_config(make_config(), attn_implementation="sdpa").eval()
    ids, mask = batch()
    ran_model.logger.warning_once.cache_clear()  # a warning given once per process may have been given already
    with caplog.at_level(logging.WARNING, logger="ran_hf.ran_model"):
        outputs = model(ids, attention_mask=mask, output_attentions=True)
    assert outputs.attentions == ()  # as Transformers' output capture gives it for SDPA, which returns no weights
    assert len(outputs.memory_attentions) == model.config.num_hidden_layers
    assert 'attn_implementation="eager"' in caplog.text


def test_hidden_states_are_captured_by_index_and_carry_gradients(make_config):
    """Transformers' output capture: `output_hidden_states` as a flag gives the embeddings and every layer's states
    (the last one the returned `last_hidden_state`), as indices only those; the returned states are in the graph, so
    a loss has gradients with respect to them; no memory-review weights unless attentions are asked for."""
    model = RANModel._from_config(make_config(), attn_implementation="eager").eval()
    ids, mask = batch()
    outputs = model(ids, attention_mask=mask, output_hidden_states=True)
    states = outputs.hidden_states
    assert len(states) == model.config.num_hidden_layers + 1 and outputs.memory_attentions is None
    assert all(state.shape == outputs.last_hidden_state.shape for state in states)
    assert states[-1] is outputs.last_hidden_state
    real = mask.bool()
    assert torch.equal(states[0][real], model.embeddings(input_ids=ids)[real]) and (states[0][~real] == 0).all()
    selected = model(ids, attention_mask=mask, output_hidden_states=[0, -2]).hidden_states
    assert selected[1:-2] == (None,) * (len(states) - 3) and selected[-1] is None
    assert torch.equal(selected[0], states[0]) and torch.allclose(selected[-2], states[-2])
    for state in states:
        state.retain_grad()
    outputs.last_hidden_state.sum().backward()
    assert all(state.grad is not None and state.grad.abs().sum() > 0 for state in states[:-1])


@pytest.mark.parametrize("head", [RANForMaskedLM, RANForSequenceClassification, RANForTokenClassification])
def test_heads_pass_both_weights_on(make_config, head):
    model = head._from_config(make_config(), attn_implementation="eager").eval()
    outputs = model(*batch(), output_attentions=True)
    assert len(outputs.attentions) == len(outputs.memory_attentions) == model.config.num_hidden_layers


def test_generation_returns_no_weights_but_runs_eager(make_config):
    model = RANForCausalLM._from_config(make_config(), attn_implementation="eager").eval()
    ids, mask = batch()
    sdpa = RANForCausalLM._from_config(make_config(), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(model.state_dict())
    kwargs = {"attention_mask": mask[:1], "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids[:1], **kwargs), sdpa.generate(ids[:1], **kwargs))


def test_a_registered_scan_is_the_one_that_runs(make_config):
    calls = []

    def counting_scan(cell_scan, weights, *args):
        calls.append(cell_scan)
        return reference_cell_scan(cell_scan, weights, *args)

    RANScanInterface.register("counting", counting_scan)
    try:
        torch.manual_seed(0)
        reference = RANModel(make_config()).eval()
        counting = RANModel(make_config(scan_implementation="counting")).eval()
        counting.load_state_dict(reference.state_dict())
        ids, mask = batch()
        torch.testing.assert_close(
            counting(ids, attention_mask=mask).last_hidden_state, reference(ids, attention_mask=mask).last_hidden_state
        )
        assert calls == [layer.cell_scan for layer in counting.layers]
    finally:
        del RANScanInterface._global_mapping["counting"]
    assert "counting" not in ALL_SCAN_FUNCTIONS


def test_an_unknown_scan_is_named(make_config):
    model = RANModel(make_config(scan_implementation="fused-someday")).eval()
    with pytest.raises(ValueError, match=r"'fused-someday'.*registered: \[.*'reference'"):
        model(*batch())


def test_window_maxima_are_a_soft_maximum_of_the_readable_slots_only():
    from ran_hf.scan_inputs import MAX_POOL_TEMPERATURE, window_maxima

    values = torch.randn(3, 2, 4, 6, 5, dtype=torch.float64, requires_grad=True)  # (N, B, H, S, d)
    mask = torch.ones(3, 2, 6, dtype=torch.bool)
    mask[0, 1, 3:] = False  # a short window
    mask[2, 1] = False  # a sequence without a third window
    maxima = window_maxima(values, mask)
    hard = values.detach().masked_fill(~mask[:, :, None, :, None], float("-inf")).amax(-2)
    readable = mask.sum(-1)[..., None, None]  # (N, B, 1, 1)
    close = (maxima - hard).detach()
    assert ((close >= 0) & (close <= MAX_POOL_TEMPERATURE * readable.clamp(min=1).log() + 1e-12))[mask.any(-1)].all()
    assert (maxima[2, 1] == 0).all()
    maxima.sum().backward()
    assert torch.isfinite(values.grad).all()
    assert (values.grad[0, 1, :, 3:] == 0).all() and (values.grad[2, 1] == 0).all()  # nothing reaches hidden slots
    # Every readable feature's gradient is a distribution over the window's slots.
    sums = values.grad.sum(-2)
    assert torch.allclose(sums[mask.any(-1)], torch.ones_like(sums[mask.any(-1)]))
