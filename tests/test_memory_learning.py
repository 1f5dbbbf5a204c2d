"""The causal RAN's memory learns: a key digit read in one window is recalled in the next
(scripts/benchmarks/diagnose_memory.py).

Trained from scratch on CPU, deterministic given the seed. The same budget leaves the official post-norm layer at
chance (benchmarks/memory_diagnosis.md), which is what made this test necessary.
"""

import argparse

import pytest
import torch

from diagnose_memory import MODELS, TASKS, build_model, make_batch, train_once


def run_arguments(**overrides) -> argparse.Namespace:
    arguments = {
        "learning_rate": 2e-3, "batch_size": 16, "in_window_steps": 300, "across_steps": 1000, "eval_every": 50,
        "threads": 1, "jobs": 1,
    }  # fmt: skip
    arguments.update(overrides)
    return argparse.Namespace(**arguments)


def test_task_places_key_where_it_says():
    for task, (length, (low, high)) in TASKS.items():
        ids, answers = make_batch(torch.Generator().manual_seed(0), 32, length, (low, high))
        key_positions = (ids == 1).nonzero()[:, 1]
        assert ((key_positions >= low) & (key_positions < high)).all(), task
        assert torch.equal(ids[torch.arange(32), key_positions + 1], answers)
        assert (ids[:, -1] == 2).all()
        # The question's window holds the key only in the in-window task.
        same_window = key_positions // 64 == (length - 1) // 64
        assert same_window.all() if task == "in-window" else not same_window.any()


def test_every_design_builds_from_its_fields():
    for name, fields in MODELS.items():
        model = build_model(name, 128)
        if fields is not None:
            for field, value in fields.items():
                assert getattr(model.config, field) == value


# Across one window, 3 of 4 seeds reach 99% (at steps 200-400); seed 0 merges two digits and stays at 80% after 2,000
# steps (docs/memory.md, cause 6). The test is a regression check that the memory path can learn, not a claim that
# every seed does: it trains seed 1, which reaches 99% at step 200.
@pytest.mark.parametrize("task,seed", [("in-window", 0), ("across-1", 1)])
def test_causal_ran_learns_to_retrieve_a_key(task, seed):
    result = train_once(task, "ran", seed=seed, args=run_arguments())
    assert result.accuracy >= 0.95, result.history
