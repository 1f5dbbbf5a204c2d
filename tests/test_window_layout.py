"""The window layout: the worked example of `RANWindowLayout`'s docstring, and a continuation from a cache."""

import torch

from ran_hf import RANConfig
from ran_hf.window_layout import RANWindowLayout


def layout_of(lengths, padded_length, past_lengths=None, **config_fields):
    config = RANConfig(hidden_size=8, num_attention_heads=1, window_size=4, min_window_size=2, **config_fields)
    mask = torch.arange(padded_length)[None, :] < torch.tensor(lengths)[:, None]
    past = None if past_lengths is None else torch.tensor(past_lengths)
    return RANWindowLayout.from_attention_mask(mask.long(), config, past)


def test_docstring_example():
    layout = layout_of([5, 11], padded_length=11)
    assert layout.num_windows.tolist() == [1, 3]
    assert layout.window_sequence.tolist() == [0, 1, 1, 1]
    assert layout.window_number.tolist() == [0, 0, 1, 2]
    assert layout.window_slots.tolist() == [
        [0, 1, 2, 3, 4],
        [5, 6, 7, 8, 16],
        [9, 10, 11, 12, 16],
        [13, 14, 15, 16, 16],
    ]
    assert layout.slot_mask.int().tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert layout.query_index.tolist() == layout.window_slots.tolist()
    assert layout.query_slots.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 3, 0], [0, 1, 2, 0, 0]]
    assert layout.output_slot.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 15, 16, 17]
    assert layout.step_windows.tolist() == [[0, 1], [4, 2], [4, 3]]
    assert layout.token_window.tolist() == [[0] * 11, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]


def test_left_padding_moves_tokens_not_windows():
    right = layout_of([5, 11], padded_length=11)
    mask = torch.zeros(2, 11, dtype=torch.long)
    mask[0, 6:], mask[1] = 1, 1
    config = RANConfig(hidden_size=8, num_attention_heads=1, window_size=4, min_window_size=2)
    left = RANWindowLayout.from_attention_mask(mask, config)
    for name in ("window_slots", "slot_mask", "query_index", "output_slot", "step_windows"):
        assert torch.equal(getattr(left, name), getattr(right, name)), name
    assert left.token_index[:5].tolist() == [6, 7, 8, 9, 10]


def test_causal_continuation_reads_the_cached_tail():
    # Sequence 0 has 6 cached tokens (one finished window, two tokens of the next) and gets 3 new ones; sequence 1
    # has 4 cached (one finished window) and gets 1. With one token of overlap, the tails are 3 and 1 tokens long.
    layout = layout_of([3, 1], padded_length=3, past_lengths=[6, 4], is_causal=True, window_overlap=1)
    # New tokens 0-3, cached tail 4-6 (sequence 0: positions 3, 4, 5) and 7 (sequence 1: position 3), empty 8.
    assert layout.first_window.tolist() == [1, 1]
    assert layout.num_windows.tolist() == [2, 1]
    # Packed step-major: both sequences' first windows here (0 and 1), then sequence 0's second (2).
    assert layout.window_sequence.tolist() == [0, 1, 0] and layout.window_number.tolist() == [0, 0, 1]
    assert layout.step_windows.tolist() == [[0, 1], [2, 3]]
    assert layout.window_slots.tolist() == [[4, 5, 6, 0, 1], [7, 3, 8, 8, 8], [1, 2, 8, 8, 8]]
    # Q is bounded by the longest new input (3 tokens), not searched for: unused query slots point at the empty row.
    assert layout.query_slots.tolist() == [[3, 4, 0], [1, 0, 0], [1, 0, 0]]
    assert layout.query_index.tolist() == [[0, 1, 4], [3, 4, 4], [2, 4, 4]]
    assert layout.output_slot.tolist() == [0, 1, 6, 3]  # token t's query k * Q + q
    assert layout.token_window.tolist() == [[1, 1, 2], [1, 0, 0]]
    assert layout.cached_tail.tolist() == [0, 1, 2, 3]  # of the (2 x 3) cached tails: all of row 0, one of row 1
    # Next pass: sequence 0 (9 tokens) keeps position 7 (overlap) and 8; sequence 1 (5 tokens) positions 3 and 4.
    assert layout.next_tail.tolist() == [[1, 2], [7, 3]]


def test_sequences_with_as_many_windows_pack_as_the_scan_reads_them():
    """Equal numbers of windows: window k is scan step k // B of sequence k % B, so the scan's step-major view of the
    windows is a reshape (`full_grid`), and per-step states map back to windows without a gather."""
    layout = layout_of([10, 11, 12], padded_length=12)  # three windows each (window 4, minimum 2)
    assert layout.full_grid and layout.num_steps == 3
    assert layout.window_sequence.tolist() == [0, 1, 2] * 3
    assert layout.window_number.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert layout.step_windows.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    steps = torch.arange(9.0).view(3, 3, 1)
    assert torch.equal(layout.per_sequence(steps), steps.flatten(0, 1))
    assert not layout_of([5, 11], padded_length=11).full_grid


def test_a_window_holds_no_more_slots_than_the_pass_gives_it():
    """A huge `window_size` on a short input makes as many slots as the input has tokens, not `window_size`: memory
    follows the input."""
    config = RANConfig(hidden_size=8, num_attention_heads=1, window_size=10**6, min_window_size=2)
    layout = RANWindowLayout.from_attention_mask(torch.ones(2, 10, dtype=torch.long), config)
    assert layout.num_slots == 10 and layout.query_slots.shape == (2, 10)
    # Continuing a cache: the slots hold the cached tail and the new tokens.
    causal = RANConfig(hidden_size=8, num_attention_heads=1, window_size=10**6, min_window_size=2, is_causal=True)
    continued = RANWindowLayout.from_attention_mask(torch.ones(2, 1, dtype=torch.long), causal, torch.tensor([7, 9]))
    assert continued.num_slots == 10
