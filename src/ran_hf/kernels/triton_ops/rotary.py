"""RAN's rotary embedding as one Triton kernel forward and one backward (on CUDA, where Triton is installed).

`apply_interleaved_rotary` (ran_hf/building_blocks.py) is about fifteen PyTorch ops forward (a float32 copy, the pairs'
four products, their sums, a stack, a cast back) and twenty backward, each a kernel that reads and writes every
query or key; it runs on the queries and on the keys of every layer. Here the rotation of a row of pairs,
(x, y) -> (x cos - y sin, x sin + y cos), is one kernel computed in float32 whatever the states' dtype; its gradient
is the inverse rotation, the same kernel with the sines negated. Each launch is a `torch.library.triton_op` (one op
for `torch.compile`, export and a dispatch counter). The states are read through their strides: the layer's keys are
a permuted view of the gathered windows and their gradients slices of a concatenation, which a contiguous copy
would read and write once more each way.

Shapes: states (A, B, C, d), any strides; the rotations' cosines and sines (A, B, C, d / 2, 2), broadcast from any of
A, B, C; the output (A, B, C, d) contiguous.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from . import register_on_meta


ROWS_PER_PROGRAM = 16


@triton.jit
def _rotate_pairs_kernel(states, rotations, out, R, B, C, half, stride_a, stride_b, stride_c, states_a, states_b,
                         states_c, states_d, INVERSE: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_HALF: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pairs = tl.arange(0, BLOCK_HALF)
    ok = (rows < R)[:, None] & (pairs < half)[None, :]
    c = rows % C
    b = (rows // C) % B
    a = rows // (B * C)
    angle = (a * stride_a + b * stride_b + c * stride_c)[:, None] + 2 * pairs[None, :]
    cos = tl.load(rotations + angle, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(rotations + angle + 1, mask=ok, other=0.0).to(tl.float32)
    if INVERSE:  # the transpose of a rotation: the gradient of the forward's
        sin = -sin
    source = (a * states_a + b * states_b + c * states_c)[:, None] + 2 * pairs[None, :] * states_d
    x = tl.load(states + source, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(states + source + states_d, mask=ok, other=0.0).to(tl.float32)
    element = rows[:, None] * (2 * half) + 2 * pairs[None, :]
    tl.store(out + element, (x * cos - y * sin).to(out.dtype.element_ty), mask=ok)
    tl.store(out + element + 1, (x * sin + y * cos).to(out.dtype.element_ty), mask=ok)


@triton_op("ran_hf::rotate_pairs", mutates_args={})
def rotate_pairs(states: torch.Tensor, rotations: torch.Tensor, inverse: bool) -> torch.Tensor:
    """`states` (A, B, C, d) of any strides, each pair (x_2i, x_2i+1) rotated by `rotations` (A, B, C, d / 2, 2),
    whose last two axes are contiguous and whose first three may be broadcast (stride 0); the output contiguous."""
    num_a, num_b, num_c, head_dim = states.shape
    out = states.new_empty(states.shape)
    rows = num_a * num_b * num_c
    stride_a, stride_b, stride_c = rotations.stride()[:3]
    wrap_triton(_rotate_pairs_kernel)[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
        states, rotations, out, rows, num_b, num_c, head_dim // 2, stride_a, stride_b, stride_c, *states.stride(),
        INVERSE=inverse, ROWS=ROWS_PER_PROGRAM, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )  # fmt: skip
    return out


def _on_meta(states, rotations, inverse):  # shape checks and kernel counts without a GPU
    return states.new_empty(states.shape)


register_on_meta(rotate_pairs, _on_meta)


def _setup_context(ctx, inputs, output):
    ctx.rotations, ctx.inverse = inputs[1], inputs[2]


def _backward(ctx, grad_out):
    return rotate_pairs(grad_out, ctx.rotations, not ctx.inverse), None, None


rotate_pairs.register_autograd(_backward, setup_context=_setup_context)


def triton_rotate_pairs(states: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """`apply_interleaved_rotary` in one kernel: states (..., d), rotations (..., d / 2, 2) broadcasting against the
    states' leading axes (at most three of them)."""
    leading = states.shape[:-1]
    if len(leading) > 3:
        raise ValueError(f"the Triton rotary embedding takes at most 3 leading axes, got states of shape {leading}")
    shape = (1,) * (3 - len(leading)) + tuple(leading)
    try:
        fits = torch.broadcast_shapes(shape, rotations.shape[:-2]) == shape
    except RuntimeError:
        fits = False
    if not fits or rotations.shape[-2:] != (states.shape[-1] // 2, 2) or rotations.dim() > 5:
        raise ValueError(
            f"rotations of shape {tuple(rotations.shape)} do not broadcast to states {tuple(states.shape)}"
        )
    rotations = rotations.reshape((1,) * (5 - rotations.dim()) + tuple(rotations.shape))
    if rotations.stride()[-2:] != (2, 1):
        rotations = rotations.contiguous()
    rotations = rotations.expand(*shape, *rotations.shape[-2:])
    return rotate_pairs(states.reshape(shape + states.shape[-1:]), rotations, False).view(states.shape)
