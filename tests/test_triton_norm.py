"""The Triton normalisation (triton_norm.py) equals RAN's PyTorch one: outputs and the gradients of input, weight
and bias, with and without the learned scale and shift, for row counts that do and do not fill a program's rows.
On a CPU the kernels run in Triton's interpreter; on CUDA compiled, and `RANLayerNorm` then uses them."""

import pytest
import torch

from ran_hf.building_blocks import RANLayerNorm, standard_normalize
from ran_hf.triton_norm import TritonNorm
from ran_hf.triton_scan import TRITON_AVAILABLE

pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("affine", [True, False], ids=["layer-norm", "standardise"])
@pytest.mark.parametrize("shape", [(3, 7, 24), (40, 16), (1, 5)], ids=str)
def test_triton_norm_equals_the_pytorch_normalisation(affine, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=generator) * 3 + 1).to(DEVICE).requires_grad_()
    norm = RANLayerNorm(shape[-1], 1e-7)
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
            out = norm.weight * standard_normalize(x, 1e-7) + norm.bias
        else:
            out = standard_normalize(x, 1e-7)
        (out * probe).sum().backward()
        grads = [x.grad.clone()] + ([norm.weight.grad.clone(), norm.bias.grad.clone()] if affine else [])
        return out.detach(), grads

    expected, expected_grads = run(False)
    actual, actual_grads = run(True)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.allclose(actual, expected, atol=1e-5)
    for got, want in zip(actual_grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-4 * max(1.0, want.abs().max().item()))
