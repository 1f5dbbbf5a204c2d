"""RAN's gated linear unit as one Triton kernel forward and one backward (on CUDA, where Triton is installed).

`RANGatedLinearUnit` (building_blocks.py) projects x to [value, gate] and returns value * sigmoid(gate): two PyTorch
ops forward (the sigmoid, the product) and four backward (two products, the sigmoid's gradient, the concatenation
that undoes the chunk), each a kernel that reads and writes every token state. Every layer runs two of them over all
tokens (the attention's gated residual and the memory review's). Here the projection's output is read once forward
and written once as the output; backward reads it and the output's gradient once and writes the projection's
gradient once: 8 token-state passes where the PyTorch ops make 18. Computed in float32 whatever the dtype. Each
launch is a `torch.library.triton_op` (one op for `torch.compile`, export and a dispatch counter).

The layer adds the unit to another branch (`dropout(act(o_proj(x))) + GLU(normed)`): given that branch as
`residual`, the forward kernel adds it too, and the sum's own kernel (3 passes) is gone; its gradient is the output's.
Dropout stays a PyTorch op before it: on CUDA `nn.Dropout` draws its mask in ATen's fused kernel, whose random
stream a Triton kernel cannot reproduce, and a mask drawn another way would drop other units for the same seed.

Shapes: projected (R, 2 D) rows of [value, gate] as `nn.Linear(D, 2 D)` writes them; residual and output (R, D).
"""

import torch

from .triton_scan_kernels import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

ROWS_PER_PROGRAM = 16
BLOCK_COLUMNS = 256  # of the D output columns per program: elementwise, so any width tiles into these
# On by default on CUDA, as the Triton normalisation and rotary embedding are; `ran_hf.triton_glu.ENABLED = False`
# switches back to the PyTorch ops.
ENABLED = True


if TRITON_AVAILABLE:

    @triton.jit
    def _glu_forward_kernel(projected, residual, out, R, D, RESIDUAL: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK: tl.constexpr):  # fmt: skip
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # R x 2 D may pass 2^31
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = (rows < R)[:, None] & (columns < D)[None, :]
        value_at = rows[:, None] * (2 * D) + columns[None, :]
        value = tl.load(projected + value_at, mask=ok, other=0.0).to(tl.float32)
        gate = tl.load(projected + value_at + D, mask=ok, other=0.0).to(tl.float32)
        gated = value / (1.0 + tl.exp(-gate))
        out_at = rows[:, None] * D + columns[None, :]
        if RESIDUAL:
            gated += tl.load(residual + out_at, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + out_at, gated.to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def _glu_backward_kernel(projected, grad_out, grad_projected, R, D, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # R x 2 D may pass 2^31
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = (rows < R)[:, None] & (columns < D)[None, :]
        value_at = rows[:, None] * (2 * D) + columns[None, :]
        value = tl.load(projected + value_at, mask=ok, other=0.0).to(tl.float32)
        gate = tl.load(projected + value_at + D, mask=ok, other=0.0).to(tl.float32)
        grad = tl.load(grad_out + rows[:, None] * D + columns[None, :], mask=ok, other=0.0).to(tl.float32)
        sigmoid = 1.0 / (1.0 + tl.exp(-gate))
        grad_value = grad * sigmoid
        # d/dg v sigmoid(g) = v sigmoid(g) (1 - sigmoid(g))
        grad_gate = grad_value * value * (1.0 - sigmoid)
        tl.store(grad_projected + value_at, grad_value.to(grad_projected.dtype.element_ty), mask=ok)
        tl.store(grad_projected + value_at + D, grad_gate.to(grad_projected.dtype.element_ty), mask=ok)

    def _grid(rows: int, width: int) -> tuple:
        return (triton.cdiv(rows, ROWS_PER_PROGRAM), triton.cdiv(width, BLOCK_COLUMNS))

    @triton_op("ran_hf::glu_forward", mutates_args={})
    def glu_forward(projected: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """(R, 2 D) contiguous rows of [value, gate] -> (R, D) value * sigmoid(gate), plus `residual` (R, D)
        (contiguous, of the same dtype) where given."""
        rows, width = projected.shape[0], projected.shape[1] // 2
        out = projected.new_empty(rows, width)
        wrap_triton(_glu_forward_kernel)[_grid(rows, width)](
            projected, projected if residual is None else residual, out, rows, width, RESIDUAL=residual is not None,
            ROWS=ROWS_PER_PROGRAM, BLOCK=BLOCK_COLUMNS,
        )  # fmt: skip
        return out

    @triton_op("ran_hf::glu_backward", mutates_args={})
    def glu_backward(projected: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        """The gradient (R, 2 D) of `glu_forward`'s input, given its output's (R, D); both contiguous."""
        rows, width = grad_out.shape
        grad_projected = torch.empty_like(projected)
        wrap_triton(_glu_backward_kernel)[_grid(rows, width)](
            projected, grad_out, grad_projected, rows, width, ROWS=ROWS_PER_PROGRAM, BLOCK=BLOCK_COLUMNS
        )
        return grad_projected

    # The meta device (shape checks and kernel counts without a GPU) runs no kernel.
    for _op, _on_meta in (
        (glu_forward, lambda projected, residual: projected.new_empty(projected.shape[0], projected.shape[1] // 2)),
        (glu_backward, lambda projected, grad_out: torch.empty_like(projected)),
    ):
        try:
            _op.register_kernel("meta")(_on_meta)
        except RuntimeError:  # some PyTorch versions give every triton_op a meta kernel of their own
            pass

    def _setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.has_residual = inputs[1] is not None

    def _backward(ctx, grad_out):
        (projected,) = ctx.saved_tensors
        grad_residual = grad_out if ctx.has_residual else None  # the output's gradient, as it is
        return glu_backward(projected, grad_out.contiguous()), grad_residual

    glu_forward.register_autograd(_backward, setup_context=_setup_context)


def triton_glu(projected: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """value * sigmoid(gate) of `projected` (..., 2 D) = [value, gate], plus `residual` where given, in one kernel:
    (..., D). A residual that would change the result's shape or dtype is added by PyTorch after the kernel."""
    if projected.shape[-1] % 2:
        raise ValueError(f"the gated linear unit takes [value, gate] of even width, got {projected.shape[-1]}")
    width = projected.shape[-1] // 2
    shape = (*projected.shape[:-1], width)
    rows = projected.reshape(-1, 2 * width).contiguous()
    if residual is not None and (residual.shape != shape or residual.dtype != projected.dtype):
        return residual + glu_forward(rows, None).view(shape)
    if residual is not None:
        residual = residual.reshape(-1, width).contiguous()
    return glu_forward(rows, residual).view(shape)


def triton_glu_applies(projected: torch.Tensor) -> bool:
    """Whether the Triton gated linear unit runs here: where `ENABLED`, on CUDA (and the meta device, which counts
    its launches) with Triton installed, outside `torch.compile` (which fuses the PyTorch ops itself)."""
    return (
        ENABLED
        and TRITON_AVAILABLE
        and projected.device.type in ("cuda", "meta")
        and not torch.compiler.is_compiling()
    )
