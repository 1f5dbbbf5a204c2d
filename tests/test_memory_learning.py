"""The causal RAN's memory learns: a key digit read in one window is recalled in the next, eight windows later, and
from any of those eight windows (scripts/benchmarks/diagnose_memory.py).

Trained from scratch on CPU, deterministic given the seed. The same budget leaves the official post-norm layer at
chance (benchmarks/memory_diagnosis/memory_diagnosis.md), which is what made this test necessary.
"""

import argparse

import diagnose_memory
import pytest
import torch
from diagnose_memory import MODELS, TASKS, build_model, make_batch, probe_memory, train_once

from ran_hf import cell_scan


pytestmark = pytest.mark.slow  # training runs of hundreds of steps


def run_arguments(**overrides) -> argparse.Namespace:
    arguments = {
        "learning_rate": 2e-3, "batch_size": 16, "in_window_steps": 500, "across_steps": 1000, "eval_every": 50,
        "threads": 1, "jobs": 1, "probe": False,
        "warmup_steps": 300,
    }  # fmt: skip
    arguments.update(overrides)
    return argparse.Namespace(**arguments)


def test_task_places_key_where_it_says():
    for task, (length, (low, high)) in TASKS.items():
        ids, answers = make_batch(torch.Generator().manual_seed(0), 32, length, (low, high))
        key_positions = (ids == 1).nonzero()[:, 1]
        assert ((key_positions >= low) & (key_positions < high)).all(), task
        assert torch.equal(ids[torch.arange(32), key_positions + 1], answers[:, 0])
        assert (ids[:, -1] == 2).all()
        # The question's window holds the key only in the in-window task.
        same_window = key_positions // 64 == (length - 1) // 64
        assert same_window.all() if task == "in-window" else not same_window.any()


def test_a_key_of_several_digits_is_asked_for_in_order():
    length, key_range = TASKS["across-any"]
    ids, answers = make_batch(torch.Generator().manual_seed(0), 32, length, key_range, key_digits=3)
    key_positions = (ids == 1).nonzero()[:, 1]
    rows = torch.arange(32)[:, None]
    assert torch.equal(ids[rows, key_positions[:, None] + 1 + torch.arange(3)], answers)
    assert (ids[:, -3] == 2).all() and torch.equal(ids[:, -2:], answers[:, :2])  # QUESTION d1 d2, then d3 is asked
    assert (key_positions + 3 < key_range[1]).all(), "the key's last digit left the windows before the question's"


def test_every_design_builds_from_its_fields():
    for name, fields in MODELS.items():
        model = build_model(name, 128)
        if fields is not None:
            for field, value in fields.items():
                assert getattr(model.config, field) == value


# With a 300-step warmup, every seed measured reaches 99% in, across one and across eight windows, by step 200-400
# (docs/memory.md, cause 7); at the full rate from step 1, across eight windows was a lottery. A key in any of the
# eight windows needs the cell's soft maximum (cause 8). One seed, the same for every task, keeps CI short; across eight
# windows is the one that fails without the warmup (seed 0: 51% after 2,000 steps).
@pytest.mark.parametrize("task", TASKS)
def test_causal_ran_learns_to_retrieve_a_key(task):
    result = train_once(task, "ran", seed=0, args=run_arguments())
    assert result.accuracy >= 0.95, result.history


def test_probe_recomputes_the_first_cell_write_of_the_scan(monkeypatch):
    """The probe's write shares are the scan's own first-step attention, read back through its dropout hook."""
    torch.manual_seed(0)
    model = build_model("ran", 128)
    model.config.scan_implementation = "reference"  # the scan whose steps call `cell_scan.drop`, recorded here
    with torch.no_grad():
        for parameter in model.parameters():  # away from the near-uniform attention of initialisation
            parameter.add_(0.2 * torch.randn_like(parameter))
    write_probabilities = []

    def record(states, mask):
        if states.dim() == 3:  # (B, H, 1 + S): the cell's attention at one scan step
            write_probabilities.append(states.detach())
        return states if mask is None else states * mask

    monkeypatch.setattr(cell_scan, "drop", record)
    length, key_range = TASKS["across-1"]
    probe = probe_memory(model, length, key_range, examples=64)
    ids, answers = make_batch(torch.Generator().manual_seed(10_000), 64, length, key_range)
    digit_slot = 1 + (ids == diagnose_memory.KEY).long().argmax(1) + 1  # the cell is slot 0
    steps = len(write_probabilities) // model.config.num_hidden_layers
    for index in range(model.config.num_hidden_layers):
        on_digit = write_probabilities[index * steps][torch.arange(64), :, digit_slot].amax(-1)
        expected = [round(on_digit[answers[:, 0] - 3 == digit].mean().item(), 3) for digit in range(10)]
        assert probe[f"layer {index}"]["write_on_digit"] == pytest.approx(expected, abs=2e-3)
        # Two different cells of one softmax over the cells: together at most all of it (to the 3 decimals kept).
        on_initial, on_key = (
            probe[f"layer {index}"][name] for name in ("review_on_initial_cell", "review_on_key_cell")
        )
        assert all(initial + key <= 1.002 for initial, key in zip(on_initial, on_key)), (on_initial, on_key)
        assert any(weight > 0 for weight in on_initial) == model.config.review_initial_cell
