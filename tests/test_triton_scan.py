"""The Triton cell scan (`scan_implementation="triton"`) equals the reference scan: outputs and every gradient within
1e-4, in every mode, batched with different window counts, continuing cached sequences, with dropout (the same masks
as the reference for a seed), and inside whole models. On a CPU the kernels run in Triton's interpreter
(`TRITON_INTERPRET=1`, set by conftest.py), on CUDA compiled; where Triton is not installed these tests skip."""

import pytest
import torch
from ran_testing import pad_batch, random_ids, randomize_, tiny_config
from test_fused_scan import BATCHES, DROPOUT, MODES, assert_scans_agree, layer_and_inputs

from ran_hf import RANForCausalLM, RANModel
from ran_hf.kernels import choice
from ran_hf.kernels.cell_scan import triton_cell_scan
from ran_hf.kernels.choice import TRITON_AVAILABLE, triton_scan_unsupported


pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-4
# In Triton's interpreter a batch of four sequences costs about 10 s a case: the default run keeps the other batches
# (one of them of three sequences with different window counts), --run-slow adds it.
SCAN_BATCHES = [
    pytest.param(*batch.values, id=batch.id, marks=[*batch.marks, *[pytest.mark.slow] * (batch.id == "batch-of-4")])
    for batch in BATCHES
]


@pytest.mark.parametrize("lengths,past_lengths", SCAN_BATCHES)
@pytest.mark.parametrize("overrides", MODES)
def test_triton_scan_equals_the_reference(overrides, lengths, past_lengths):
    layer, inputs, layout = layer_and_inputs(overrides, lengths, past_lengths, device=DEVICE)
    assert triton_scan_unsupported(inputs[0]) is None
    assert_scans_agree(layer, inputs, layout, TOLERANCE, scan=triton_cell_scan)


@pytest.mark.parametrize("lengths,past_lengths", SCAN_BATCHES[1:])
@pytest.mark.parametrize("overrides", MODES)
def test_triton_scan_equals_the_reference_with_dropout(overrides, lengths, past_lengths):
    layer, inputs, layout = layer_and_inputs(overrides, lengths, past_lengths, device=DEVICE, **DROPOUT)
    layer.train()
    assert_scans_agree(layer, inputs, layout, TOLERANCE, scan=triton_cell_scan)


@pytest.mark.slow  # 30 s in the interpreter
def test_triton_scan_with_wide_windows_heads_and_a_batch_over_one_block():
    """More slots than one slot block, a head size that is not a power of two, 40 rows (two row blocks)."""
    lengths = [70 - row for row in range(40)]
    fields = {"window_size": 40, "min_window_size": 8, "hidden_size": 24, "num_attention_heads": 3, "head_dim": 12}
    layer, inputs, layout = layer_and_inputs({"is_causal": True}, lengths, None, device=DEVICE, **fields)
    assert_scans_agree(layer, inputs, layout, TOLERANCE, scan=triton_cell_scan)


@pytest.mark.parametrize("overrides", [pytest.param({}, id="encoder"), pytest.param({"is_causal": True}, id="causal")])
def test_the_attention_split_over_programs_by_rows_changes_nothing(overrides, monkeypatch):
    """Compiled, each head's window attention is split over programs by rows of the batch (`ROW_SPLITS`); the
    interpreter's tests run unsplit for speed (conftest.py), so the split is checked here, with dropout."""
    monkeypatch.setattr("ran_hf.kernels.triton_ops.scan_tiles.ROW_SPLITS", 3)
    layer, inputs, layout = layer_and_inputs(overrides, *BATCHES[3].values, device=DEVICE, **DROPOUT)
    layer.train()
    assert_scans_agree(layer, inputs, layout, TOLERANCE, scan=triton_cell_scan)


@pytest.mark.parametrize("overrides", [pytest.param({}, id="encoder"), pytest.param({"is_causal": True}, id="causal")])
def test_models_with_the_triton_scan_equal_the_reference(overrides):
    model_class = RANForCausalLM if overrides else RANModel
    reference = randomize_(model_class(tiny_config(**overrides)), seed=1).to(DEVICE)
    fast = randomize_(model_class(tiny_config(scan_implementation="triton", **overrides)), seed=1).to(DEVICE)
    ids, mask = (tensor.to(DEVICE) for tensor in pad_batch([random_ids(n, 61, seed=n) for n in (17, 9, 12)]))

    def run(model):
        outputs = model(ids, attention_mask=mask, **({"labels": ids} if overrides else {}))
        loss = outputs.loss if overrides else (outputs.last_hidden_state * mask[..., None]).pow(2).sum()
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    loss, grads = run(reference)
    fast_loss, fast_grads = run(fast)
    assert torch.allclose(fast_loss, loss, atol=TOLERANCE)
    assert grads.keys() == fast_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(fast_grads[name], grad, atol=TOLERANCE * max(1.0, grad.abs().max().item())), name


def test_a_kernel_that_cannot_be_built_sends_the_scan_to_the_fused_one(monkeypatch):
    """A GPU the kernels cannot be built for (too little shared memory, say) gets the fused scan, and is told why."""
    import triton

    def out_of_resources(*args, **kwargs):
        raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")

    def as_the_layer_runs_it(cell_scan, weights, *inputs):  # the implementation `choice.choose` picks
        return cell_scan(weights, *inputs)

    monkeypatch.setattr(choice, "BUILD_FAILURES", [])
    monkeypatch.setattr("ran_hf.kernels.triton_ops.scan.TRITON_KERNELS", (out_of_resources, out_of_resources))
    layer, inputs, layout = layer_and_inputs({}, [23, 7], None, device=DEVICE, scan_implementation="triton")
    assert_scans_agree(layer, inputs, layout, TOLERANCE, scan=as_the_layer_runs_it)
    assert choice.BUILD_FAILURES and "OutOfResources" in choice.BUILD_FAILURES[0]
    assert "could not be built" in triton_scan_unsupported(inputs[0])
