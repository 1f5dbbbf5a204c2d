"""The Triton gated linear unit (triton_glu.py) equals RAN's PyTorch one (`gated_linear_unit_reference`): outputs and
the gradients of the input, weight, bias and the residual added to it, for row counts and widths that do and do not
fill a program's block, float32 and float16. On a CPU the kernels run in Triton's interpreter; on CUDA compiled, and
`RANGatedLinearUnit` then uses them."""

import pytest
import torch

from ran_hf.building_blocks import (
    NormAfter,
    RANCenteredRMSNorm,
    RANGatedLinearUnit,
    centered_rms_norm_reference,
    gated_linear_unit_reference,
)
from ran_hf.kernels import choice as kernel_choice
from ran_hf.kernels.choice import TRITON_AVAILABLE, choose


pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
triton_glu = pytest.importorskip("ran_hf.kernels.triton_ops.glu", reason="no Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def force(monkeypatch, op: str, use_triton: bool) -> None:
    """Make `kernel_choice.choose(op, ...)` give the Triton kernel (in Triton's interpreter on a CPU) or PyTorch's ops."""
    monkeypatch.setitem(kernel_choice.FORCED, op, "triton" if use_triton else "pytorch")


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((3, 7, 24), id="3x7x24"),
        pytest.param((40, 16), id="40x16-rows-fill-programs"),
        pytest.param((1, 5), id="1x5-one-row"),
        pytest.param((2, 3, triton_glu.BLOCK_COLUMNS + 3), id="columns-past-one-block"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize(
    "residual",
    [None, "same", "broadcast"],
    ids=["no-residual", "residual-in-the-kernel", "broadcast-residual-added-after"],
)
def test_triton_glu_equals_the_pytorch_glu(shape, dtype, residual, monkeypatch):
    generator = torch.Generator().manual_seed(sum(shape))
    glu = RANGatedLinearUnit(shape[-1])
    with torch.no_grad():  # gates far from 0 too, where sigmoid saturates
        glu.proj.weight.copy_(torch.randn(glu.proj.weight.shape, generator=generator))
        glu.proj.bias.copy_(torch.randn(glu.proj.bias.shape, generator=generator))
    glu = glu.to(DEVICE, dtype)
    x = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    probe = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    other = {None: None, "same": shape, "broadcast": shape[-1:]}[residual]
    other = None if other is None else torch.randn(other, generator=generator).to(DEVICE, dtype)

    force(monkeypatch, "glu", True)

    def run(use_triton):  # the module's own dispatch, told to run the kernel, against the reference
        leaf = x.clone().requires_grad_()
        other_leaf = None if other is None else other.clone().requires_grad_()
        glu.zero_grad()
        residual = None if other_leaf is None else other_leaf * 2  # the residual is another op's output
        out = glu(leaf, residual) if use_triton else gated_linear_unit_reference(glu.proj(leaf), residual)
        (out.float() * probe.float()).sum().backward()
        grads = [leaf.grad, glu.proj.weight.grad, glu.proj.bias.grad]
        return out.detach(), grads + ([] if other_leaf is None else [other_leaf.grad])

    expected, expected_grads = run(False)
    actual, actual_grads = run(True)
    assert actual.dtype == expected.dtype == dtype and actual.shape == expected.shape
    # float16: the PyTorch ops round the projection before its bias and the sigmoid before the product, the kernel
    # rounds once at the end: a few ulp of the projection's size apart where value and bias cancel
    atol, rtol = (1e-5, 1e-4) if dtype == torch.float32 else (2e-3, 4e-3)
    scale = 1.0 if dtype == torch.float32 else max(1.0, glu.proj(x).abs().max().item())
    assert torch.allclose(actual.float(), expected.float(), atol=atol * scale, rtol=rtol)
    for got, want in zip(actual_grads, expected_grads):
        assert got.dtype == want.dtype
        assert torch.allclose(got.float(), want.float(), atol=atol * max(1.0, want.abs().max().item()), rtol=rtol)


def test_triton_glu_refuses_an_odd_width():
    with pytest.raises(ValueError, match="even width"):
        triton_glu.triton_glu(torch.randn(3, 5, device=DEVICE))


def test_the_triton_glu_runs_on_cuda_unless_switched_off(monkeypatch):
    """On CUDA (and the meta device, which stands in for it) by default; never on the CPU; off when switched off;
    on meta it is one op each way in place of the PyTorch ops, the residual's sum included."""
    meta = torch.empty(2, 3, 16, device="meta")
    assert choose("glu", meta) == "triton"
    assert choose("glu", torch.empty(2, 3, 16)) == "pytorch"
    with torch.device("meta"):
        glu = RANGatedLinearUnit(8)
        x, residual = torch.empty(2, 3, 8, requires_grad=True), torch.empty(2, 3, 8, requires_grad=True)
    seen = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with Ops():
        out = glu(x, residual)
        out.sum().backward()
    assert out.shape == (2, 3, 8) and x.grad.shape == residual.grad.shape == x.shape
    assert seen.count("ran_hf::glu_forward") == seen.count("ran_hf::glu_backward") == 1
    assert not {"aten::sigmoid", "aten::sigmoid_backward", "aten::mul", "aten::add"} & set(seen)
    monkeypatch.setitem(kernel_choice.TRITON, "glu", False)
    assert choose("glu", meta) == "pytorch"


@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_the_residual_branch_in_the_kernel_equals_its_pytorch_ops(activation, dropout, dtype, monkeypatch):
    """GLU(x) + dropout(act(r)) in one kernel each way: the output and the gradients of x, the weights and r equal
    the PyTorch ops', given the mask the kernel drew (read off its output). The mask keeps units at the rate asked
    for, is the one the backward applies, and repeats for a seed."""
    rows, width = 40, triton_glu.BLOCK_COLUMNS + 20
    generator = torch.Generator().manual_seed(7)
    glu = RANGatedLinearUnit(width)
    with torch.no_grad():
        glu.proj.weight.copy_(torch.randn(glu.proj.weight.shape, generator=generator) / 4)
    glu = glu.to(DEVICE, dtype)
    x = torch.randn(rows, width, generator=generator).to(DEVICE, dtype)
    branch_input = (torch.randn(rows, width, generator=generator) * 3).to(DEVICE, dtype)
    probe = torch.randn(rows, width, generator=generator).to(DEVICE, dtype)
    act = {"none": None, "silu": torch.nn.SiLU()}[activation]
    drop = torch.nn.Dropout(dropout).train()

    force(monkeypatch, "glu", True)

    def run(use_triton, mask=None):
        leaf, branch_leaf = x.clone().requires_grad_(), branch_input.clone().requires_grad_()
        glu.zero_grad()
        if use_triton:
            out = glu(leaf, branch_leaf * 1, act, drop)  # the branch is another op's output
        else:  # the reference with the kernel's mask
            branch = branch_leaf * 1 if act is None else act(branch_leaf * 1)
            out = gated_linear_unit_reference(glu.proj(leaf), branch * mask)
        (out.float() * probe.float()).sum().backward()
        return out.detach(), [leaf.grad, glu.proj.weight.grad, glu.proj.bias.grad, branch_leaf.grad]

    torch.manual_seed(3)
    actual, actual_grads = run(True)
    torch.manual_seed(3)  # the same seed draws the same mask: read it off a branch of ones, scaled by 1 / keep
    ones = torch.ones(rows, width, device=DEVICE, dtype=dtype)
    mask = triton_glu.triton_glu(torch.zeros(rows, 2 * width, device=DEVICE, dtype=dtype), ones, 0, dropout)
    kept = mask != 0
    assert torch.allclose(mask[kept].float(), torch.full_like(mask[kept].float(), 1 / (1 - dropout)), rtol=1e-3)
    assert abs(kept.float().mean().item() - (1 - dropout)) < 0.03
    expected, expected_grads = run(False, mask)
    atol, rtol = (1e-5, 1e-4) if dtype == torch.float32 else (4e-3, 4e-3)
    assert actual.dtype == expected.dtype == dtype
    assert torch.allclose(actual.float(), expected.float(), atol=atol * 10, rtol=rtol)
    for got, want in zip(actual_grads, expected_grads):
        assert torch.allclose(got.float(), want.float(), atol=atol * max(1.0, want.abs().max().item()), rtol=rtol)
    torch.manual_seed(3)
    again, _ = run(True)
    torch.manual_seed(4)
    other, _ = run(True)
    assert torch.equal(again, actual)
    assert torch.equal(other, actual) == (dropout == 0.0)


def test_a_branch_the_kernel_cannot_compute_runs_in_pytorch_ops(monkeypatch):
    """An activation other than SiLU (here GELU) or a residual of another shape: the branch in PyTorch ops, then the
    kernel; the result equals the PyTorch path's."""
    monkeypatch.setattr(torch.nn.Dropout, "forward", lambda self, states: states)  # the same units on both paths
    glu = RANGatedLinearUnit(8).to(DEVICE)
    x, branch = torch.randn(3, 8, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    force(monkeypatch, "glu", True)
    for act, residual in ((torch.nn.GELU(), branch), (torch.nn.SiLU(), branch[:1])):
        drop = torch.nn.Dropout(0.5)
        expected = gated_linear_unit_reference(glu.proj(x), residual, act, drop)
        assert torch.allclose(glu(x, residual, act, drop), expected, atol=1e-6)


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
def test_a_residual_read_through_a_row_map_equals_the_gathered_residual(dropout, monkeypatch):
    """With `residual_rows` (the layer's attention outputs, in window order, read by token) the kernel reads row
    `rows[r]` of a residual with more rows than outputs: output and gradients equal those of the residual gathered
    first, and the rows no output reads get a zero gradient."""
    rows, width, extra = 37, 24, 11
    generator = torch.Generator().manual_seed(5)
    glu = RANGatedLinearUnit(width).to(DEVICE)
    x = torch.randn(rows, width, generator=generator).to(DEVICE)
    residual = torch.randn(rows + extra, width, generator=generator).to(DEVICE)
    order = torch.randperm(rows + extra, generator=generator)[:rows].to(DEVICE)  # each residual row read once at most
    probe = torch.randn(rows, width, generator=generator).to(DEVICE)
    act, drop = torch.nn.SiLU(), torch.nn.Dropout(dropout).train()
    force(monkeypatch, "glu", True)

    def run(mapped):
        leaf, residual_leaf = x.clone().requires_grad_(), residual.clone().requires_grad_()
        glu.zero_grad()
        torch.manual_seed(9)  # the same mask both ways
        if mapped:
            out = glu(leaf, residual_leaf * 1, act, drop, residual_rows=order)
        else:
            out = glu(leaf, (residual_leaf * 1)[order], act, drop)
        (out * probe).sum().backward()
        return out.detach(), [leaf.grad, glu.proj.weight.grad, glu.proj.bias.grad, residual_leaf.grad]

    expected, expected_grads = run(False)
    actual, actual_grads = run(True)
    assert torch.allclose(actual, expected, atol=1e-5)
    for got, want in zip(actual_grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-5 * max(1.0, want.abs().max().item()))
    unread = torch.ones(rows + extra, dtype=torch.bool, device=DEVICE)
    unread[order] = False
    assert not actual_grads[-1][unread].any() and actual_grads[-1][~unread].abs().sum() > 0


@pytest.mark.parametrize("then_standardize", [False, True], ids=["layer-norm", "layer-norm-then-standardise"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
def test_the_norm_after_the_glu_in_its_kernel_equals_the_pytorch_ops(then_standardize, dropout, monkeypatch):
    """norm(GLU(x) + dropout(act(r))) and its dropout in one kernel each way (the official layer's attention ending
    and memory review): output and the gradients of x, the projection, the branch and the norm's weight and bias
    equal the PyTorch ops' under the kernel's masks (read off constant inputs with the same seed)."""
    rows, width, extra = 21, 40, 5  # a width below the kernel's whole-row block
    generator = torch.Generator().manual_seed(13)
    glu, norm = RANGatedLinearUnit(width).to(DEVICE), RANCenteredRMSNorm(width, 1e-7).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=generator))
        norm.bias.copy_(torch.randn(width, generator=generator))
    x = torch.randn(rows, width, generator=generator).to(DEVICE)
    residual = torch.randn(rows + extra, width, generator=generator).to(DEVICE)
    order = torch.randperm(rows + extra, generator=generator)[:rows].to(DEVICE)
    probe = torch.randn(rows, width, generator=generator).to(DEVICE)
    act, drop = torch.nn.SiLU(), torch.nn.Dropout(dropout).train()
    zeros, ones = torch.zeros(rows, 2 * width, device=DEVICE), torch.ones(rows, width, device=DEVICE)
    torch.manual_seed(4)
    branch_mask = triton_glu.triton_glu(zeros, ones, 0, dropout)  # 1 / keep where kept: LN(constant) = its bias
    torch.manual_seed(4)
    norm_mask = triton_glu.triton_glu(zeros, norm=(ones[0], ones[0], 1e-7, False, dropout))

    force(monkeypatch, "glu", True)
    force(monkeypatch, "norm", True)

    def run(use_triton):
        leaf, residual_leaf = x.clone().requires_grad_(), residual.clone().requires_grad_()
        glu.zero_grad()
        norm.zero_grad()
        torch.manual_seed(4)
        if use_triton:
            out = glu(leaf, residual_leaf * 1, act, drop, order, NormAfter(norm, drop, then_standardize))
        else:  # the references with the kernel's masks
            summed = gated_linear_unit_reference(glu.proj(leaf), act((residual_leaf * 1)[order]) * branch_mask)
            out = centered_rms_norm_reference(summed, norm.weight, norm.bias, 1e-7, None, then_standardize) * norm_mask
        (out * probe).sum().backward()
        grads = [leaf.grad, glu.proj.weight.grad, glu.proj.bias.grad, residual_leaf.grad, norm.weight.grad]
        return out.detach(), grads + [norm.bias.grad]

    expected, expected_grads = run(False)
    actual, actual_grads = run(True)
    assert torch.allclose(actual, expected, atol=1e-5)
    for got, want in zip(actual_grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-4 * max(1.0, want.abs().max().item()))
