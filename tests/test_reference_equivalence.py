"""The fast layer (all windows at once, one cell scan, one batched attention) equals the per-window reference."""

import pytest
import torch
from ran_reference import reference_forward
from ran_testing import pad_batch, random_ids, randomize_, real_positions, tiny_config

from ran_hf import RANModel


TOLERANCE = 1e-5

# (config overrides, sequence lengths in one batch). Window 5, minimum window 2 unless overridden: lengths cover
# shorter than a window, exactly one window, a merged tail (11 = 5 + 5 + 1), a kept tail (12), exact multiples.
CASES = [
    pytest.param({}, [3], id="one-short-window"),
    pytest.param({}, [5], id="exactly-one-window"),
    pytest.param({}, [6], id="merged-into-single-window"),
    pytest.param({}, [11, 12, 10, 1], id="merge-keep-multiple-single"),
    pytest.param({"num_hidden_layers": 1}, [17, 9], id="one-layer"),
    pytest.param({"num_hidden_layers": 3}, [23, 4, 15], id="three-layers"),
    pytest.param({"window_overlap": 2}, [16, 7, 5], id="overlap-2"),
    pytest.param({"window_overlap": 4, "num_hidden_layers": 3}, [21, 11], id="overlap-4-three-layers"),
    pytest.param({"cell_pooling": "mean"}, [14, 6], id="mean-pooling"),
    pytest.param({"cell_pooling": "max"}, [14, 6], id="max-pooling"),
    pytest.param({"memory_review": False}, [13, 3], id="no-memory-review"),
    pytest.param({"use_cell_residual": False}, [14, 6], id="no-cell-residual"),
    pytest.param({"use_rotary": False}, [14, 6], id="no-rotary"),
    pytest.param({"token_pooling": "mean"}, [14, 6], id="token-mean-pooling"),
    pytest.param({"is_causal": True, "use_cell_residual": False, "use_rotary": False}, [13, 4], id="causal-ablations"),
    pytest.param({"window_size": 8, "min_window_size": 5}, [12, 13, 8, 20], id="window-8-min-5"),
    pytest.param({"window_size": 3, "min_window_size": 1}, [10, 2], id="window-3-no-merge"),
    pytest.param({"num_attention_heads": 3, "head_dim": 6}, [19], id="heads-3-dim-6"),
    pytest.param({"is_causal": True}, [17, 5, 12], id="causal"),
    pytest.param({"is_causal": True, "associative_memory": False}, [17, 5, 12], id="causal-no-associative-memory"),
    pytest.param(
        {"is_causal": True, "associative_decay": True, "associative_key_conv": 2, "window_overlap": 1},
        [17, 5, 12],
        id="causal-associative-decay-overlap",
    ),
    pytest.param({"is_causal": True, "window_overlap": 2, "num_hidden_layers": 3}, [18, 9], id="causal-overlap"),
    pytest.param(
        {"is_causal": True, "residual_stream": False, "cell_input_residual": True, "review_initial_cell": True},
        [17, 5],
        id="causal-post-norm",
    ),
    pytest.param({"is_causal": True, "memory_review": False}, [14, 6], id="causal-no-memory-review"),
    pytest.param({"residual_stream": True, "cell_input_residual": False}, [14, 6, 11], id="encoder-learnable-memory"),
    pytest.param({"residual_stream": True, "memory_review": False}, [13, 3], id="encoder-residual-no-review"),
    pytest.param({"is_causal": True, "review_qk_norm": False}, [17, 5], id="causal-dot-product-review"),
    pytest.param(
        {"is_causal": True, "review_initial_cell": False}, [17, 5, 9], id="causal-review-without-initial-cell"
    ),
    pytest.param(
        {"residual_stream": True, "cell_input_residual": False, "review_qk_norm": True},
        [14, 6, 11],
        id="encoder-all-learnable-memory",
    ),
    pytest.param({"is_causal": True, "review_log_scaling": True}, [17, 5, 12], id="causal-review-log-scaling"),
    pytest.param({"review_log_scaling": True}, [14, 6, 11], id="encoder-review-log-scaling"),
]


def assert_close(actual, expected, what):
    diff = (actual - expected).abs().max().item()
    assert diff <= TOLERANCE, f"{what}: max abs diff {diff:.2e} > {TOLERANCE}"


@pytest.mark.parametrize("overrides,lengths", CASES)
def test_fast_layer_matches_reference(overrides, lengths):
    config = tiny_config(**overrides)
    model = randomize_(RANModel(config), seed=len(lengths))
    sequences = [random_ids(n, config.vocab_size, seed=i) for i, n in enumerate(lengths)]
    ids, mask = pad_batch(sequences)

    with torch.no_grad():
        fast = model(ids, attention_mask=mask, output_hidden_states=True)
    for row, sequence in enumerate(sequences):
        with torch.no_grad():
            expected = reference_forward(model, sequence)
        real = real_positions(mask[row])
        assert_close(fast.last_hidden_state[row, real], expected["last_hidden_state"], "token states")
        for layer, (got, want) in enumerate(zip(fast.hidden_states, expected["hidden_states"])):
            assert_close(got[row, real], want, f"hidden states after layer {layer}")
        num_windows = len(expected["cells"])
        assert fast.cells_mask[row].sum().item() == num_windows
        assert_close(fast.cells[row, :num_windows], expected["cells"], "cells")
        assert_close(fast.last_cell[row], expected["last_cell"], "last cell")
        assert_close(fast.pooled_cell[row], expected["pooled_cell"], "pooled cell")
        assert_close(fast.pooler_output[row], expected["pooler_output"], "pooler output")


def gradient_of(parameter):
    """The gradient, zeros for a parameter the output does not depend on (e.g. unused initial cells)."""
    return parameter.grad.clone() if parameter.grad is not None else torch.zeros_like(parameter)


@pytest.mark.parametrize(
    "overrides,lengths",
    [
        pytest.param({}, [12, 7], id="bidirectional"),
        pytest.param({"window_overlap": 2, "cell_pooling": "max"}, [13], id="overlap-max"),
        pytest.param({"is_causal": True, "num_hidden_layers": 3}, [16, 4], id="causal"),
    ],
)
def test_fast_layer_gradients_match_reference(overrides, lengths):
    """Every parameter's gradient through the fast path equals the gradient through the reference."""
    config = tiny_config(**overrides)
    model = randomize_(RANModel(config), seed=7)
    sequences = [random_ids(n, config.vocab_size, seed=10 + i) for i, n in enumerate(lengths)]
    ids, mask = pad_batch(sequences, side="left")
    probe = torch.randn(ids.shape[0], ids.shape[1], config.hidden_size, generator=torch.Generator().manual_seed(3))

    def objective(token_states, pooled):
        return (token_states * probe[: token_states.shape[0], : token_states.shape[1]]).sum() + pooled.pow(2).sum()

    outputs = model(ids, attention_mask=mask)
    objective(outputs.last_hidden_state * mask[..., None], outputs.pooler_output).backward()
    fast_grads = {name: gradient_of(p) for name, p in model.named_parameters()}
    model.zero_grad()

    total = 0.0
    for row, sequence in enumerate(sequences):
        expected = reference_forward(model, sequence)
        real = real_positions(mask[row])
        total = total + (expected["last_hidden_state"] * probe[row, real]).sum()
        total = total + expected["pooler_output"].pow(2).sum()
    total.backward()
    for name, parameter in model.named_parameters():
        reference_grad = gradient_of(parameter)
        diff = (fast_grads[name] - reference_grad).abs().max().item()
        scale = max(1.0, reference_grad.abs().max().item())
        assert diff <= 1e-4 * scale, f"gradient of {name}: max abs diff {diff:.2e}"
