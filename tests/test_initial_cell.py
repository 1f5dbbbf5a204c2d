"""A starting cell as input (`initial_cell`, `rannet`'s `with_cell=True`): parity with rannet, padding invariance,
every head, the causal model with its cache and `generate()`, save/load and remote code, and errors on bad cells.

The references were computed by rannet 0.3.1 (`scripts/rannet_tf/make_rannet_cell_and_adaptive_fixtures.py`) on the
checkpoints of the encoder fixtures; no TensorFlow is needed here.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from ran_testing import pad_batch, random_ids, randomize_, real_positions, tiny_config
from remote_code import run_without_ran_hf
from transformers import AutoModelForMaskedLM

from ran_hf import (
    RANForCausalLM,
    RANForMaskedLM,
    RANForPrefixLM,
    RANForQuestionAnswering,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
    convert_rannet_checkpoint,
)


FIXTURES = Path(__file__).parent / "fixtures" / "rannet"
TOLERANCE = 1e-4
ENCODERS = ["l1_d32_w4_last", "l2_d24_w6_mean", "l3_d16_w8_max"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return {name: convert_rannet_checkpoint(FIXTURES / name, root / name) for name in ENCODERS}


@pytest.mark.parametrize("name", ENCODERS)
def test_matches_rannet_with_cell(name, converted):
    model = RANForMaskedLM.from_pretrained(converted[name]).eval()
    expected = np.load(FIXTURES / "with_cell" / f"{name}.npz")
    offsets = expected["offsets"]
    for case in range(len(expected["lengths"])):
        tokens = slice(offsets[case], offsets[case + 1])
        input_ids = torch.from_numpy(expected["input_ids"][tokens]).long()[None]
        cell = torch.from_numpy(expected["initial_cells"][case])[None]
        with torch.no_grad():
            base = model.model(input_ids, initial_cell=cell)
            logits = model(input_ids, initial_cell=cell).logits
            without = model.model(input_ids)
        checks = {
            "token_states": (base.last_hidden_state[0], expected["token_states"][tokens]),
            "mlm_logits": (logits[0], expected["mlm_logits"][tokens]),
            "last_cell": (base.last_cell[0], expected["last_cell"][case]),
            "pooled_cell": (base.pooled_cell[0], expected["pooled_cell"][case]),
            "last_cell without a starting cell": (without.last_cell[0], expected["no_cell_last_cell"][case]),
        }
        for what, (actual, reference) in checks.items():
            diff = (actual - torch.from_numpy(reference)).abs().max().item()
            assert diff <= TOLERANCE, f"{name} case {case} {what}: max abs diff {diff:.2e}"
    # The starting cell is no no-op: with and without it, rannet's last cells differ clearly.
    assert np.abs(expected["last_cell"] - expected["no_cell_last_cell"]).max() > 0.1


@pytest.mark.parametrize("overrides", [{}, {"is_causal": True}], ids=["encoder", "causal"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_invariant(overrides, side):
    config = tiny_config(**overrides)
    model = randomize_(RANModel(config))
    sequences = [random_ids(n, config.vocab_size, seed) for seed, n in enumerate((13, 4, 9))]
    cells = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(5))
    input_ids, attention_mask = pad_batch(sequences, side=side)
    with torch.no_grad():
        batch = model(input_ids, attention_mask=attention_mask, initial_cell=cells)
        for row, sequence in enumerate(sequences):
            alone = model(sequence[None], initial_cell=cells[row : row + 1])
            positions = real_positions(attention_mask[row])
            torch.testing.assert_close(batch.last_hidden_state[row, positions], alone.last_hidden_state[0])
            torch.testing.assert_close(batch.last_cell[row], alone.last_cell[0])
            torch.testing.assert_close(batch.pooled_cell[row], alone.pooled_cell[0])


HEADS = [
    pytest.param(RANForMaskedLM, {}, "logits", id="masked-lm"),
    pytest.param(RANForSequenceClassification, {"num_labels": 3}, "logits", id="sequence-classification"),
    pytest.param(RANForTokenClassification, {"num_labels": 4}, "logits", id="token-classification"),
    pytest.param(RANForQuestionAnswering, {}, "start_logits", id="question-answering"),
    pytest.param(RANForCausalLM, {"is_causal": True}, "logits", id="causal-lm"),
    pytest.param(RANForPrefixLM, {}, "logits", id="prefix-lm"),
]


@pytest.mark.parametrize("head,overrides,output", HEADS)
def test_every_head_reads_the_cell_in_its_first_layer(head, overrides, output):
    config = tiny_config(**overrides)
    model = randomize_(head(config))
    input_ids = random_ids(12, config.vocab_size, 0)[None]
    cell = torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with_cell = model(input_ids, initial_cell=cell)[output]
        without = model(input_ids)[output]
        # The head's output is that of its base model started from the same cell.
        states = model.model(input_ids, initial_cell=cell).last_hidden_state
        states_without = model.model(input_ids).last_hidden_state
    assert (with_cell - without).abs().max() > 1e-3
    assert (states - states_without).abs().max() > 1e-3
    # The learned starting cell given explicitly is the same as none.
    learned = model.model.layers[0].initial_cell.detach()[None]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids, initial_cell=learned)[output], without)


def test_causal_cell_stays_causal_and_continues_through_the_cache():
    config = tiny_config(is_causal=True, num_hidden_layers=3)
    model = randomize_(RANForCausalLM(config))
    input_ids = random_ids(17, config.vocab_size, 3)[None]
    cell = torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(input_ids, initial_cell=cell).logits
        changed = input_ids.clone()
        changed[0, 11:] = (changed[0, 11:] % (config.vocab_size - 1)) + 1
        assert torch.equal(model(changed, initial_cell=cell).logits[:, :11], full[:, :11])  # no future leaks in
        prefix = model(input_ids[:, :8], initial_cell=cell, use_cache=True)
        rest = model(input_ids[:, 8:], past_key_values=prefix.past_key_values)
        torch.testing.assert_close(torch.cat([prefix.logits, rest.logits], dim=1), full, rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="`initial_cell` starts a text.*first call only"):
            model(input_ids[:, 8:], past_key_values=prefix.past_key_values, initial_cell=cell)


def test_generate_reads_the_cell_once():
    config = tiny_config(is_causal=True, eos_token_id=None, pad_token_id=0)
    model = randomize_(RANForCausalLM(config), scale=1.0)
    prompt = random_ids(6, config.vocab_size, 4)[None]
    cell = torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(3)) * 3
    generated = model.generate(prompt, initial_cell=cell, max_new_tokens=8, do_sample=False)
    # Greedy decoding by hand, every step a full pass from the same starting cell.
    expected = prompt
    with torch.no_grad():
        for _ in range(8):
            next_token = model(expected, initial_cell=cell).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
    assert torch.equal(generated, expected)
    assert not torch.equal(generated, model.generate(prompt, max_new_tokens=8, do_sample=False))


BAD_CELLS = [
    pytest.param(
        lambda d: torch.zeros(3, d), r"`initial_cell` must have shape \(batch_size, hidden_size\) = \(2, ", id="batch"
    ),
    pytest.param(lambda d: torch.zeros(2, d + 1), r"`initial_cell` must have shape", id="width"),
    pytest.param(lambda d: torch.zeros(d), r"`initial_cell` must have shape", id="one-dimensional"),
    pytest.param(
        lambda d: torch.zeros(2, d, dtype=torch.long), "`initial_cell` must hold floating-point", id="integer"
    ),
    pytest.param(lambda d: torch.full((2, d), float("nan")), "`initial_cell` holds NaN", id="nan"),
    pytest.param(lambda d: [[0.0] * d] * 2, "`initial_cell` must be a tensor", id="list"),
]


@pytest.mark.parametrize("make_cell,message", BAD_CELLS)
def test_bad_cells_are_named_before_any_work(make_cell, message, monkeypatch):
    model = RANForSequenceClassification(tiny_config(num_labels=2))
    embedded = []
    monkeypatch.setattr(model.model.embeddings, "forward", lambda *args, **kwargs: embedded.append(1))
    with pytest.raises(ValueError, match=message):
        model(torch.randint(1, 61, (2, 9)), initial_cell=make_cell(model.config.hidden_size))
    assert not embedded


def test_save_load_and_remote_code(tmp_path):
    # The plain PyTorch scan, which the folder runs where `ran_hf` (and its fused scan) is not installed.
    model = randomize_(RANForMaskedLM(tiny_config(scan_implementation="reference")))
    model.save_pretrained(tmp_path / "mlm")
    input_ids, attention_mask = pad_batch([random_ids(13, 61, 0), random_ids(7, 61, 1)])
    cells = torch.randn(2, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask, initial_cell=cells).logits
        reloaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "mlm").eval()
        actual = reloaded(input_ids, attention_mask=attention_mask, initial_cell=cells).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    torch.save(
        {"input_ids": input_ids, "attention_mask": attention_mask, "cells": cells, "logits": expected},
        tmp_path / "expected.pt",
    )
    report = run_without_ran_hf(
        r"""
import torch
from transformers import AutoModelForMaskedLM
expected = torch.load(sys.argv[2])
model = AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(
        input_ids=expected["input_ids"], attention_mask=expected["attention_mask"], initial_cell=expected["cells"]
    ).logits
report["class"] = type(model).__module__ + "." + type(model).__name__
report["difference"] = (logits - expected["logits"]).abs().max().item()
""",
        [tmp_path / "mlm", tmp_path / "expected.pt"],
        tmp_path,
    )
    assert report["class"].startswith("transformers_modules.")
    assert report["difference"] <= 1e-6
