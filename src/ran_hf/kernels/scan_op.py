"""The fused cell scan as a custom op, `torch.ops.ran_hf.cell_scan`, for `torch.compile`.

Traced by dynamo, a scan's Python loop over the windows is unrolled into the graph: a graph as long as the text, and
a new one (seconds to a minute of compiling) for every new number of windows. As one custom op the scan is a single
node, whose fake implementation gives its output shapes from its inputs' (N steps from `step_keys`), so dynamic
shapes cover every window count. Its autograd is the fused scan's hand-written backward, itself a custom op, which
first runs the forward steps again to get what it reads: the op keeps nothing between the two passes (the scan's
forward is a small part of a layer's work). Dropout masks are inputs, drawn outside the op, so that the rerun drops
the same units and the op stays a function of its inputs.

Shapes: N scan steps, B batch, H heads, d head size, D hidden size, S window slots.
"""

import torch
from torch import Tensor

from ..scan_inputs import ScanDropout
from .fused_scan import ScanPlan, scan_backward, scan_forward


# first_step_mode: how the first step joins the previous raw cell (`ScanPlan.first_step_residual`)
NO_ROW, EVERY_ROW, SOME_ROWS = 0, 1, 2


def scan_plan(step_keys: Tensor, first_step_rows: Tensor, keep: bool, eps, *flags_and_mode):
    cell_input_residual, use_cell_residual, qk_activation, output_activation, mode = flags_and_mode
    num_steps, _, num_heads, _, head_dim = step_keys.shape
    return ScanPlan(
        num_steps=num_steps,
        num_heads=num_heads,
        head_dim=head_dim,
        eps=eps,
        cell_input_residual=cell_input_residual,
        use_cell_residual=use_cell_residual,
        qk_activation=qk_activation,
        output_activation=output_activation,
        first_step_residual={NO_ROW: False, EVERY_ROW: True}.get(mode, first_step_rows),
        keep_for_backward=keep,
    )


@torch.library.custom_op("ran_hf::cell_scan", mutates_args=())
def _cell_scan(
    cell: Tensor,
    previous_raw: Tensor,
    step_keys: Tensor,
    step_values: Tensor,
    output_shift: Tensor | None,
    score_bias: Tensor,
    first_step_rows: Tensor,
    dropout: list[Tensor | None],
    weights: list[Tensor | None],
    eps: float,
    cell_input_residual: bool,
    use_cell_residual: bool,
    qk_activation: bool,
    output_activation: bool,
    first_step_mode: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`FusedCellScan`'s forward: read keys, read values (N, B, H, d), raw cells and cells (N, B, D)."""
    flags = (cell_input_residual, use_cell_residual, qk_activation, output_activation, first_step_mode)
    plan = scan_plan(step_keys, first_step_rows, False, eps, *flags)
    masks = ScanDropout(*dropout)
    inputs = (cell, previous_raw, step_keys, step_values, output_shift, score_bias, masks)
    outputs, _ = scan_forward(plan, *inputs, tuple(weights))
    return outputs


@_cell_scan.register_fake
def _(cell, previous_raw, step_keys, step_values, output_shift, score_bias, first_step_rows, dropout, weights, *plan):
    num_steps, batch_size, num_heads, _, head_dim = step_keys.shape
    read = step_keys.new_empty(num_steps, batch_size, num_heads, head_dim)
    cells = cell.new_empty(num_steps, batch_size, cell.shape[-1])
    return read, torch.empty_like(read), cells, torch.empty_like(cells)


@torch.library.custom_op("ran_hf::cell_scan_backward", mutates_args=())
def _cell_scan_backward(
    grads: list[Tensor],
    cell: Tensor,
    previous_raw: Tensor,
    step_keys: Tensor,
    step_values: Tensor,
    output_shift: Tensor | None,
    score_bias: Tensor,
    first_step_rows: Tensor,
    dropout: list[Tensor | None],
    weights: list[Tensor | None],
    eps: float,
    cell_input_residual: bool,
    use_cell_residual: bool,
    qk_activation: bool,
    output_activation: bool,
    first_step_mode: int,
) -> list[Tensor]:
    """Gradients of cell, previous_raw, step_keys, step_values, and of the output shift and every weight that are
    not None, in order."""
    flags = (cell_input_residual, use_cell_residual, qk_activation, output_activation, first_step_mode)
    plan = scan_plan(step_keys, first_step_rows, True, eps, *flags)
    masks = ScanDropout(*dropout)
    forward_inputs = (cell, previous_raw, step_keys, step_values, output_shift, score_bias, masks)
    _, state = scan_forward(plan, *forward_inputs, tuple(weights))
    inputs = (cell, previous_raw, step_keys, step_values, output_shift, *weights)
    gradients = scan_backward(plan, state, tuple(weights), tuple(grads))
    # A weight the scan never reached (the cell GLU of a scan without residual steps) gets zeros, not None.
    return [
        tensor.new_zeros(tensor.shape) if gradient is None else gradient.contiguous()
        for tensor, gradient in zip(inputs, gradients)
        if tensor is not None
    ]


@_cell_scan_backward.register_fake
def _(grads, cell, previous_raw, step_keys, step_values, output_shift, score_bias, first_step_rows, dropout, weights,
      *plan):  # fmt: skip
    inputs = (cell, previous_raw, step_keys, step_values, output_shift, *weights)
    return [tensor.new_empty(tensor.shape) for tensor in inputs if tensor is not None]  # contiguous


def _setup_context(ctx, inputs, output):
    cell, previous_raw, step_keys, step_values, output_shift, score_bias, first_step_rows, dropout, weights, *plan = (
        inputs
    )
    ctx.plan = plan
    ctx.has_shift = output_shift is not None
    ctx.has_mask = [mask is not None for mask in dropout]
    ctx.has_weight = [weight is not None for weight in weights]
    ctx.save_for_backward(
        cell, previous_raw, step_keys, step_values, score_bias, first_step_rows,
        *([output_shift] if output_shift is not None else []),
        *(mask for mask in dropout if mask is not None), *(weight for weight in weights if weight is not None),
    )  # fmt: skip


def _backward(ctx, grad_read_keys, grad_read_values, grad_raw_cells, grad_cells):
    cell, previous_raw, step_keys, step_values, score_bias, first_step_rows, *present = ctx.saved_tensors
    num_steps, batch_size, num_heads, _, head_dim = step_keys.shape
    read_shape, cell_shape = (num_steps, batch_size, num_heads, head_dim), (num_steps, batch_size, cell.shape[-1])
    grads = [
        cell.new_zeros(shape) if grad is None else grad
        for grad, shape in zip(
            (grad_read_keys, grad_read_values, grad_raw_cells, grad_cells),
            (read_shape, read_shape, cell_shape, cell_shape),
        )
    ]
    present = iter(present)
    output_shift = next(present) if ctx.has_shift else None
    dropout = [next(present) if has else None for has in ctx.has_mask]
    weights = [next(present) if has else None for has in ctx.has_weight]
    inputs = (cell, previous_raw, step_keys, step_values, output_shift, score_bias, first_step_rows, dropout, weights)
    gradients = iter(_cell_scan_backward(grads, *inputs, *ctx.plan))
    grad_cell, grad_previous_raw, grad_keys, grad_values = (next(gradients) for _ in range(4))
    grad_shift = next(gradients) if ctx.has_shift else None
    grad_weights = [next(gradients) if has else None for has in ctx.has_weight]
    # The masks are constants. Their gradient takes the list's structure, but a list of Nones only is one leaf.
    no_grad_masks = [None] * len(ctx.has_mask) if any(ctx.has_mask) else None
    return (
        grad_cell, grad_previous_raw, grad_keys, grad_values, grad_shift, None, None, no_grad_masks, grad_weights,
        *(None for _ in ctx.plan),
    )  # fmt: skip


_cell_scan.register_autograd(_backward, setup_context=_setup_context)


def cell_scan_op(
    plan: ScanPlan, cell, previous_raw, step_keys, step_values, output_shift, score_bias, dropout, weights
):
    """`FusedCellScan.apply(plan, ...)` as the custom op: the same inputs and outputs."""
    residual = plan.first_step_residual
    if isinstance(residual, torch.Tensor):
        mode, rows = SOME_ROWS, residual
    else:
        mode, rows = (EVERY_ROW if residual else NO_ROW), cell.new_zeros(cell.shape[0], 1, dtype=torch.bool)
    return _cell_scan(
        cell,
        previous_raw,
        step_keys,
        step_values,
        output_shift,
        score_bias,
        rows,
        list(dropout),
        list(weights),
        plan.eps,
        plan.cell_input_residual,
        plan.use_cell_residual,
        plan.qk_activation,
        plan.output_activation,
        mode,
    )
