"""The fused and Triton cell scans attached to the model's (`cell_scan.cell_scan` in ran_hf/cell_scan.py, through
ran_hf/kernel_hub.py), and the layer-to-kernel adapter between them: the scans take tensors and plain weights, read
here from the layer's `CellScanWeights` and the scan module's own.

`choose_cell_scan` gives the scan `config.scan_implementation` asks for where it can run (`choice.choose("scan", ...)`
says which, and why not, once), or None: the model's reference scan (or, under `torch.export`, its `scan` operator
form). Each scan has the signature of the model's, `scan(cell_scan, weights, cell, previous_raw, keys, values,
layout)`, and returns its four outputs as a tuple.
"""

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from ..scan_inputs import draw_scan_dropout, window_maxima
from .choice import choose, kernel_build_errors, record_build_failure
from .fused_scan import FusedCellScan, ScanPlan, scan_forward
from .scan_op import cell_scan_op


def choose_cell_scan(scan, weights, cell, previous_raw, keys, values, layout):
    """The fused or Triton scan where `choice.choose` picks it for this scan module and these inputs, else None."""
    name = choose("scan", scan.config.scan_implementation, scan.hidden_act, scan.modules_read(weights), cell)
    return KERNEL_SCANS.get(name)


def fused_cell_scan(scan, weights, cell, previous_raw, keys, values, layout) -> tuple:
    """`reference_cell_scan`'s results from one autograd node with a hand-written backward (fused_scan.py), for a
    SiLU layer whose modules are plain (`choice.fused_scan_unsupported`). It computes in float32 whatever the
    inputs' dtype and autocast; under `torch.compile` as one custom op (scan_op.py)."""
    return fused_scan(scan, weights, cell, previous_raw, *layout.step_major(keys, values), layout)


def triton_cell_scan(scan, weights, cell, previous_raw, keys, values, layout) -> tuple:
    """`fused_cell_scan` with each window's steps in Triton kernels: two launches per window forward and two backward
    (triton_ops/scan.py), plus three per scan (a `write` at each end of the forward, a `write_grad` ending the
    backward): in a training step, 4 per window and layer plus 3 per layer (tests/test_kernel_budget.py). The kernels
    are built on their first launch: where they cannot be for this GPU, the scan module runs again, and from now on
    `choose` gives the fused scan, saying why."""
    from .triton_ops.scan import TRITON_KERNELS

    try:
        return fused_scan(scan, weights, cell, previous_raw, *layout.step_major(keys, values), layout, TRITON_KERNELS)
    except kernel_build_errors() as error:
        record_build_failure(error)
        return scan(weights, cell, previous_raw, keys, values, layout)


def fused_scan(scan, weights, cell, previous_raw, step_keys, step_values, step_mask, layout, kernels=None):
    """Run `FusedCellScan` for the scan `scan` with its own modules and the layer's `weights`, its steps computed by
    `kernels` (a forward and a backward function with `scan_forward`'s and `scan_backward`'s signatures, such as the
    Triton scan's) or by fused_scan.py's: the step-major slots (N, B, H, S, d) and their mask (N, B, S) as in the
    reference scan. Returns what `reference_cell_scan` returns, as a tuple."""
    num_heads = scan.num_heads
    num_steps, batch_size = step_mask.shape[:2]
    first_step_residual = False
    if scan.use_cell_residual:
        if layout.continued_rows == batch_size:
            first_step_residual = True
        elif layout.continued_rows > 0:
            first_step_residual = layout.first_window[:, None] > 0  # (B, 1)
    plan = ScanPlan(
        num_steps=num_steps,
        num_heads=num_heads,
        head_dim=scan.head_dim,
        eps=scan.eps,
        cell_input_residual=scan.cell_input_residual,
        use_cell_residual=scan.use_cell_residual,
        qk_activation=scan.qk_activation,
        output_activation=scan.output_activation,
        first_step_residual=first_step_residual,
        keep_for_backward=torch.is_grad_enabled(),
        kernels=kernels,
    )
    # Float32 (float64 if the cell is) whatever the inputs and autocast say: the cell is a running state, written
    # once per window from the one before, and its standardisations divide by a mean of squares.
    compute_dtype = torch.float64 if cell.dtype == torch.float64 else torch.float32
    visible = F.pad(step_mask, (1, 0), value=True)  # (N, B, 1 + S): the cell's own key is always visible
    score_bias = torch.zeros(visible.shape, dtype=compute_dtype, device=cell.device)
    score_bias = score_bias.masked_fill_(~visible, float("-inf"))
    score_bias = score_bias[:, :, None, None].expand(-1, -1, num_heads, 1, -1).flatten(1, 2)  # (N, B H, 1, 1 + S)
    attention_glu = None if weights.attention_glu is None else weights.attention_glu.proj
    cell_glu, cell_norm = (scan.cell_glu.proj, scan.cell_norm) if scan.use_cell_residual else (None, None)
    modules = (weights.input_norm, weights.qkv_proj, weights.o_proj, attention_glu, weights.attention_norm, cell_glu,
               cell_norm)  # fmt: skip
    # The 14 weights, read from the plain modules' parameter tables (`choice.fused_scan_unsupported` checked
    # them: no subclass, no hook): `nn.Module.__getattr__` would be a Python call for each. (A list, not a generator,
    # on this per-call path: a generator is re-entered for every item.)
    pairs = [(None, None) if m is None else (m._parameters["weight"], m._parameters["bias"]) for m in modules]
    plain = tuple([None if tensor is None else tensor.to(compute_dtype) for pair in pairs for tensor in pair])
    dropout = draw_scan_dropout(scan, num_steps, batch_size, step_keys.shape[-2], compute_dtype, cell.device)
    output_shift = None
    if scan.cell_max_pool:  # the reference adds the maxima before `o_proj`: the same, by linearity
        maxima = window_maxima(step_values, step_mask).flatten(-2).to(compute_dtype)  # (N, B, H d)
        output_shift = torch.mm(maxima.flatten(0, 1), plain[4].t()).view(num_steps, batch_size, -1)
    inputs = tuple([tensor.to(compute_dtype) for tensor in (cell, previous_raw, step_keys, step_values)])
    # (the meta device, which checks shapes and counts kernels, has no autocast to switch off)
    device = cell.device.type
    with torch.autocast(device, enabled=False) if device != "meta" else nullcontext():
        if torch.compiler.is_compiling():
            # One opaque op for dynamo: the steps are not unrolled into the graph, whose shapes then follow the
            # number of windows instead of being rebuilt for each one.
            outputs = cell_scan_op(plan, *inputs, output_shift, score_bias, dropout, plain)
        elif not plan.keep_for_backward:  # no graph to record: the steps without the autograd node around them
            forward_steps = scan_forward if kernels is None else kernels[0]
            outputs = forward_steps(plan, *inputs, output_shift, score_bias, dropout, plain)[0]
        else:
            outputs = FusedCellScan.apply(plan, *inputs, output_shift, score_bias, dropout, *plain)
    # The cells keep the dtype of the cell read (float32 under autocast); the keys and values that of the tokens'.
    dtypes = (step_keys.dtype, step_values.dtype, cell.dtype, cell.dtype)
    return tuple([output.to(dtype) for output, dtype in zip(outputs, dtypes)])


KERNEL_SCANS = {"fused": fused_cell_scan, "triton": triton_cell_scan}
