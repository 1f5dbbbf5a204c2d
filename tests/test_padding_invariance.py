"""Padding is invisible: every output of a sequence in a padded batch equals its output alone, unpadded."""

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


@pytest.mark.parametrize("side", ["right", "left"])
def test_head_outputs_and_losses_ignore_padding(side):
    """Logits and summed losses of every head equal the per-sequence ones, all-padding rows included."""
    config = tiny_config(num_labels=3, window_overlap=1)
    lengths = [12, 4, 9]
    sequences = [random_ids(n, config.vocab_size, seed=50 + i) for i, n in enumerate(lengths)]
    ids, mask = pad_batch(sequences + [torch.zeros(0, dtype=torch.long)], side=side)  # last row: only padding

    heads = {
        "mlm": (RANForMaskedLM, lambda s: s.clone()),
        "sequence": (RANForSequenceClassification, lambda s: torch.tensor(len(s) % 3)),
        "token": (RANForTokenClassification, lambda s: s % 3),
    }
    for name, (model_class, make_labels) in heads.items():
        model = randomize_(model_class(config), seed=3)
        labels = [make_labels(s) for s in sequences]
        if name == "sequence":
            batch_labels = torch.stack(labels + [torch.tensor(1)])
        else:
            batch_labels, _ = pad_batch(labels + [torch.zeros(0, dtype=torch.long)], pad_id=1, side=side)
        with torch.no_grad():
            # num_items_in_batch=1 turns the mean into a sum, which adds up across sequences.
            batched = model(ids, attention_mask=mask, labels=batch_labels, num_items_in_batch=1)
            assert torch.isfinite(batched.logits).all(), f"{name}: non-finite logits with an all-padding row"
            expected_loss = 0.0
            for row, (sequence, label) in enumerate(zip(sequences, labels)):
                alone = model(sequence[None], labels=label[None], num_items_in_batch=1)
                real = real_positions(mask[row])
                got = batched.logits[row] if name == "sequence" else batched.logits[row, real]
                assert_close(got, alone.logits[0], f"{name} logits")
                expected_loss += alone.loss.item()
        assert abs(batched.loss.item() - expected_loss) <= 1e-4 * max(1.0, abs(expected_loss)), name
