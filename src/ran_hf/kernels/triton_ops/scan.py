"""The cell scan in Triton: two kernels per window forward, two backward, whatever the layer's width.

`ran_hf.kernels.fused_scan` runs each window step as ~40 forward and ~56 backward PyTorch ops; on a GPU every one is a kernel
launch of a few microseconds around very little arithmetic. Here a step is two launches each way, each a
`torch.library.triton_op` (one op for `torch.compile`, export and a dispatch counter):

forward, step t:
  1. `project`  first the previous step's `write` (below), which every program computes for its rows: the row-wise
                norms, gates and residual that make the raw cell and the cell of step t - 1, and the input norm
                `normed` of the cell step t reads. Then one program per head: q, k, v of the cell (a matrix-vector
                product per sequence with `tl.dot`), their activation, then the head's attention over [the cell's
                own key; the window's slots] (online softmax, dropout on the weights). Further programs compute the
                two GLU projections (attention GLU of `normed`, cell GLU of the previous raw cell).
  2. `output`   the output projection of the attended heads, column blocks in parallel.
A `write` launch of its own starts the scan (the input norm of its first cell) and ends it (the last cell).
backward, step t in reverse: `attention_grad` (first the row-wise chain of `write` and the next step's input norm in
reverse, in every program for its rows; then per head: the output projection's transpose, the attention's backward,
the window slots' gradients), `input_grad` (the transposed input projections, column blocks in parallel); one
`write_grad` ends it (the gradients of the cell and raw cell the scan started from).

Repeating the row-wise work in every program costs a few sums over rows of the hidden size; a launch costs
microseconds whatever it does, and the step's launches wait on each other.

Weight gradients are sums over steps, taken after the loop by a few batched products, as in the fused scan.

It computes what `FusedCellScan` computes (same inputs, outputs, dropout masks) in float32, the matrix products in
IEEE float32 (`input_precision="ieee"`, no TF32). The kernels and their ops are in scan_forward.py and
scan_backward.py, their tiles in scan_tiles.py; `ran_hf.kernels.choice` imports them only where the scan runs
(`triton_scan_unsupported` says where it cannot).

Shapes: N scan steps, B batch, H heads, d head size, D hidden size, S window slots.
"""

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .scan_backward import scan_attention_grad, scan_input_grad, scan_write_grad
from .scan_forward import scan_output, scan_project, scan_write


def launchers(like: torch.Tensor, *ops):
    """How to launch each op's kernel: through the op where something watches ops (`torch.compile`, a dispatch mode
    such as a kernel counter or fake tensors, the meta device), else straight from Python: the custom op's dispatch
    costs about 20 us a launch, a third of the scan's time at batch 1 (benchmarks/cuda/tune_triton_scan.json)."""
    watched = torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None or like.is_meta
    return [op if watched else getattr(op, "_init_fn", op) for op in ops]


class _Absent:
    """Stand-ins for the tensors a kernel does not read or write under its flags: distinct one-element tensors (the
    kernels need a pointer), allocated, never computed."""

    def __init__(self, like: torch.Tensor):
        self.like = like

    def __call__(self, tensor=None):
        return self.like.new_empty(1) if tensor is None else tensor


def triton_scan_forward(plan, cell, previous_raw, step_keys, step_values, output_shift, score_bias, dropout, weights):
    """`fused_scan.scan_forward` in Triton kernels: the same inputs and outputs; the state is what
    `triton_scan_backward` reads (None without `plan.keep_for_backward`)."""

    num_steps, batch_size, num_heads, num_slots, head_dim = step_keys.shape
    hidden, eps = cell.shape[-1], plan.eps
    absent = _Absent(cell)
    has_glu, has_gate = plan.cell_input_residual, plan.use_cell_residual
    # The kernels index rows as contiguous: an expanded starting cell (one learned cell for every row) is not.
    cell, previous_raw, keys, values = (tensor.contiguous() for tensor in (cell, previous_raw, step_keys, step_values))
    output_shift = None if output_shift is None else output_shift.contiguous()
    weights = tuple(None if weight is None else weight.contiguous() for weight in weights)
    bias = score_bias.view(num_steps, batch_size, num_heads, 1 + num_slots)[:, :, 0, 1:].contiguous()  # (N, B, S)
    in_w, in_b, qkv_w, qkv_b, o_w, o_b, ag_w, ag_b, an_w, an_b, cg_w, cg_b, cn_w, cn_b = weights
    rows = residual_rows(plan, batch_size, cell)

    def buffer(*shape):
        return cell.new_empty(num_steps, batch_size, *shape)

    normed, normed_cells = buffer(hidden), buffer(hidden)
    qkv_pre, attended, out_pre = buffer(3 * num_heads * head_dim), buffer(num_heads * head_dim), buffer(hidden)
    query, read_keys, read_values = (buffer(num_heads, head_dim) for _ in range(3))
    raw_cells, cells = buffer(hidden), buffer(hidden)
    glu_pre, gated = (buffer(2 * hidden), buffer(hidden)) if has_glu else (None, None)
    gate_pre, joined = (buffer(2 * hidden), buffer(hidden)) if has_gate else (None, None)

    def at(tensor, step):
        return absent() if tensor is None else tensor[step]

    def write_of(step):
        """The tensors and flags of step `step`'s write (raw cell, cell, the next step's input norm); step -1: the
        input norm of the cell the scan starts from."""
        start, has_next = step < 0, step + 1 < num_steps

        def of_step(tensor):
            return absent() if start else at(tensor, step)

        tensors = (
            cell if start else out_pre[step], of_step(glu_pre), of_step(gate_pre), rows[min(max(step, 0), 1)],
            of_step(dropout.output), of_step(dropout.written), of_step(dropout.cell),
            at(dropout.input, step + 1) if has_next else absent(), absent(an_w), absent(an_b), absent(cn_w),
            absent(cn_b), in_w, in_b, of_step(raw_cells), of_step(cells), of_step(gated), of_step(joined),
            *((normed_cells[step + 1], normed[step + 1]) if has_next else (absent(), absent())),
        )  # fmt: skip
        flags = [
            plan.output_activation, has_glu, not start and step_has_gate(plan, step), has_next,
            not start and dropout.output is not None, not start and dropout.written is not None,
            not start and dropout.cell is not None, dropout.input is not None, start,
        ]  # fmt: skip
        return tensors, flags

    project, output, write = launchers(cell, scan_project, scan_output, scan_write)
    tensors, flags = write_of(-1)
    write(*tensors, eps, flags)
    for step in range(num_steps):
        # From the second step on, each step's projections launch first writes the previous step's cell.
        fused = step > 0
        write_tensors, write_flags = write_of(step - 1) if fused else ((absent(),) * 20, [False] * 9)
        project(
            absent() if fused else normed[step], absent() if fused else previous_raw, qkv_w, qkv_b, absent(ag_w),
            absent(ag_b), absent(cg_w), absent(cg_b), keys[step], values[step], bias[step], at(dropout.probs, step),
            qkv_pre[step], query[step], read_keys[step], read_values[step], attended[step], at(glu_pre, step),
            at(gate_pre, step), *write_tensors, eps,
            [plan.qk_activation, has_glu, step_has_gate(plan, step), dropout.probs is not None, fused,
             plan.output_activation, write_flags[2], *write_flags[4:8]],
        )  # fmt: skip
        output(attended[step], o_w, o_b, at(output_shift, step), out_pre[step], output_shift is not None)
    tensors, flags = write_of(num_steps - 1)
    write(*tensors, eps, flags)
    outputs = (read_keys, read_values, raw_cells, cells)
    if not plan.keep_for_backward:
        return outputs, None
    state = {
        "cell": cell, "previous_raw": previous_raw, "keys": keys, "values": values, "bias": bias, "rows": rows,
        "normed": normed, "normed_cells": normed_cells, "qkv_pre": qkv_pre, "query": query, "attended": attended,
        "out_pre": out_pre, "glu_pre": glu_pre, "gated": gated, "gate_pre": gate_pre, "joined": joined,
        "read_keys": read_keys, "read_values": read_values, "raw_cells": raw_cells, "cells": cells,
        "dropout": dropout,
    }  # fmt: skip
    return outputs, state


def residual_rows(plan, batch_size: int, like: torch.Tensor) -> torch.Tensor:
    """(2, B): 1.0 where a row of the first step, then of every later step, joins the previous raw cell."""
    rows = like.new_ones(2, batch_size)
    first = plan.first_step_residual
    if isinstance(first, torch.Tensor):
        rows[0] = first.view(batch_size).to(rows.dtype)
    elif not first:
        rows[0] = 0.0
    return rows


def step_has_gate(plan, step: int) -> bool:
    """Whether any row of step `step` joins the previous raw cell (its rows say which)."""
    return plan.use_cell_residual and (step > 0 or plan.first_step_residual is not False)


def triton_scan_backward(plan, state, weights, grads):
    """`fused_scan.scan_backward` in Triton kernels: the same gradients, in the same order."""

    in_w, in_b, qkv_w, qkv_b, o_w, o_b, ag_w, ag_b, an_w, an_b, cg_w, cg_b, cn_w, cn_b = weights
    cell, dropout, rows = state["cell"], state["dropout"], state["rows"]
    keys, qkv_pre = state["keys"], state["qkv_pre"]
    num_steps, batch_size, num_heads, num_slots, head_dim = keys.shape
    hidden, eps = cell.shape[-1], plan.eps
    has_glu, has_gate = plan.cell_input_residual, plan.use_cell_residual
    absent = _Absent(cell)
    read_shape, cell_shape = (num_steps, batch_size, num_heads, head_dim), (num_steps, batch_size, hidden)
    grad_read_keys, grad_read_values, grad_raw_cells, grad_cells = (
        cell.new_zeros(shape) if grad is None else grad.contiguous()
        for grad, shape in zip(grads, (read_shape, read_shape, cell_shape, cell_shape))
    )

    def buffer(*shape):
        return cell.new_empty(num_steps, batch_size, *shape)

    grad_input_norm, grad_out_pre = buffer(hidden), buffer(hidden)
    grad_qkv_pre = buffer(3 * num_heads * head_dim)
    grad_keys, grad_values = torch.empty_like(keys), torch.empty_like(keys)
    grad_written, grad_glu_pre = (buffer(hidden), buffer(2 * hidden)) if has_glu else (None, None)
    grad_update, grad_gate_pre = (buffer(hidden), buffer(2 * hidden)) if has_gate else (None, None)
    grad_attended = cell.new_empty(batch_size, num_heads, head_dim)
    grad_normed, grad_prev_raw = cell.new_empty(batch_size, hidden), cell.new_empty(batch_size, hidden)
    grad_cell, grad_previous_raw = cell.new_empty(batch_size, hidden), cell.new_empty(batch_size, hidden)
    masks = [dropout.output is not None, dropout.written is not None, dropout.cell is not None]
    has_input_mask = dropout.input is not None

    def at(tensor, step):
        return absent() if tensor is None else tensor[step]

    write_grad, attention_grad, input_grad = launchers(cell, scan_write_grad, scan_attention_grad, scan_input_grad)
    for step in reversed(range(num_steps)):
        last, gate_on = step == num_steps - 1, step_has_gate(plan, step)
        attention_grad(  # the step's row-wise backward, then its attention's
            o_w, qkv_pre[step], state["query"][step], state["read_keys"][step], state["read_values"][step],
            state["attended"][step], keys[step], state["values"][step], state["bias"][step], at(dropout.probs, step),
            grad_read_keys[step], grad_read_values[step], grad_attended, grad_qkv_pre[step], grad_keys[step],
            grad_values[step], grad_cells[step], grad_raw_cells[step], grad_normed, grad_prev_raw,
            absent() if last else at(dropout.input, step + 1), state["cells"][step], in_w, state["out_pre"][step],
            at(state["glu_pre"], step), at(state["gate_pre"], step), state["raw_cells"][step], rows[min(step, 1)],
            at(dropout.output, step), at(dropout.written, step), at(dropout.cell, step), absent(an_w), absent(an_b),
            absent(cn_w), absent() if last else grad_input_norm[step + 1], at(grad_update, step),
            at(grad_gate_pre, step), at(grad_written, step), at(grad_glu_pre, step), grad_out_pre[step], eps,
            [plan.qk_activation, dropout.probs is not None, last, has_gate and not last, plan.output_activation,
             has_glu, gate_on, *masks, has_input_mask],
        )  # fmt: skip
        input_grad(
            grad_qkv_pre[step], qkv_w, at(grad_glu_pre, step), absent(ag_w), at(grad_gate_pre, step), absent(cg_w),
            grad_normed, grad_prev_raw, has_glu, gate_on,
        )  # fmt: skip
    # What the scan started from: its cell (through step 0's input norm) and the raw cell step 0's GLU read.
    write_grad(
        absent(), absent(), grad_normed, grad_prev_raw, at(dropout.input, 0), cell, in_w, absent(), absent(),
        absent(), absent(), absent(), absent(), absent(), absent(), absent(), absent(), absent(), grad_input_norm[0],
        absent(), absent(), absent(), absent(), absent(), grad_cell, grad_previous_raw, eps,
        [False, True, step_has_gate(plan, 0), plan.output_activation, has_glu, False, *masks, has_input_mask],
    )  # fmt: skip

    # Sums over steps, one product each.
    def flat(tensor, start=0):
        return tensor[start:].flatten(0, 1)  # (N B, F)

    normed = flat(state["normed"])
    grad_qkv_flat = flat(grad_qkv_pre)
    grad_qkv_w, grad_qkv_b = torch.mm(grad_qkv_flat.t(), normed), grad_qkv_flat.sum(0)
    grad_input_flat = flat(grad_input_norm)
    grad_in_w, grad_in_b = (grad_input_flat * flat(state["normed_cells"])).sum(0), grad_input_flat.sum(0)
    grad_out_flat = flat(grad_out_pre)
    grad_o_w, grad_o_b = torch.mm(grad_out_flat.t(), flat(state["attended"])), grad_out_flat.sum(0)
    grad_ag_w = grad_ag_b = grad_an_w = grad_an_b = grad_cg_w = grad_cg_b = grad_cn_w = grad_cn_b = None
    if has_glu:
        grad_glu_flat, grad_written_flat = flat(grad_glu_pre), flat(grad_written)
        grad_ag_w, grad_ag_b = torch.mm(grad_glu_flat.t(), normed), grad_glu_flat.sum(0)
        grad_an_w, grad_an_b = (grad_written_flat * flat(state["gated"])).sum(0), grad_written_flat.sum(0)
    if has_gate and step_has_gate(plan, num_steps - 1):
        start = 0 if step_has_gate(plan, 0) else 1
        previous_raws = torch.cat([state["previous_raw"][None], state["raw_cells"][:-1]])
        grad_gate_flat, grad_update_flat = flat(grad_gate_pre, start), flat(grad_update, start)
        grad_cg_w, grad_cg_b = torch.mm(grad_gate_flat.t(), flat(previous_raws, start)), grad_gate_flat.sum(0)
        grad_cn_w, grad_cn_b = (grad_update_flat * flat(state["joined"], start)).sum(0), grad_update_flat.sum(0)
    return (
        grad_cell, grad_previous_raw, grad_keys, grad_values, grad_out_pre,
        grad_in_w, grad_in_b, grad_qkv_w, grad_qkv_b, grad_o_w, grad_o_b, grad_ag_w, grad_ag_b,
        grad_an_w, grad_an_b, grad_cg_w, grad_cg_b, grad_cn_w, grad_cn_b,
    )  # fmt: skip


TRITON_KERNELS = (triton_scan_forward, triton_scan_backward)
"""What `fused_scan.FusedCellScan` runs its steps with to be the Triton scan (`ScanPlan.kernels`)."""
