"""The fused cell scan (`scan_implementation="fused"`) equals the reference scan: outputs and every gradient, in
both modes, both ways of writing the raw cell, with and without the cell residual, batched with different window
counts, continuing cached sequences, and with dropout (both scans draw the same masks for the same seed); where it
cannot run it falls back to the reference and warns once."""

import logging

import pytest
import torch
from ran_testing import pad_batch, random_ids, randomize_, tiny_config
from transformers.utils import logging as transformers_logging

from ran_hf import RANCache, RANForCausalLM, RANModel, building_blocks
from ran_hf.cell_scan import reference_cell_scan
from ran_hf.kernels.cell_scan import fused_cell_scan
from ran_hf.kernels.choice import fused_scan_unsupported
from ran_hf.ran_layer import RANLayer
from ran_hf.window_layout import RANWindowLayout


TOLERANCE = 1e-5

MODES = [
    pytest.param({}, id="encoder"),  # the raw cell is finish_attention(...): the cell's input residual
    pytest.param({"residual_stream": True, "cell_input_residual": False}, id="encoder-without-cell-input-residual"),
    pytest.param({"use_cell_residual": False}, id="encoder-without-cell-residual"),
    pytest.param({"is_causal": True}, id="causal"),
    pytest.param({"is_causal": True, "residual_stream": False, "cell_input_residual": True}, id="causal-post-norm"),
    pytest.param({"is_causal": True, "use_cell_residual": False}, id="causal-without-cell-residual"),
]
# (lengths, cached lengths or None): one sequence, a batch whose sequences have different window counts, and
# continuations of cached sequences (all rows, and some rows only: the first step's residual is per row).
BATCHES = [
    pytest.param([23], None, id="one-sequence"),
    pytest.param([23, 7, 16, 3], None, id="batch-of-4"),
    pytest.param([12, 9], [10, 6], id="continued"),
    pytest.param([12, 9, 4], [7, 0, 3], id="partly-continued"),
]


def layer_and_inputs(overrides, lengths, past_lengths, dtype=torch.float32, seed=0, device="cpu", **config_fields):
    """A layer with random weights and what its scan reads (random window keys and values, a random start), on
    `device`."""
    config = tiny_config(**{**overrides, **config_fields})
    if past_lengths is not None:
        config.is_causal = True  # only a causal model continues a cache
    layer = randomize_(RANLayer(config, layer_idx=0), seed=seed).to(device, dtype)
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
    past = None if past_lengths is None else torch.tensor(past_lengths, device=device)
    layout = RANWindowLayout.from_attention_mask(mask, config, past_lengths=past)
    generator = torch.Generator().manual_seed(seed + 1)
    num_windows, num_slots = layout.window_slots.shape
    slots = (num_windows, config.num_attention_heads, num_slots, config.head_dim)
    keys, values = (torch.randn(slots, generator=generator, dtype=dtype) for _ in range(2))
    starts = (len(lengths), config.hidden_size)
    cell, previous_raw = (torch.randn(starts, generator=generator, dtype=dtype) for _ in range(2))
    inputs = [tensor.to(device).requires_grad_() for tensor in (cell, previous_raw, keys, values)]
    return layer, inputs, layout


def run_scan(scan, layer, *inputs):
    """`scan` (an implementation in `ALL_SCAN_FUNCTIONS`) on `layer`'s scan and weights."""
    return scan(layer.cell_scan, layer.cell_scan_weights(), *inputs)


def unsupported(layer):
    """Why the fused scan cannot run `layer`, or None."""
    return fused_scan_unsupported(layer.config.hidden_act, layer.cell_scan.modules_read(layer.cell_scan_weights()))


def outputs_and_gradients(scan, layer, inputs, layout):
    """The scan's four outputs and the gradients of a fixed random probe of all of them."""
    layer.zero_grad(set_to_none=True)
    for tensor in inputs:
        tensor.grad = None
    torch.manual_seed(11)  # the same dropout masks for both scans
    outputs = run_scan(scan, layer, *inputs, layout)
    generator = torch.Generator().manual_seed(9)
    probes = [torch.randn(output.shape, generator=generator, dtype=output.dtype) for output in outputs]
    probes = [probe.to(output.device) for probe, output in zip(probes, outputs)]
    sum((output * probe).sum() for output, probe in zip(outputs, probes)).backward()
    named = dict(zip(["cell", "previous_raw", "keys", "values"], inputs), **dict(layer.named_parameters()))
    gradients = {name: tensor.grad for name, tensor in named.items()}
    return [output.detach() for output in outputs], gradients


def assert_scans_agree(layer, inputs, layout, tolerance, scan=fused_cell_scan):
    expected, expected_grads = outputs_and_gradients(reference_cell_scan, layer, inputs, layout)
    actual, actual_grads = outputs_and_gradients(scan, layer, inputs, layout)
    for name, got, want in zip(["read keys", "read values", "raw cells", "cells"], actual, expected):
        assert got.shape == want.shape, name
        diff = (got - want).abs().max().item()
        assert diff <= tolerance, f"{name}: max abs diff {diff:.2e}"
    for name, want in expected_grads.items():
        got = actual_grads[name]
        if want is None:  # not used by the scan (e.g. the cell GLU of a single step): no gradient either way
            assert got is None or not got.any(), f"gradient of {name}: the reference has none"
            continue
        assert got is not None, f"gradient of {name} missing"
        # The gradients are sums over steps: compared relative to their size (the float32 reference itself is this
        # far from float64).
        diff = (got - want).abs().max().item()
        assert diff <= tolerance * max(1.0, want.abs().max().item()), f"gradient of {name}: max abs diff {diff:.2e}"


@pytest.mark.parametrize("lengths,past_lengths", BATCHES)
@pytest.mark.parametrize("overrides", MODES)
def test_fused_scan_equals_the_reference(overrides, lengths, past_lengths):
    layer, inputs, layout = layer_and_inputs(overrides, lengths, past_lengths)
    assert unsupported(layer) is None
    assert_scans_agree(layer, inputs, layout, TOLERANCE)


DROPOUT = {"hidden_dropout_prob": 0.3, "attention_probs_dropout_prob": 0.2}


@pytest.mark.parametrize("lengths,past_lengths", BATCHES[1:])
@pytest.mark.parametrize("overrides", MODES)
def test_fused_scan_equals_the_reference_with_dropout(overrides, lengths, past_lengths):
    layer, inputs, layout = layer_and_inputs(overrides, lengths, past_lengths, **DROPOUT)
    layer.train()
    assert unsupported(layer) is None
    # Kept units are scaled by 1 / (1 - rate), and float32 rounding with them (up to 3.3e-5 relative, in the keys'
    # gradient of a causal scan); the float64 gradcheck below checks the maths with dropout exactly.
    assert_scans_agree(layer, inputs, layout, 5 * TOLERANCE)
    # and dropout did drop: eval mode gives other cells
    with torch.no_grad():
        torch.manual_seed(11)
        trained = run_scan(fused_cell_scan, layer, *inputs, layout)[3]
        evaluated = run_scan(fused_cell_scan, layer.eval(), *inputs, layout)[3]
    assert (trained - evaluated).abs().max() > 0.1


@pytest.mark.parametrize("lengths,past_lengths", BATCHES[1:])
@pytest.mark.parametrize("overrides", MODES[:2] + MODES[3:4])
def test_fused_scan_equals_the_reference_in_float64(overrides, lengths, past_lengths, monkeypatch):
    """In float64 rounding is out of the way: the hand-written backward is the reference's maths.

    `standard_normalize` computes in float32 whatever its input (for half precision); here it keeps float64. Its
    reference function is replaced, which `standard_normalize` and `RANCenteredRMSNorm` run on a CPU.
    """

    def standard_normalize_reference(states, eps, dropout=None):
        centred = states - states.mean(-1, keepdim=True)
        normalized = centred * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + eps)
        return normalized if dropout is None else dropout(normalized)

    monkeypatch.setattr(building_blocks, "standard_normalize_reference", standard_normalize_reference)
    layer, inputs, layout = layer_and_inputs(overrides, lengths, past_lengths, dtype=torch.float64)
    assert_scans_agree(layer, inputs, layout, 1e-10)


# Each case takes 10-25 s of finite differences: the default run checks the encoder and a causal one with dropout.
@pytest.mark.parametrize(
    "overrides,dropout",
    [
        pytest.param(MODES[0].values[0], {}, id="encoder"),
        pytest.param(MODES[1].values[0], {}, id="encoder-without-cell-input-residual", marks=pytest.mark.slow),
        pytest.param(MODES[5].values[0], {}, id="causal-without-cell-residual", marks=pytest.mark.slow),
        pytest.param(MODES[0].values[0], DROPOUT, id="encoder-dropout", marks=pytest.mark.slow),
        pytest.param(MODES[3].values[0], DROPOUT, id="causal-dropout"),
    ],
)
def test_fused_scan_passes_gradcheck(overrides, dropout):
    """Finite differences in float64, through the starting cells, the window keys and values and every weight; with
    dropout, every evaluation draws the same masks."""
    layer, inputs, layout = layer_and_inputs(
        overrides, [7, 4, 5], [4, 0, 0], dtype=torch.float64, hidden_size=8, head_dim=4, window_size=3, **dropout
    )
    layer.train()
    # Every weight the scan reads (not the initial cell or memory review, which the layer uses outside the scan).
    used = [(name, p) for name, p in layer.named_parameters() if name != "initial_cell" and "memory" not in name]
    names, weights = zip(*used)

    class Scan(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, *tensors):
            torch.manual_seed(5)
            return run_scan(fused_cell_scan, self.layer, *tensors, layout)

    scan = Scan()

    def function(*tensors):
        parameters = {f"layer.{name}": tensor for name, tensor in zip(names, tensors[4:])}
        return torch.func.functional_call(scan, parameters, tuple(tensors[:4]))

    assert torch.autograd.gradcheck(function, (*inputs, *weights), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="encoder"),
        pytest.param({"is_causal": True, "num_hidden_layers": 3}, id="causal"),
        pytest.param({"use_cell_residual": False, "window_overlap": 2}, id="no-cell-residual-overlap"),
        pytest.param({"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}, id="encoder-dropout"),
        pytest.param({"is_causal": True, "hidden_dropout_prob": 0.1}, id="causal-dropout"),
    ],
)
def test_models_train_alike_with_either_scan(overrides):
    """A whole model: the same outputs and parameter gradients with the fused scan as with the reference."""
    results = []
    for scan in ("reference", "fused"):
        model = randomize_(RANModel(tiny_config(scan_implementation=scan, **overrides)), seed=3).train()
        sequences = [random_ids(n, model.config.vocab_size, seed=i) for i, n in enumerate([17, 6, 11])]
        ids, mask = pad_batch(sequences, side="left")
        torch.manual_seed(6)  # the same dropout, in the scan and outside it
        outputs = model(ids, attention_mask=mask)
        (outputs.last_hidden_state * mask[..., None]).pow(2).sum().add(outputs.pooler_output.sum()).backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results.append((outputs.last_hidden_state.detach(), grads))
    (expected, expected_grads), (actual, actual_grads) = results
    assert (actual - expected).abs().max() <= TOLERANCE
    assert actual_grads.keys() == expected_grads.keys()
    for name, want in expected_grads.items():
        diff = (actual_grads[name] - want).abs().max().item()
        assert diff <= TOLERANCE * max(1.0, want.abs().max().item()), f"gradient of {name}: {diff:.2e}"


def test_chunked_causal_training_through_a_cache_matches_the_reference():
    """Continuation: two chunks through a cache (the second scan starts from cached cells), left-padded rows."""
    ids = torch.randint(1, 61, (2, 19), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # row 1 starts later: its first chunk ends inside its first window, row 0's does not
    probe = torch.randn(2, 19, 61, generator=torch.Generator().manual_seed(5))
    results = []
    for scan in ("reference", "fused"):
        model = randomize_(RANForCausalLM(tiny_config(is_causal=True, scan_implementation=scan)), seed=2).train()
        cache = RANCache(model.config)
        first = model(ids[:, :9], attention_mask=mask[:, :9], past_key_values=cache, use_cache=True)
        second = model(ids[:, 9:], attention_mask=mask, past_key_values=first.past_key_values, use_cache=True)
        logits = torch.cat([first.logits, second.logits], 1) * mask[..., None]
        (logits * probe).sum().backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    (expected, expected_grads), (actual, actual_grads) = results
    assert (actual - expected).abs().max() <= TOLERANCE
    for name, want in expected_grads.items():
        diff = (actual_grads[name] - want).abs().max().item()
        assert diff <= TOLERANCE * max(1.0, want.abs().max().item()), f"gradient of {name}: {diff:.2e}"


@pytest.mark.parametrize(
    "fields,train,reason",
    [
        pytest.param({"hidden_act": "gelu"}, False, "SiLU", id="other-activation"),
        pytest.param({"hidden_act": "gelu", "hidden_dropout_prob": 0.1}, True, "SiLU", id="other-activation-training"),
    ],
)
def test_fused_scan_falls_back_to_the_reference_and_warns_once(fields, train, reason, caplog):
    transformers_logging.warning_once.cache_clear()
    config_fields = {"scan_implementation": "fused", **fields}
    torch.manual_seed(0)
    model = RANModel(tiny_config(**config_fields)).train(train)
    reference = RANModel(tiny_config(**{**config_fields, "scan_implementation": "reference"})).train(train)
    reference.load_state_dict(model.state_dict())
    ids, mask = pad_batch([random_ids(n, 61, seed=n) for n in (13, 6)])
    with caplog.at_level(logging.WARNING, logger="ran_hf.kernels.choice"):
        torch.manual_seed(1)
        fused = model(ids, attention_mask=mask).last_hidden_state
        model(ids, attention_mask=mask)
    torch.manual_seed(1)
    expected = reference(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(fused, expected)
    warnings = [record for record in caplog.records if "fused cell scan runs the reference" in record.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0].getMessage()


@pytest.mark.parametrize("train", [False, True], ids=["eval", "training"])
def test_dropout_does_not_send_the_fused_scan_back_to_the_reference(train, caplog):
    transformers_logging.warning_once.cache_clear()
    model = RANModel(tiny_config(scan_implementation="fused", hidden_dropout_prob=0.1)).train(train)
    layer = next(module for module in model.modules() if isinstance(module, RANLayer))
    assert unsupported(layer) is None
    with caplog.at_level(logging.WARNING, logger="ran_hf.kernels.choice"):
        model(*pad_batch([random_ids(9, 61, seed=0)]))
    assert "fused cell scan" not in caplog.text


# A module of the layer the scan shares with the tokens, and each of the scan's own (the cell's GLU and norm).
WRAPPED_MODULES = [
    pytest.param("qkv_proj", "`qkv_proj`", id="layer-projection"),
    pytest.param("cell_scan.cell_glu.proj", "`cell_glu.proj`", id="scan-glu-projection"),
    pytest.param("cell_scan.cell_norm", "`cell_norm`", id="scan-norm"),
]


@pytest.mark.parametrize("path,named", WRAPPED_MODULES)
def test_a_wrapped_module_sends_the_fused_scan_back_to_the_reference(path, named, caplog):
    """The fused scan reads weights: a module changed by a forward hook (as LoRA adapters or quantisation change
    theirs) would be silently bypassed, whether it is the layer's or the scan's own. It falls back, says why, and
    gives the wrapped layer's results."""
    transformers_logging.warning_once.cache_clear()
    layer, inputs, layout = layer_and_inputs({}, [23, 7], None)
    layer.get_submodule(path).register_forward_hook(lambda module, args, output: output + 0.5)
    assert named in unsupported(layer)
    layer.config.scan_implementation = "fused"
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ran_hf.kernels.choice"):
        fused = layer.cell_scan(layer.cell_scan_weights(), *inputs, layout)
        expected = run_scan(reference_cell_scan, layer, *inputs, layout)
        unwrapped = run_scan(fused_cell_scan, layer, *inputs, layout)
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want)
    assert not all(torch.equal(got, bypassed) for got, bypassed in zip(fused, unwrapped))  # the hook counts
    assert named in caplog.text
