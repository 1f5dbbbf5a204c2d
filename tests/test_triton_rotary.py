"""The Triton rotary embedding (triton_rotary.py) equals RAN's PyTorch one (`rotate_pairs_reference`): outputs and
the states' gradients, for the queries' and the keys' broadcasting of the rotations, head sizes that are and are not
powers of two, float32 and float16. On a CPU the kernel runs in Triton's interpreter; on CUDA compiled."""

import pytest
import torch

from ran_hf.building_blocks import rotary_rotations, rotate_pairs_reference
from ran_hf.kernels import choice as kernel_choice
from ran_hf.kernels.choice import TRITON_AVAILABLE, choose


pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
triton_rotate_pairs = pytest.importorskip("ran_hf.kernels.triton_ops.rotary", reason="no Triton").triton_rotate_pairs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rotations_for(kind, windows, heads, slots, head_dim, generator):
    """As RANLayer.project_windows rotates them: keys by their slot, queries by their own slot in the window."""
    table = rotary_rotations(slots + 1, head_dim, 10000.0, "cpu")[1:]  # (S, d / 2, 2)
    if kind == "keys":
        return table.to(DEVICE)
    query_slots = torch.randint(0, slots, (windows, slots - 1), generator=generator)
    return table[query_slots][:, None].to(DEVICE)  # (K, 1, Q, d / 2, 2)


@pytest.mark.parametrize("kind", ["keys", "queries"])
@pytest.mark.parametrize("head_dim", [8, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_triton_rotary_equals_the_pytorch_rotary(kind, head_dim, dtype):
    generator = torch.Generator().manual_seed(head_dim)
    windows, heads, slots = 3, 2, 7
    rotations = rotations_for(kind, windows, heads, slots, head_dim, generator)
    positions = slots if kind == "keys" else slots - 1
    states = torch.randn(windows, heads, positions, head_dim, generator=generator).to(DEVICE, dtype)
    probe = torch.randn(states.shape, generator=generator).to(DEVICE, dtype)

    def run(rotate):
        leaf = states.clone().requires_grad_()
        out = rotate(leaf, rotations)
        (out.float() * probe.float()).sum().backward()
        return out.detach(), leaf.grad

    expected, expected_grad = run(rotate_pairs_reference)
    actual, actual_grad = run(triton_rotate_pairs)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert actual.dtype == expected.dtype == dtype and actual.shape == expected.shape
    assert torch.allclose(actual.float(), expected.float(), atol=tolerance)
    assert torch.allclose(actual_grad.float(), expected_grad.float(), atol=tolerance)


def test_triton_rotary_reads_states_and_gradients_through_their_strides():
    """As the layer rotates its keys: a permuted view of the gathered (K, S, 2, H, d) windows in, and the gradient
    a slice of the concatenation with the cell's key; neither is copied to be contiguous first."""
    generator = torch.Generator().manual_seed(0)
    windows, heads, slots, head_dim = 3, 2, 7, 8
    rotations = rotations_for("keys", windows, heads, slots, head_dim, generator)
    gathered = torch.randn(windows, slots, 2, heads, head_dim, generator=generator).to(DEVICE)
    cell_key = torch.randn(windows, heads, 1, head_dim, generator=generator).to(DEVICE)
    probe = torch.randn(windows, heads, 1 + slots, head_dim, generator=generator).to(DEVICE)

    def run(rotate):
        leaf = gathered.clone().requires_grad_()
        key = leaf.permute(2, 0, 3, 1, 4)[0]  # (K, H, S, d), strided
        out = rotate(key, rotations)
        (torch.cat([cell_key, out], dim=2) * probe).sum().backward()
        return out.detach(), leaf.grad

    expected, expected_grad = run(rotate_pairs_reference)
    actual, actual_grad = run(triton_rotate_pairs)
    assert actual.is_contiguous()
    assert torch.allclose(actual, expected, atol=1e-5)
    assert torch.allclose(actual_grad, expected_grad, atol=1e-5)


def test_triton_rotary_refuses_rotations_that_do_not_fit():
    states = torch.randn(2, 3, 5, 8, device=DEVICE)
    with pytest.raises(ValueError, match="do not broadcast"):
        triton_rotate_pairs(states, torch.randn(4, 4, 2, device=DEVICE))


def test_the_triton_rotary_runs_on_cuda_unless_switched_off(monkeypatch):
    """On CUDA (and the meta device, which stands in for it) by default; never on the CPU; off when switched off."""
    meta_states = torch.empty(2, 3, 5, 8, device="meta")
    assert choose("rotary", meta_states) == "triton"
    assert choose("rotary", torch.empty(2, 3, 5, 8)) == "pytorch"
    monkeypatch.setitem(kernel_choice.TRITON, "rotary", False)
    assert choose("rotary", meta_states) == "pytorch"
