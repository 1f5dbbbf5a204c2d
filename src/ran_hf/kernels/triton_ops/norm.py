"""RAN's normalisation as one Triton kernel forward and one backward (on CUDA, where Triton is installed).

`standard_normalize` and `RANCenteredRMSNorm` (ran_hf/building_blocks.py) are seven to nine PyTorch ops forward and more
backward, each a kernel that reads and writes every token state; there are five or six of them per layer. Here the
forward is one kernel per block of rows: y = weight * (x - mean(x)) / sqrt(mean(x^2) + eps) + bias, in float32
whatever x is. The backward is one kernel that writes the input's gradient and, per block of rows, partial sums of
the weight's and bias's gradients (summed after). Each launch is a `torch.library.triton_op`.

The layer drops units of two normalised states in training (its input's, and the official ending's). Given the rate,
the kernels apply that dropout too (two launches and about five token-state passes fewer each), with the mask drawn
as `glu.py` draws it: Philox from a seed drawn on the device, drawn again in the backward, not the units
`nn.Dropout` would drop for the same seed.

Shapes: R rows (tokens), D hidden size.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from . import register_meta_no_ops


ROWS_PER_PROGRAM = 16


@triton.jit
def _standardize(row, ok, D, eps):
    """SN(row) (zeros past D) and its 1 / sqrt(mean(row^2) + eps)."""
    mean = tl.sum(row, 0) / D
    rstd = 1.0 / tl.sqrt(tl.sum(row * row, 0) / D + eps)
    return tl.where(ok, (row - mean) * rstd, 0.0), rstd


@triton.jit
def _standardize_grad(grad, row, normed, rstd, D):
    """d SN(row) / d row applied to grad: rstd (g - mean(g) - row rstd mean(g SN(row)))."""
    mean_grad = tl.sum(grad, 0) / D
    mean_product = tl.sum(grad * normed, 0) / D
    return rstd * (grad - mean_grad - row * rstd * mean_product)


@triton.jit
def _norm_forward_kernel(x, weight, bias, y, R, D, eps, seed_at, keep, AFFINE: tl.constexpr,
                         THEN_STANDARDIZE: tl.constexpr, DROPOUT: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_D: tl.constexpr):  # fmt: skip
    i = tl.arange(0, BLOCK_D)
    ok = i < D
    if AFFINE:
        w = tl.load(weight + i, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(bias + i, mask=ok, other=0.0).to(tl.float32)
    for r in range(tl.program_id(0) * ROWS, tl.minimum(R, (tl.program_id(0) + 1) * ROWS)):
        row = tl.load(x + r * D + i, mask=ok, other=0.0).to(tl.float32)
        out, _ = _standardize(row, ok, D, eps)
        if AFFINE:
            out = out * w + b
        if THEN_STANDARDIZE:  # the official layer's ending: LayerNorm, then the standardisation
            out, _ = _standardize(out, ok, D, eps)
        if DROPOUT:  # kept with probability `keep`, scaled by 1 / keep
            out = tl.where(tl.rand(tl.load(seed_at), r * D + i) < keep, out / keep, 0.0)
        tl.store(y + r * D + i, out.to(y.dtype.element_ty), mask=ok)


@triton.jit
def _norm_backward_kernel(x, weight, bias, grad_y, grad_x, grad_weight_parts, grad_bias_parts, R, D, eps, seed_at,
                          keep, AFFINE: tl.constexpr, THEN_STANDARDIZE: tl.constexpr, DROPOUT: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    program = tl.program_id(0)
    i = tl.arange(0, BLOCK_D)
    ok = i < D
    grad_w = tl.zeros((BLOCK_D,), dtype=tl.float32)
    grad_b = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if AFFINE:
        w = tl.load(weight + i, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(bias + i, mask=ok, other=0.0).to(tl.float32)
    for r in range(program * ROWS, tl.minimum(R, (program + 1) * ROWS)):
        row = tl.load(x + r * D + i, mask=ok, other=0.0).to(tl.float32)
        grad = tl.load(grad_y + r * D + i, mask=ok, other=0.0).to(tl.float32)
        if DROPOUT:  # the forward's mask, drawn again
            grad = tl.where(tl.rand(tl.load(seed_at), r * D + i) < keep, grad / keep, 0.0)
        normed, rstd = _standardize(row, ok, D, eps)
        if THEN_STANDARDIZE:  # back through the second standardisation, of the LayerNorm's output (recomputed)
            affine = tl.where(ok, normed * w + b, 0.0) if AFFINE else normed
            second, second_rstd = _standardize(affine, ok, D, eps)
            grad = _standardize_grad(grad, affine, second, second_rstd, D)
        if AFFINE:
            grad_w += grad * normed
            grad_b += grad
            grad = grad * w
        grad_in = _standardize_grad(grad, row, normed, rstd, D)
        tl.store(grad_x + r * D + i, grad_in.to(grad_x.dtype.element_ty), mask=ok)
    if AFFINE:
        tl.store(grad_weight_parts + program * D + i, grad_w, mask=ok)
        tl.store(grad_bias_parts + program * D + i, grad_b, mask=ok)


@triton_op("ran_hf::norm_forward", mutates_args={"y"})
def norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, y: torch.Tensor, eps: float,
                 affine: bool, then_standardize: bool, seed: torch.Tensor, keep: float) -> None:  # fmt: skip
    rows, hidden = x.shape
    wrap_triton(_norm_forward_kernel)[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
        x, weight, bias, y, rows, hidden, eps, seed, keep, AFFINE=affine, THEN_STANDARDIZE=then_standardize,
        DROPOUT=keep < 1.0, ROWS=ROWS_PER_PROGRAM, BLOCK_D=triton.next_power_of_2(hidden),
    )  # fmt: skip


@triton_op("ran_hf::norm_backward", mutates_args={"grad_x", "grad_weight_parts", "grad_bias_parts"})
def norm_backward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grad_y: torch.Tensor,
                  grad_x: torch.Tensor, grad_weight_parts: torch.Tensor, grad_bias_parts: torch.Tensor, eps: float,
                  affine: bool, then_standardize: bool, seed: torch.Tensor, keep: float) -> None:  # fmt: skip
    rows, hidden = x.shape
    wrap_triton(_norm_backward_kernel)[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
        x, weight, bias, grad_y, grad_x, grad_weight_parts, grad_bias_parts, rows, hidden, eps, seed, keep,
        AFFINE=affine, THEN_STANDARDIZE=then_standardize, DROPOUT=keep < 1.0, ROWS=ROWS_PER_PROGRAM,
        BLOCK_D=triton.next_power_of_2(hidden),
    )  # fmt: skip


register_meta_no_ops(norm_forward, norm_backward)


class TritonNorm(torch.autograd.Function):
    """weight * SN(x) + bias (or SN(x) without weight and bias) over the last axis, standardised once more where
    `then_standardize` (the official layer's ending), with units dropped at the rate `dropout` (0: none); returns
    `out_dtype`."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, eps: float, out_dtype: torch.dtype, dropout: float = 0.0, then_standardize=False
    ):
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()
        affine = weight is not None
        y = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
        stand_in = rows.new_empty(1)
        # The mask's seed, drawn on the device by PyTorch's generator: no host synchronisation, restored by checkpoints
        seed = torch.randint(2**31 - 1, (1,), device=x.device) if dropout else stand_in
        norm_forward(rows, weight if affine else stand_in, bias if affine else stand_in, y, eps, affine,
                     then_standardize, seed, 1.0 - dropout)  # fmt: skip
        ctx.save_for_backward(rows, weight if affine else None, bias if affine else None, seed)
        ctx.eps, ctx.shape, ctx.affine, ctx.keep = eps, shape, affine, 1.0 - dropout
        ctx.then_standardize = then_standardize
        return y.view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        rows, weight, bias, seed = ctx.saved_tensors
        grad_y = grad_y.reshape(rows.shape).contiguous()
        grad_x = torch.empty_like(rows)
        programs = triton.cdiv(rows.shape[0], ROWS_PER_PROGRAM)
        parts = rows.new_empty(programs, rows.shape[1], dtype=torch.float32) if ctx.affine else rows.new_empty(1)
        bias_parts = torch.empty_like(parts)
        stand_in = rows.new_empty(1)
        norm_backward(rows, weight if ctx.affine else stand_in, bias if ctx.affine else stand_in, grad_y, grad_x,
                      parts, bias_parts, ctx.eps, ctx.affine, ctx.then_standardize, seed, ctx.keep)  # fmt: skip
        grad_weight = grad_bias = None
        if ctx.affine:
            grad_weight, grad_bias = parts.sum(0).to(weight.dtype), bias_parts.sum(0).to(weight.dtype)
        return grad_x.view(ctx.shape), grad_weight, grad_bias, None, None, None, None
