"""Padding is invisible: every output of a sequence in a padded batch equals its output alone, unpadded; rows of
padding only (and a batch of nothing else) keep every output, loss and gradient finite and change nothing else."""

import random

import pytest
import torch
from ran_testing import pad_batch, random_ids, randomize_, real_positions, tiny_config

from ran_hf import RANForMaskedLM, RANForSequenceClassification, RANForTokenClassification, RANModel


TOLERANCE = 1e-5


def random_case(seed):
    """A random config (layers, window, merge rule, overlap, pooling, causal, ablations) and a batch of mixed
    lengths."""
    rng = random.Random(seed)
    window = rng.choice([3, 4, 5, 7, 8])
    overrides = {
        "num_hidden_layers": rng.choice([1, 2, 3]),
        "window_size": window,
        "min_window_size": rng.randint(1, window - 1),
        "window_overlap": rng.choice([0, 0, rng.randint(1, window - 1)]),
        "cell_pooling": rng.choice(["last", "mean", "max"]),
        "memory_review": rng.random() < 0.8,
        "is_causal": rng.random() < 0.25,
        "token_pooling": rng.choice(["max", "mean"]),
        "use_cell_residual": rng.random() < 0.8,
        "use_rotary": rng.random() < 0.8,
    }
    lengths = [rng.randint(1, 4 * window + 2) for _ in range(rng.randint(1, 4))]
    return overrides, lengths


def assert_close(actual, expected, what):
    diff = (actual - expected).abs().max().item()
    assert diff <= TOLERANCE, f"{what}: max abs diff {diff:.2e}"


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("seed", range(12))
def test_encoder_outputs_ignore_padding(seed, side):
    overrides, lengths = random_case(seed)
    config = tiny_config(**overrides)
    model = randomize_(RANModel(config), seed=seed)
    sequences = [random_ids(n, config.vocab_size, seed=100 * seed + i) for i, n in enumerate(lengths)]
    ids, mask = pad_batch(sequences, side=side)
    extra = torch.randint(0, 7, ()).item()  # more padding than the longest sequence needs
    ids, mask = torch.nn.functional.pad(ids, (0, extra)), torch.nn.functional.pad(mask, (0, extra))
    if side == "left":
        ids, mask = ids.roll(extra, 1), mask.roll(extra, 1)

    with torch.no_grad():
        batched = model(ids, attention_mask=mask, output_hidden_states=True)
        for row, sequence in enumerate(sequences):
            alone = model(sequence[None], output_hidden_states=True)
            real = real_positions(mask[row])
            assert_close(batched.last_hidden_state[row, real], alone.last_hidden_state[0], "token states")
            for got, want in zip(batched.hidden_states, alone.hidden_states):
                assert_close(got[row, real], want[0], "hidden states")
            num_windows = alone.cells.shape[1]
            assert_close(batched.cells[row, :num_windows], alone.cells[0], "cells")
            assert not batched.cells_mask[row, num_windows:].any()
            for name in ("last_cell", "pooled_cell", "pooler_output"):
                assert_close(getattr(batched, name)[row], getattr(alone, name)[0], name)
            padding = ~mask[row].bool()
            assert (batched.last_hidden_state[row, padding] == 0).all(), "padding positions are not zero"


# task -> (head, config fields, the labels of one sequence)
TASKS = {
    "masked-lm": (RANForMaskedLM, {}, lambda s: s.clone()),
    "single-label": (RANForSequenceClassification, {"num_labels": 3}, lambda s: torch.tensor(len(s) % 3)),
    "multi-label": (
        RANForSequenceClassification,
        {"num_labels": 3, "problem_type": "multi_label_classification"},
        lambda s: torch.tensor([len(s) % 2, len(s) // 2 % 2, 1.0]),
    ),
    "regression": (RANForSequenceClassification, {"num_labels": 1}, lambda s: torch.tensor(len(s) / 10)),
    "token-classification": (RANForTokenClassification, {"num_labels": 3}, lambda s: s % 3),
}
SUMMED = ("masked-lm", "single-label", "token-classification")  # losses that `num_items_in_batch` turns into sums
VARIANTS = [
    pytest.param({}, id="default"),
    pytest.param({"is_causal": True}, id="causal"),
    pytest.param({"cell_pooling": "mean"}, id="mean-pooling"),
    pytest.param({"cell_pooling": "max", "window_overlap": 1}, id="max-pooling-overlap"),
    pytest.param({"memory_review": False}, id="no-memory-review"),
]
NOTHING = torch.zeros(0, dtype=torch.long)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("task", TASKS)
def test_head_outputs_losses_and_gradients_ignore_padding(task, variant, side):
    """Logits of every head equal the per-sequence ones, with rows of padding only in the batch; those keep logits,
    hidden states, loss and every gradient finite, and the loss is the one of the rows with tokens (summed losses:
    the sum of each sequence's alone)."""
    model_class, fields, make_labels = TASKS[task]
    config = tiny_config(**{"window_overlap": 1, **fields, **variant})
    if model_class is RANForMaskedLM and config.is_causal:  # refused; the causal LM's padding: test_causal_lm.py
        with pytest.raises(ValueError, match="RANForMaskedLM fills a mask"):
            model_class(config)
        return
    sequences = [random_ids(n, config.vocab_size, seed=50 + i) for i, n in enumerate([12, 4, 9])]
    rows = [sequences[0], NOTHING, sequences[1], sequences[2], NOTHING]  # all-padding rows between and last
    real_rows = torch.tensor([0, 2, 3])
    ids, mask = pad_batch(rows, side=side)
    if task in ("masked-lm", "token-classification"):  # the labels of padding positions are ignored, whatever they are
        labels, _ = pad_batch([make_labels(row) for row in rows], pad_id=1, side=side)
    else:
        labels = torch.stack([make_labels(row) for row in rows])
    model = randomize_(model_class(config), seed=3).train()  # no dropout: train mode is deterministic

    batched = model(ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    assert torch.isfinite(batched.logits).all(), "non-finite logits with all-padding rows"
    assert all(torch.isfinite(states).all() for states in batched.hidden_states)
    assert torch.isfinite(batched.loss)
    batched.loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            assert torch.isfinite(parameter.grad).all(), f"{name} has a non-finite gradient"

    with torch.no_grad():
        for row, sequence in zip(real_rows.tolist(), sequences):
            alone = model(sequence[None]).logits[0]
            got = batched.logits[row] if alone.dim() == 1 else batched.logits[row, real_positions(mask[row])]
            assert_close(got, alone, "logits")
        with_tokens = model(ids[real_rows], attention_mask=mask[real_rows], labels=labels[real_rows])
        assert_close(batched.loss, with_tokens.loss, "loss")
        if task in SUMMED:  # num_items_in_batch=1 turns the mean into a sum, which adds up across sequences
            summed = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=1).loss.item()
            expected = sum(
                model(sequence[None], labels=make_labels(sequence)[None], num_items_in_batch=1).loss.item()
                for sequence in sequences
            )
            assert abs(summed - expected) <= 1e-4 * max(1.0, abs(expected)), (summed, expected)


@pytest.mark.parametrize("cell_pooling", ["last", "mean", "max"])
def test_all_padding_rows_have_zero_token_states_and_no_cells(cell_pooling):
    """Every encoder output of a row of padding only is finite; its token states and cells are zero, its cells
    masked out."""
    model = randomize_(RANModel(tiny_config(cell_pooling=cell_pooling)), seed=1).eval()
    ids, mask = pad_batch([random_ids(13, 61, seed=0), NOTHING, random_ids(7, 61, seed=1), NOTHING], side="left")
    with torch.no_grad():
        output = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    for name, value in output.items():
        for tensor in value if isinstance(value, tuple) else (value,):
            if tensor.is_floating_point():
                assert torch.isfinite(tensor).all(), name
    for row in (1, 3):
        assert torch.all(output.last_hidden_state[row] == 0)
        assert not output.cells_mask[row].any() and torch.all(output.cells[row] == 0)


@pytest.mark.parametrize(
    "model_class", [RANModel, RANForMaskedLM, RANForSequenceClassification, RANForTokenClassification]
)
def test_a_batch_of_padding_only_gives_finite_outputs(model_class):
    """Even a batch with no real token at all runs and returns finite values."""
    model = model_class(tiny_config()).eval()
    input_ids = torch.zeros(2, 5, dtype=torch.long)
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=torch.zeros_like(input_ids))
    assert torch.isfinite(output.last_hidden_state if model_class is RANModel else output.logits).all()
