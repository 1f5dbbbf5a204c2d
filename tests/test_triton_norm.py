"""The Triton normalisation (triton_norm.py) equals RAN's PyTorch one: outputs and the gradients of input, weight
and bias (`standard_normalize_reference`, `centered_rms_norm_reference`), with and without the learned scale and
shift, for row counts that do and do not fill a program's rows. On a CPU the kernels run in Triton's interpreter; on
CUDA compiled, and `RANCenteredRMSNorm` then uses them."""

import pytest
import torch

from ran_hf.building_blocks import (
    RANCenteredRMSNorm,
    centered_rms_norm_reference,
    standard_normalize,
    standard_normalize_reference,
)
from ran_hf.kernels import choice as kernel_choice
from ran_hf.kernels.choice import TRITON_AVAILABLE


pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
TritonNorm = pytest.importorskip("ran_hf.kernels.triton_ops.norm", reason="no Triton").TritonNorm
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def force(monkeypatch, op: str, use_triton: bool) -> None:
    """Make `kernel_choice.choose(op, ...)` give the Triton kernel (in Triton's interpreter on a CPU) or PyTorch's ops."""
    monkeypatch.setitem(kernel_choice.FORCED, op, "triton" if use_triton else "pytorch")


@pytest.mark.parametrize("affine", [True, False], ids=["layer-norm", "standardise"])
@pytest.mark.parametrize("shape", [(3, 7, 24), (40, 16), (1, 5)], ids=str)
def test_triton_norm_equals_the_pytorch_normalisation(affine, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=generator) * 3 + 1).to(DEVICE).requires_grad_()
    norm = RANCenteredRMSNorm(shape[-1], 1e-7)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=generator))
        norm.bias.copy_(torch.randn(shape[-1], generator=generator))
    norm = norm.to(DEVICE)
    probe = torch.randn(shape, generator=generator).to(DEVICE)

    def run(use_triton):
        for tensor in (x, norm.weight, norm.bias):
            tensor.grad = None
        if use_triton:
            weight, bias = (norm.weight, norm.bias) if affine else (None, None)
            out = TritonNorm.apply(x, weight, bias, 1e-7, torch.float32)
        elif affine:
            out = centered_rms_norm_reference(x, norm.weight, norm.bias, 1e-7)
        else:
            out = standard_normalize_reference(x, 1e-7)
        (out * probe).sum().backward()
        grads = [x.grad.clone()] + ([norm.weight.grad.clone(), norm.bias.grad.clone()] if affine else [])
        return out.detach(), grads

    expected, expected_grads = run(False)
    actual, actual_grads = run(True)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.allclose(actual, expected, atol=1e-5)
    for got, want in zip(actual_grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-4 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("affine", [True, False], ids=["layer-norm", "standardise"])
def test_dropout_in_the_norm_kernel_equals_the_pytorch_ops_with_its_mask(affine, monkeypatch):
    """`RANCenteredRMSNorm(x, dropout)` and `standard_normalize(x, eps, dropout)` drop units inside the kernel: the
    output and every gradient equal the PyTorch ops' given the kernel's mask (read off a run with weight 1 and bias 1,
    the same seed), which keeps units at the rate asked for, is the one the backward applies, and repeats for a
    seed."""
    rows, hidden = 50, 40
    generator = torch.Generator().manual_seed(11)
    x = (torch.randn(rows, hidden, generator=generator) * 3 + 1).to(DEVICE)
    probe = torch.randn(rows, hidden, generator=generator).to(DEVICE)
    norm = RANCenteredRMSNorm(hidden, 1e-7)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=generator))
        norm.bias.copy_(torch.randn(hidden, generator=generator))
    norm = norm.to(DEVICE)
    drop = torch.nn.Dropout(0.25).train()

    force(monkeypatch, "norm", True)

    def run(use_triton, mask=None):
        leaf = x.clone().requires_grad_()
        norm.zero_grad()
        if use_triton:
            out = norm(leaf, drop) if affine else standard_normalize(leaf, 1e-7, drop)
        elif affine:  # the reference with the kernel's mask
            out = centered_rms_norm_reference(leaf, norm.weight, norm.bias, 1e-7) * mask
        else:
            out = standard_normalize_reference(leaf, 1e-7) * mask
        (out * probe).sum().backward()
        return out.detach(), [leaf.grad] + ([norm.weight.grad, norm.bias.grad] if affine else [])

    torch.manual_seed(5)
    actual, actual_grads = run(True)
    torch.manual_seed(5)  # the same seed, the same mask: a constant input standardises to 0, the bias shows the mask
    ones = torch.ones(hidden, device=DEVICE)
    mask = TritonNorm.apply(torch.zeros(rows, hidden, device=DEVICE), ones, ones, 1e-7, torch.float32, 0.25)
    kept = mask != 0
    assert torch.allclose(mask[kept], torch.full_like(mask[kept], 1 / 0.75))
    assert abs(kept.float().mean().item() - 0.75) < 0.05
    expected, expected_grads = run(False, mask)
    assert torch.allclose(actual, expected, atol=1e-5)
    for got, want in zip(actual_grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-4 * max(1.0, want.abs().max().item()))
    torch.manual_seed(5)
    assert torch.equal(run(True)[0], actual)
    torch.manual_seed(6)
    assert not torch.equal(run(True)[0], actual)
    drop.eval()  # not training: nothing dropped
    assert torch.allclose(run(True)[0], run(False, torch.ones_like(mask))[0], atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 7, 24), (40, 16)], ids=str)
@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no-dropout", "dropout"])
def test_layer_norm_then_standardisation_in_one_kernel_equals_the_two(shape, dropout, monkeypatch):
    """`RANCenteredRMSNorm(x, dropout, then_standardize=True)`, the official layer's ending, is one kernel each way:
    the output and the gradients of input, weight and bias equal `standard_normalize(layer_norm(x), eps, dropout)` in
    PyTorch ops (`centered_rms_norm_reference`, with the kernel's dropout mask, read off as in the test above)."""
    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=generator) * 3 + 1).to(DEVICE)
    probe = torch.randn(shape, generator=generator).to(DEVICE)
    norm = RANCenteredRMSNorm(shape[-1], 1e-7)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=generator))
        norm.bias.copy_(torch.randn(shape[-1], generator=generator))
    norm = norm.to(DEVICE)
    drop = torch.nn.Dropout(dropout).train()
    torch.manual_seed(2)  # the mask the kernel draws with this seed, read off a constant input (as above)
    ones = torch.ones(shape[-1], device=DEVICE)
    mask = TritonNorm.apply(torch.zeros(shape, device=DEVICE), ones, ones, 1e-7, torch.float32, dropout)

    force(monkeypatch, "norm", True)

    def run(use_triton):
        leaf = x.clone().requires_grad_()
        norm.zero_grad()
        torch.manual_seed(2)
        if use_triton:
            out = norm(leaf, drop, then_standardize=True)
        else:
            out = centered_rms_norm_reference(leaf, norm.weight, norm.bias, 1e-7, then_standardize=True) * mask
        (out * probe).sum().backward()
        return out.detach(), [leaf.grad, norm.weight.grad, norm.bias.grad]

    expected, expected_grads = run(False)
    actual, actual_grads = run(True)
    assert torch.allclose(actual, expected, atol=1e-5)
    for got, want in zip(actual_grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-4 * max(1.0, want.abs().max().item()))
