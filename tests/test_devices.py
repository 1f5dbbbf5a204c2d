"""What matters on a GPU, on every device present: the fast path equals the per-window reference (both scans,
outputs and gradients), padding changes nothing, cached decoding and generation equal the full forward, and bf16
autocast keeps the cell scan in float32.

The reference runs on the CPU; the model under test is a copy moved to the device. Without a CUDA device the CUDA
cases skip, and the CPU cases check the same things against themselves.
"""

import copy

import pytest
import torch
from ran_reference import reference_forward
from ran_testing import pad_batch, random_ids, randomize_, real_positions, tiny_config

from ran_hf import RANForCausalLM, RANModel
from ran_hf.kernels.choice import TRITON_AVAILABLE


# The Triton scan runs on CUDA (compiled) and, on a CPU, in Triton's interpreter where Triton is installed.
SCANS = [
    "reference",
    "fused",
    pytest.param("triton", marks=pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")),
]
DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
# CUDA kernels sum in other orders than the CPU reference; TF32 is switched off below.
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}
CASES = [
    pytest.param({}, [11, 12, 10, 1], id="encoder"),
    pytest.param({"window_overlap": 2, "cell_pooling": "max"}, [16, 7], id="encoder-overlap"),
    pytest.param({"is_causal": True, "num_hidden_layers": 3}, [17, 5, 12], id="causal"),
]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param != "cuda":
        yield torch.device(request.param)
        return
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32 here
    yield torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def assert_close(actual, expected, device, what):
    diff = (actual.detach().cpu() - expected.detach().cpu()).abs().max().item()
    scale = max(1.0, expected.abs().max().item())
    assert diff <= TOLERANCE[device.type] * scale, f"{what} on {device}: max abs diff {diff:.2e}"


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("overrides,lengths", CASES)
def test_fast_path_on_the_device_equals_the_reference(overrides, lengths, scan, device):
    model = randomize_(RANModel(tiny_config(scan_implementation=scan, **overrides)), seed=len(lengths)).eval()
    on_device = copy.deepcopy(model).to(device)
    sequences = [random_ids(n, model.config.vocab_size, seed=i) for i, n in enumerate(lengths)]
    ids, mask = pad_batch(sequences)
    with torch.no_grad():
        outputs = on_device(ids.to(device), attention_mask=mask.to(device))
        for row, sequence in enumerate(sequences):
            expected = reference_forward(model, sequence)
            real = real_positions(mask[row])
            tokens = outputs.last_hidden_state[row, real.to(device)]
            assert_close(tokens, expected["last_hidden_state"], device, "tokens")
            assert_close(outputs.cells[row, : len(expected["cells"])], expected["cells"], device, "cells")
            assert_close(outputs.pooler_output[row], expected["pooler_output"], device, "pooler output")


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("overrides,lengths", CASES)
def test_gradients_on_the_device_equal_the_cpu_reference_scan(overrides, lengths, scan, device):
    """Every parameter's gradient, left padding, against the reference scan on the CPU."""
    model = randomize_(RANModel(tiny_config(**overrides)), seed=3).train()
    on_device = copy.deepcopy(model).to(device)
    on_device.config.scan_implementation = scan
    ids, mask = pad_batch([random_ids(n, model.config.vocab_size, seed=n) for n in lengths], side="left")

    def gradients(run, inputs):
        outputs = run(inputs[0], attention_mask=inputs[1])
        (outputs.last_hidden_state * inputs[1][..., None]).pow(2).sum().add(outputs.pooler_output.sum()).backward()
        return {name: p.grad for name, p in run.named_parameters() if p.grad is not None}

    expected = gradients(model, (ids, mask))
    got = gradients(on_device, (ids.to(device), mask.to(device)))
    assert got.keys() == expected.keys()
    for name, gradient in expected.items():
        assert_close(got[name], gradient, device, f"gradient of {name}")


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_changes_nothing_on_the_device(side, device):
    model = randomize_(RANModel(tiny_config()), seed=1).eval().to(device)
    sequences = [random_ids(n, model.config.vocab_size, seed=n) for n in (19, 4, 11)]
    ids, mask = pad_batch(sequences, side=side)
    with torch.no_grad():
        batched = model(ids.to(device), attention_mask=mask.to(device))
        for row, sequence in enumerate(sequences):
            alone = model(sequence[None].to(device))
            real = real_positions(mask[row]).to(device)
            assert_close(batched.last_hidden_state[row, real], alone.last_hidden_state[0], device, "tokens")
            assert_close(batched.pooler_output[row], alone.pooler_output[0], device, "pooler output")


def test_cached_decoding_and_generation_on_the_device(device):
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True, window_overlap=1)), seed=4).eval()
    on_device = copy.deepcopy(model).to(device)
    ids = random_ids(23, model.config.vocab_size, seed=5)[None].to(device)
    with torch.no_grad():
        full = on_device(ids).logits
        cache, steps = None, []
        for position in range(ids.shape[1]):
            outputs = on_device(ids[:, position : position + 1], past_key_values=cache, use_cache=True)
            cache = outputs.past_key_values
            steps.append(outputs.logits)
    assert_close(torch.cat(steps, dim=1), full, device, "token-by-token logits")

    prompt = random_ids(7, model.config.vocab_size, seed=6)[None]
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    with_cache = on_device.generate(prompt.to(device), max_new_tokens=12, do_sample=False)
    without_cache = on_device.generate(prompt.to(device), max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(with_cache, without_cache)
    assert torch.equal(with_cache.cpu(), expected), "the device generates other tokens than the CPU"


@pytest.mark.parametrize("scan", SCANS)
def test_bf16_autocast_on_the_device_keeps_the_scan_in_float32(scan, device):
    if device.type == "cpu" or torch.cuda.is_bf16_supported():
        model = randomize_(RANModel(tiny_config(scan_implementation=scan)), seed=2).train().to(device)
    else:
        pytest.skip("this CUDA device has no bfloat16")
    ids, mask = (tensor.to(device) for tensor in pad_batch([random_ids(n, 61, seed=n) for n in (23, 9)]))
    exact = model(ids, attention_mask=mask)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        mixed = model(ids, attention_mask=mask)
    assert mixed.cells.dtype == mixed.last_cell.dtype == torch.float32
    error = (mixed.last_cell - exact.last_cell).norm() / exact.last_cell.norm()
    assert error < 2e-2
    mixed.pooler_output.float().pow(2).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
