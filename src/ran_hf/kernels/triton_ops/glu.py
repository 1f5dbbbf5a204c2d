"""RAN's gated linear unit as one Triton kernel forward and one backward (on CUDA, where Triton is installed).

`RANGatedLinearUnit` (ran_hf/building_blocks.py) projects x to [value, gate] and returns value * sigmoid(gate): two PyTorch
ops forward (the sigmoid, the product) and four backward (two products, the sigmoid's gradient, the concatenation
that undoes the chunk), each a kernel that reads and writes every token state. Every layer runs two of them over all
tokens (the attention's gated residual and the memory review's). Here the projection's output is read once forward
and written once as the output; backward reads it and the output's gradient once and writes the projection's
gradient once: 8 token-state passes where the PyTorch ops make 18. Computed in float32 whatever the dtype. Each
launch is a `torch.library.triton_op` (one op for `torch.compile`, export and a dispatch counter).

The layer adds the unit to another branch, `dropout(act(o_proj(x))) + GLU(normed)`, and so does the memory review.
Given that branch's input as `residual` with its activation (SiLU or none) and dropout, the forward kernel computes
the branch and the sum, and the backward kernel writes both inputs' gradients: the activation, the dropout and the
sum need no kernels of their own (5 launches and about 8 token-state passes fewer per branch). The kernel draws the
dropout mask itself, with Philox from a seed drawn on the device by PyTorch's generator (so a seed, and a recomputed
checkpoint, repeat it), and its backward draws it again instead of storing it. It is not the mask `nn.Dropout`
draws for the same seed: PyTorch's CUDA kernel's random stream is its own, so the Triton path and the PyTorch ops
drop different units, at the same rate.

Shapes: projected (R, 2 D) rows of [value, gate] as `nn.Linear(D, 2 D)` writes them; residual and output (R, D).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton
from transformers.activations import SiLUActivation

from . import register_on_meta


ROWS_PER_PROGRAM = 16
BLOCK_COLUMNS = 256  # of the D output columns per program: elementwise, so any width tiles into these
NORM_ROWS_PER_PROGRAM = 4  # with a norm after it, a program holds whole rows
# The activations of a residual branch the kernels compute: none, or SiLU.
NO_ACTIVATION, SILU = 0, 1


def branch_activation(activation) -> int | None:
    """The kernels' code for a residual branch's activation (a function or module; None: none), or None where they
    cannot compute it."""
    if activation is None or isinstance(activation, nn.Identity):
        return NO_ACTIVATION
    if activation is F.silu or isinstance(activation, (nn.SiLU, SiLUActivation)):
        return SILU
    return None


@triton.jit
def _branch(residual, branch_at, out_at, ok, seed_at, keep, ACTIVATION: tl.constexpr, DROPOUT: tl.constexpr):
    """The residual branch dropout(act(residual)) for the outputs at `out_at`, read at `branch_at`, and its
    derivative by the residual."""
    branch = tl.load(residual + branch_at, mask=ok, other=0.0).to(tl.float32)
    slope = tl.full(branch.shape, 1.0, tl.float32)
    if ACTIVATION == 1:  # SiLU: x sigmoid(x), whose derivative is sigmoid(x) (1 + x (1 - sigmoid(x)))
        sigmoid = 1.0 / (1.0 + tl.exp(-branch))
        slope = sigmoid * (1.0 + branch * (1.0 - sigmoid))
        branch = branch * sigmoid
    if DROPOUT:  # kept with probability `keep`, scaled by 1 / keep; the same draw forward and backward
        scale = tl.where(tl.rand(tl.load(seed_at), out_at) < keep, 1.0 / keep, 0.0)
        branch, slope = branch * scale, slope * scale
    return branch, slope


@triton.jit
def _load_value_and_gate(projected, bias, rows, columns, ok, D, BIAS: tl.constexpr):
    """Row block of [value, gate] in float32, the projection's bias added where it is given apart."""
    value_at = rows[:, None] * (2 * D) + columns[None, :]
    value = tl.load(projected + value_at, mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(projected + value_at + D, mask=ok, other=0.0).to(tl.float32)
    if BIAS:
        value += tl.load(bias + columns, mask=columns < D, other=0.0).to(tl.float32)[None, :]
        gate += tl.load(bias + D + columns, mask=columns < D, other=0.0).to(tl.float32)[None, :]
    return value_at, value, gate


@triton.jit
def _standardize_rows(block, ok, D, eps):
    """SN of each row of a (rows, columns) block (zeros past D), and each row's 1 / sqrt(mean(x^2) + eps)."""
    block = tl.where(ok, block, 0.0)
    mean = tl.sum(block, axis=1) / D
    rstd = 1.0 / tl.sqrt(tl.sum(block * block, axis=1) / D + eps)
    return tl.where(ok, (block - mean[:, None]) * rstd[:, None], 0.0), rstd


@triton.jit
def _standardize_rows_grad(grad, block, normed, rstd, ok, D):
    """d SN(row) / d row applied to each row of grad: rstd (g - mean(g) - row rstd mean(g SN(row)))."""
    block = tl.where(ok, block, 0.0)
    mean_grad = tl.sum(grad, axis=1) / D
    mean_product = tl.sum(grad * normed, axis=1) / D
    return rstd[:, None] * (grad - mean_grad[:, None] - block * (rstd * mean_product)[:, None])


@triton.jit
def _glu_forward_kernel(projected, bias, residual, residual_rows, norm_weight, norm_bias, out, seed_at, keep,
                        norm_keep, eps, R, D, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, ROW_MAP: tl.constexpr,
                        ACTIVATION: tl.constexpr, DROPOUT: tl.constexpr, NORM: tl.constexpr,
                        THEN_STANDARDIZE: tl.constexpr, NORM_DROPOUT: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr):  # fmt: skip
    """With NORM, a program holds whole rows (BLOCK >= D) and normalises them after the sum."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # R x 2 D may pass 2^31
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (rows < R)[:, None] & (columns < D)[None, :]
    _, value, gate = _load_value_and_gate(projected, bias, rows, columns, ok, D, BIAS)
    gated = value / (1.0 + tl.exp(-gate))
    out_at = rows[:, None] * D + columns[None, :]
    if RESIDUAL:
        branch_at = out_at
        if ROW_MAP:  # output row r adds residual row residual_rows[r]
            branch_rows = tl.load(residual_rows + rows, mask=rows < R, other=0).to(tl.int64)
            branch_at = branch_rows[:, None] * D + columns[None, :]
        branch, _ = _branch(residual, branch_at, out_at, ok, seed_at, keep, ACTIVATION, DROPOUT)
        gated += branch
    if NORM:  # LayerNorm (langml's) of the sum, standardised again where asked, then dropout
        normed, _ = _standardize_rows(gated, ok, D, eps)
        w = tl.load(norm_weight + columns, mask=columns < D, other=0.0).to(tl.float32)
        b = tl.load(norm_bias + columns, mask=columns < D, other=0.0).to(tl.float32)
        gated = normed * w[None, :] + b[None, :]
        if THEN_STANDARDIZE:
            gated, _ = _standardize_rows(gated, ok, D, eps)
        if NORM_DROPOUT:
            gated = tl.where(tl.rand(tl.load(seed_at + 1), out_at) < norm_keep, gated / norm_keep, 0.0)
    tl.store(out + out_at, gated.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _glu_backward_kernel(projected, bias, grad_out, grad_projected, grad_bias_parts, residual, residual_rows,
                         grad_residual, norm_weight, norm_bias, grad_norm_parts, seed_at, keep, norm_keep, eps, R,
                         D, BIAS: tl.constexpr, BRANCH: tl.constexpr, ROW_MAP: tl.constexpr,
                         ACTIVATION: tl.constexpr, DROPOUT: tl.constexpr, NORM: tl.constexpr,
                         THEN_STANDARDIZE: tl.constexpr, NORM_DROPOUT: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # R x 2 D may pass 2^31
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (rows < R)[:, None] & (columns < D)[None, :]
    value_at, value, gate = _load_value_and_gate(projected, bias, rows, columns, ok, D, BIAS)
    out_at = rows[:, None] * D + columns[None, :]
    grad = tl.load(grad_out + out_at, mask=ok, other=0.0).to(tl.float32)
    sigmoid = 1.0 / (1.0 + tl.exp(-gate))
    branch_at = out_at
    if BRANCH:
        if ROW_MAP:  # each residual row is read by one output row at most: written once, no atomics
            branch_rows = tl.load(residual_rows + rows, mask=rows < R, other=0).to(tl.int64)
            branch_at = branch_rows[:, None] * D + columns[None, :]
        branch, slope = _branch(residual, branch_at, out_at, ok, seed_at, keep, ACTIVATION, DROPOUT)
    if NORM:  # back through the norm, whose input (the sum) is recomputed
        summed = value * sigmoid
        if BRANCH:
            summed += branch
        if NORM_DROPOUT:  # the forward's mask, drawn again
            grad = tl.where(tl.rand(tl.load(seed_at + 1), out_at) < norm_keep, grad / norm_keep, 0.0)
        normed, rstd = _standardize_rows(summed, ok, D, eps)
        w = tl.load(norm_weight + columns, mask=columns < D, other=0.0).to(tl.float32)
        if THEN_STANDARDIZE:
            b = tl.load(norm_bias + columns, mask=columns < D, other=0.0).to(tl.float32)
            affine = tl.where(ok, normed * w[None, :] + b[None, :], 0.0)
            second, second_rstd = _standardize_rows(affine, ok, D, eps)
            grad = _standardize_rows_grad(grad, affine, second, second_rstd, ok, D)
        parts_at = tl.program_id(0) * (2 * D) + columns  # this block's sums for the norm's weight and bias
        tl.store(grad_norm_parts + parts_at, tl.sum(grad * normed, axis=0), mask=columns < D)
        tl.store(grad_norm_parts + parts_at + D, tl.sum(grad, axis=0), mask=columns < D)
        grad = _standardize_rows_grad(tl.where(ok, grad * w[None, :], 0.0), summed, normed, rstd, ok, D)
    grad_value = grad * sigmoid
    # d/dg v sigmoid(g) = v sigmoid(g) (1 - sigmoid(g))
    grad_gate = grad_value * value * (1.0 - sigmoid)
    tl.store(grad_projected + value_at, grad_value.to(grad_projected.dtype.element_ty), mask=ok)
    tl.store(grad_projected + value_at + D, grad_gate.to(grad_projected.dtype.element_ty), mask=ok)
    if BIAS:  # this block's column sums: the bias gradient is their sum over row blocks, without another pass
        parts_at = tl.program_id(0) * (2 * D) + columns
        tl.store(grad_bias_parts + parts_at, tl.sum(grad_value, axis=0), mask=columns < D)
        tl.store(grad_bias_parts + parts_at + D, tl.sum(grad_gate, axis=0), mask=columns < D)
    if BRANCH:
        tl.store(grad_residual + branch_at, (grad * slope).to(grad_residual.dtype.element_ty), mask=ok)


def _blocks(width: int, norm: bool) -> tuple:
    """Rows and columns per program: elementwise, any tile; with a norm, whole rows."""
    return (NORM_ROWS_PER_PROGRAM, triton.next_power_of_2(width)) if norm else (ROWS_PER_PROGRAM, BLOCK_COLUMNS)


def _grid(rows: int, width: int, norm: bool) -> tuple:
    block_rows, block_columns = _blocks(width, norm)
    return (triton.cdiv(rows, block_rows), triton.cdiv(width, block_columns))


@triton_op("ran_hf::glu_forward", mutates_args={})
def glu_forward(
    projected: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    residual_rows: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    activation: int,
    keep: float,
    norm_keep: float,
    eps: float,
    then_standardize: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(R, 2 D) contiguous rows of [value, gate] (plus `bias` (2 D) where the projection left it out) ->
    (R, D) value * sigmoid(gate), plus dropout(act(residual)) where `residual` (contiguous, of the same dtype) is
    given: (R, D), or any number of rows of which output row r reads `residual_rows[r]` (each at most once).
    `activation` NO_ACTIVATION or SILU, units kept with probability `keep`. With `norm_weight` and `norm_bias`
    (D), the sum then goes through RAN's LayerNorm (`eps`), a second standardisation where `then_standardize`,
    and dropout keeping `norm_keep`. The masks are drawn from the int64 `seed` (branch's, norm's). The output is
    `out_dtype`."""
    rows, width = projected.shape[0], projected.shape[1] // 2
    out = projected.new_empty(rows, width, dtype=out_dtype)
    norm = norm_weight is not None
    block_rows, block_columns = _blocks(width, norm)
    wrap_triton(_glu_forward_kernel)[_grid(rows, width, norm)](
        projected, projected if bias is None else bias, projected if residual is None else residual,
        projected if residual_rows is None else residual_rows, norm_weight if norm else projected,
        norm_bias if norm else projected, out, projected if seed is None else seed, keep, norm_keep, eps, rows,
        width, BIAS=bias is not None, RESIDUAL=residual is not None, ROW_MAP=residual_rows is not None,
        ACTIVATION=activation, DROPOUT=keep < 1.0, NORM=norm, THEN_STANDARDIZE=then_standardize,
        NORM_DROPOUT=norm_keep < 1.0, ROWS=block_rows, BLOCK=block_columns,
    )  # fmt: skip
    return out


@triton_op("ran_hf::glu_backward", mutates_args={"grad_residual", "grad_bias_parts", "grad_norm_parts"})
def glu_backward(
    projected: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    residual_rows: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    activation: int,
    keep: float,
    norm_keep: float,
    eps: float,
    then_standardize: bool,
    grad_out: torch.Tensor,
    grad_residual: torch.Tensor,
    grad_bias_parts: torch.Tensor,
    grad_norm_parts: torch.Tensor,
) -> torch.Tensor:
    """The gradient of `glu_forward`'s input (R, 2 D), given the output's (R, D, contiguous). Where a residual is
    given, its gradient is written into `grad_residual` (of its shape; the rows no output reads are left as they
    are: zeros where the caller gave zeros); where a bias or a norm is, each block of rows writes its sums of
    the gradients of the projection's bias and of the norm's [weight, bias] into its row of `grad_bias_parts`
    and `grad_norm_parts` (row blocks, 2 D)."""
    rows, width = grad_out.shape
    grad_projected = torch.empty_like(projected)
    norm = norm_weight is not None
    block_rows, block_columns = _blocks(width, norm)
    wrap_triton(_glu_backward_kernel)[_grid(rows, width, norm)](
        projected, projected if bias is None else bias, grad_out, grad_projected, grad_bias_parts,
        projected if residual is None else residual, projected if residual_rows is None else residual_rows,
        grad_residual, norm_weight if norm else projected, norm_bias if norm else projected, grad_norm_parts,
        projected if seed is None else seed, keep, norm_keep, eps, rows, width, BIAS=bias is not None,
        BRANCH=residual is not None, ROW_MAP=residual_rows is not None, ACTIVATION=activation,
        DROPOUT=keep < 1.0, NORM=norm, THEN_STANDARDIZE=then_standardize, NORM_DROPOUT=norm_keep < 1.0,
        ROWS=block_rows, BLOCK=block_columns,
    )  # fmt: skip
    return grad_projected


def _forward_on_meta(projected, *args):
    return projected.new_empty(projected.shape[0], projected.shape[1] // 2, dtype=args[-1])


def _backward_on_meta(projected, *_):
    return torch.empty_like(projected)


register_on_meta(glu_forward, _forward_on_meta)
register_on_meta(glu_backward, _backward_on_meta)


def _setup_context(ctx, inputs, output):
    projected, bias, residual, residual_rows, norm_weight, norm_bias, seed, *flags = inputs
    activation, keep = flags[:2]
    # A plain residual's gradient is the output's: only a branch with an activation, dropout, a row map or a
    # norm after it is read again.
    ctx.plain_residual = residual is not None and residual_rows is None and norm_weight is None
    ctx.plain_residual = ctx.plain_residual and activation == NO_ACTIVATION and keep == 1.0
    saved_residual = None if ctx.plain_residual else residual
    ctx.save_for_backward(projected, bias, saved_residual, residual_rows, norm_weight, norm_bias, seed)
    ctx.has_residual, ctx.flags = residual is not None, flags


def _backward(ctx, grad_out):
    projected, bias, residual, residual_rows, norm_weight, norm_bias, seed = ctx.saved_tensors
    if residual is None:  # none, or a plain one: its gradient is the output's, as it is
        grad_residual = grad_out if ctx.plain_residual else None
        written = projected.new_empty(0)
    elif residual_rows is not None and residual_rows.shape[0] < residual.shape[0]:
        grad_residual = written = torch.zeros_like(residual)  # rows no output reads get none
    else:
        grad_residual = written = torch.empty_like(residual)
    norm = norm_weight is not None
    row_blocks = triton.cdiv(projected.shape[0], _blocks(projected.shape[1] // 2, norm)[0])

    def parts(needed):  # float32 sums per block of rows
        return projected.new_empty(row_blocks, projected.shape[1], dtype=torch.float32) if needed else None

    bias_parts, norm_parts = parts(bias is not None), parts(norm)
    empty = projected.new_empty(0)
    grad_projected = glu_backward(
        projected, bias, residual, residual_rows, norm_weight, norm_bias, seed, *ctx.flags[:-1],
        grad_out.contiguous(), written, empty if bias_parts is None else bias_parts,
        empty if norm_parts is None else norm_parts,
    )  # fmt: skip
    grad_bias = None if bias is None else bias_parts.sum(0).to(bias.dtype)
    grad_norm_weight = grad_norm_bias = None
    if norm:
        grad_norm_weight, grad_norm_bias = norm_parts.sum(0).to(norm_weight.dtype).chunk(2)
    residual_grad = grad_residual if ctx.has_residual else None
    return (grad_projected, grad_bias, residual_grad, None, grad_norm_weight, grad_norm_bias) + (None,) * 7


glu_forward.register_autograd(_backward, setup_context=_setup_context)


def triton_glu(
    projected: torch.Tensor,
    residual: torch.Tensor | None = None,
    activation: int = NO_ACTIVATION,
    dropout: float = 0.0,
    residual_rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norm: tuple | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """value * sigmoid(gate) of `projected` (..., 2 D) = [value, gate], plus dropout(act(residual)) where a residual
    is given (`activation`: NO_ACTIVATION or SILU; `dropout`: the probability of dropping a unit), in one kernel:
    (..., D). With `residual_rows` (one index per output row), the residual is (N, D) rows, output row r adding row
    `residual_rows[r]`. `bias` (2 D): the projection's bias, added here where the projection left it out (its
    gradient then comes from the kernel's column sums, not from a pass of its own over the projection's gradient).
    `norm`: (weight, bias, eps, then_standardize, dropout) of a RAN LayerNorm applied to the result in the same
    kernel. The result is `out_dtype` (by default the projection's). A plain residual that would change the result's
    shape or dtype is added by PyTorch after."""
    if projected.shape[-1] % 2:
        raise ValueError(f"the gated linear unit takes [value, gate] of even width, got {projected.shape[-1]}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"the gated linear unit's residual dropout must be in [0, 1), got {dropout}")
    width = projected.shape[-1] // 2
    shape = (*projected.shape[:-1], width)
    rows = projected.reshape(-1, 2 * width).contiguous()
    norm_weight, norm_bias, eps, then_standardize, norm_dropout = (
        (None, None, 0.0, False, 0.0) if norm is None else norm
    )
    mapped = residual_rows is not None
    if residual is not None and not mapped and (residual.shape != shape or residual.dtype != projected.dtype):
        if activation != NO_ACTIVATION or dropout or norm is not None:
            raise ValueError(
                "a residual branch with an activation, dropout or a norm after it must have the output's shape and "
                "dtype"
            )
        plain = glu_forward(
            rows, bias, None, None, None, None, None, NO_ACTIVATION, 1.0, 1.0, 0.0, False, projected.dtype
        )
        return residual + plain.view(shape)
    if residual is not None:
        residual = residual.reshape(-1, width).contiguous()
    seed = None
    if dropout or norm_dropout:  # drawn on the device by PyTorch's generator: no host read, restored by checkpoints
        seed = torch.randint(2**31 - 1, (2,), device=projected.device, dtype=torch.int64)
    if mapped:
        residual_rows = residual_rows.reshape(-1)
    return glu_forward(
        rows, bias, residual, residual_rows, norm_weight, norm_bias, seed, activation, 1.0 - dropout,
        1.0 - norm_dropout, eps, then_standardize, projected.dtype if out_dtype is None else out_dtype,
    ).view(shape)  # fmt: skip
