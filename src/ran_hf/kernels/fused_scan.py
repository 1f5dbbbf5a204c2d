"""The fused cell scan: the reference scan's maths as one autograd node, with a hand-written backward.

`reference_cell_scan` (ran_hf/cell_scan.py) lets autograd record every small op of every window: about a hundred nodes per
window and layer, each a dispatch on the CPU and a kernel launch on a GPU. This scan computes the same steps with
fewer, larger ops (one matmul for the queries, keys, values and the gated residual, one `baddbmm` for the scores of
the cell and all slots, aten's own `silu`/`glu`/softmax backward kernels) and records one node for the whole scan.
Its forward loop keeps the few (B, D)-sized tensors each step's backward reads; the backward loop runs the steps in
reverse and leaves every weight gradient, and the gradients of the window keys and values, to a few batched
products over all steps once the loop is done.

It computes what `reference_cell_scan` computes for a layer whose activation is SiLU, dropout included: both read
the same masks, drawn before the scan (ran_hf/scan_inputs.py). It takes tensors and plain weights; `cell_scan.fused_scan`
(in this folder) reads them from the layer's `CellScanWeights` and the scan's own modules, and `choice.choose` runs the
reference instead where the activation is not SiLU or a module is wrapped (warning once). It computes in float32 (float64 for a
float64 cell) whatever the inputs' dtype, autocast included. Double backward is not supported. Under `torch.compile`
the same maths run as one custom op (scan_op.py).

Shapes: N scan steps, B batch, H heads, d head size, D hidden size, S window slots.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from ..scan_inputs import NO_DROPOUT, drop


@dataclass
class ScanPlan:
    """What shapes one fused scan besides its tensors."""

    num_steps: int
    num_heads: int
    head_dim: int
    eps: float
    cell_input_residual: bool  # the raw cell is finish_attention(...) (else SN(act(o_proj(...))))
    use_cell_residual: bool
    qk_activation: bool  # whether queries and keys are activated (values always are)
    output_activation: bool  # whether the output projection that writes the cell is activated
    first_step_residual: torch.Tensor | bool  # (B, 1) rows whose first step has a residual, or all / none of them
    keep_for_backward: bool  # whether the forward keeps what the backward reads (not under no_grad)
    # The functions that run the steps, forward and backward: this file's PyTorch ones, or the Triton scan's
    # (triton_ops/scan.py), which take and return the same. None: this file's.
    kernels: tuple | None = None

    def has_residual(self, step: int):
        """Whether step `step` joins the previous raw cell: False, True, or a (B, 1) mask of rows."""
        if not self.use_cell_residual:
            return False
        return True if step > 0 else self.first_step_residual


def activate_projections(qkv_pre: torch.Tensor, plan: ScanPlan) -> torch.Tensor:
    """(B, 3 H d) projections -> queries, keys and values, activated as the layer's `project` does."""
    if plan.qk_activation:
        return F.silu(qkv_pre)
    query_key, value = qkv_pre.split([2 * qkv_pre.shape[-1] // 3, qkv_pre.shape[-1] // 3], dim=-1)
    return torch.cat([query_key, F.silu(value)], dim=-1)


def activate_projections_backward(grad: torch.Tensor, qkv_pre: torch.Tensor, plan: ScanPlan) -> torch.Tensor:
    if plan.qk_activation:
        return torch.ops.aten.silu_backward(grad, qkv_pre)
    values = slice(2 * qkv_pre.shape[-1] // 3, None)
    grad = grad.clone()
    grad[:, values] = torch.ops.aten.silu_backward(grad[:, values], qkv_pre[:, values])
    return grad


def standardize(states: torch.Tensor, eps: float):
    """SN(x) = (x - mean(x)) / sqrt(mean(x^2) + eps) over the last axis, and what its backward reads."""
    var, mean = torch.var_mean(states, -1, correction=0, keepdim=True)
    rstd = torch.rsqrt(torch.addcmul(var, mean, mean).add_(eps))  # 1 / sqrt(mean(x^2) + eps), (B, 1)
    scaled = states * rstd  # x / sqrt(mean(x^2) + eps)
    normed = torch.addcmul(scaled, mean, rstd, value=-1)
    return normed, (scaled, normed, rstd)


def standardize_backward(grad: torch.Tensor, saved, add_to: torch.Tensor | None = None) -> torch.Tensor:
    """d SN(x) / dx applied to `grad`, rstd * (g - mean(g) - scaled * mean(g * normed)), plus `add_to` if given."""
    scaled, normed, rstd = saved
    centred = grad - grad.mean(-1, keepdim=True)
    centred = torch.addcmul(centred, scaled, (grad * normed).mean(-1, keepdim=True), value=-1)
    return centred.mul_(rstd) if add_to is None else torch.addcmul(add_to, centred, rstd)


def heads_first(mask: torch.Tensor | None, *steps: int) -> torch.Tensor | None:
    """An attention-weight mask (..., B, H, 1 + S) in the scan's layout, (..., B H, 1, 1 + S)."""
    return None if mask is None else mask.reshape(*steps, -1, 1, mask.shape[-1])


class SavedStep(NamedTuple):
    """What the backward of one scan step reads, (B, ...) tensors; (B H, ...) for the attention."""

    input_norm: tuple  # `standardize` of the cell read
    normed_cell: torch.Tensor  # SN(cell)
    normed: torch.Tensor  # input LayerNorm(cell), the input projection's input
    qkv_pre: torch.Tensor  # (B, 3 H d) queries, keys, values before the activation
    glu_pre: torch.Tensor | None  # (B, 2 D) the attention GLU's projection, with the cell's input residual
    query: torch.Tensor  # (B H, 1, d)
    probs: torch.Tensor  # (B H, 1, 1 + S), before dropout
    attended: torch.Tensor  # (B, H d)
    output_pre: torch.Tensor  # o_proj(attended), before the activation
    gated_norm: tuple | None  # `standardize` of output + GLU(normed)
    normed_gated: torch.Tensor | None
    raw_norm: tuple  # `standardize` that writes the raw cell
    previous_raw: torch.Tensor | None  # the residual's input, when the step has one
    cell_gate: torch.Tensor | None  # (B, 2 D) the cell GLU's projection
    joined_norm: tuple | None  # `standardize` of raw + GLU_cell(previous_raw)


class FusedCellScan(torch.autograd.Function):
    """The whole scan as one autograd node. Inputs after the plan:

    cell, previous_raw (B, D); step_keys, step_values (N, B, H, S, d) the slots each step reads; output_shift
    (N, B, D) or None, added to each step's output projection (the projected window maxima of `cell_max_pool`,
    whose own gradients autograd takes outside); score_bias
    (N, B * H, 1, 1 + S) 0 where a key is visible, -inf where masked (key 0 is the cell's own); the `ScanDropout`
    masks; then the weights:
    input norm, qkv_proj, o_proj, and (or None) attention GLU and attention norm (with the cell's input residual),
    cell GLU and cell norm (with the cell residual): each its weight and bias. Returns read keys, read values
    (N, B, H, d), raw cells and cells (N, B, D).
    """

    @staticmethod
    def forward(
        ctx, plan: ScanPlan, cell, previous_raw, step_keys, step_values, output_shift, score_bias, dropout, *weights
    ):
        inputs = (cell, previous_raw, step_keys, step_values, output_shift, score_bias, dropout)
        forward_steps = scan_forward if plan.kernels is None else plan.kernels[0]
        outputs, state = forward_steps(plan, *inputs, weights)
        if plan.keep_for_backward:
            # Through `save_for_backward`, so that the saved tensors are freed after the backward pass.
            tensors, ctx.structure = pytree.tree_flatten((state, weights))
            ctx.save_for_backward(*tensors)
            ctx.plan = plan
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_read_keys, grad_read_values, grad_raw_cells, grad_cells):
        state, weights = pytree.tree_unflatten(ctx.saved_tensors, ctx.structure)
        grads = (grad_read_keys, grad_read_values, grad_raw_cells, grad_cells)
        backward_steps = scan_backward if ctx.plan.kernels is None else ctx.plan.kernels[1]
        grad_cell, grad_previous_raw, grad_keys, grad_values, grad_shift, *grad_weights = backward_steps(
            ctx.plan, state, weights, grads
        )
        grad_shift = grad_shift if ctx.needs_input_grad[5] else None
        return None, grad_cell, grad_previous_raw, grad_keys, grad_values, grad_shift, None, None, *grad_weights


def scan_forward(
    plan: ScanPlan, cell, previous_raw, step_keys, step_values, output_shift, score_bias, dropout, weights
):
    """The scan's forward steps (`FusedCellScan`'s inputs, the 14 weights as one tuple). Returns its four outputs
    and, with `plan.keep_for_backward`, what `scan_backward` reads (else None)."""
    in_w, in_b, qkv_w, qkv_b, o_w, o_b, ag_w, ag_b, an_w, an_b, cg_w, cg_b, cn_w, cn_b = weights
    num_steps, batch_size, num_heads, num_slots, head_dim = step_keys.shape
    heads, eps = batch_size * num_heads, plan.eps
    # Keys and values of every step with a free slot 0 for the cell's own, filled as the scan reaches it.
    key_buffer = torch.constant_pad_nd(step_keys, (0, 0, 1, 0)).view(num_steps, heads, 1 + num_slots, head_dim)
    value_buffer = torch.constant_pad_nd(step_values, (0, 0, 1, 0)).view(num_steps, heads, 1 + num_slots, head_dim)
    keys_t, values_all = key_buffer.transpose(-1, -2).unbind(0), value_buffer.unbind(0)
    key_slots, value_slots = key_buffer[:, :, :1].unbind(0), value_buffer[:, :, :1].unbind(0)
    biases = score_bias.unbind(0)
    qkv_wt, o_wt = qkv_w.t(), o_w.t()
    ag_wt, cg_wt = [None if weight is None else weight.t() for weight in (ag_w, cg_w)]

    read_keys, read_values, raw_cells, cells, saved = [], [], [], [], []
    masks, first_residual = dropout, plan.has_residual(0)
    # (The dropout masks are applied inline, not by `drop`: in inference its calls were a third of the loop's.)
    for step in range(num_steps):
        if dropout is not NO_DROPOUT:
            masks = dropout.step(step)
        normed_cell, input_norm = standardize(cell, eps)
        normed = torch.addcmul(in_b, normed_cell, in_w)  # (B, D)
        normed = normed if masks.input is None else normed * masks.input
        qkv_pre = torch.addmm(qkv_b, normed, qkv_wt)  # (B, 3 H d)
        qkv = activate_projections(qkv_pre, plan).view(batch_size, 3, num_heads, head_dim).transpose(1, 2)
        query, key, value = qkv.reshape(heads, 3, 1, head_dim).unbind(1)  # (B H, 1, d) each
        key_slots[step].copy_(key)
        value_slots[step].copy_(value)
        scores = torch.baddbmm(biases[step], query, keys_t[step], alpha=head_dim**-0.5)  # (B H, 1, 1 + S)
        probs = torch.softmax(scores, dim=-1)
        dropped = probs if masks.probs is None else probs * heads_first(masks.probs)
        attended = torch.bmm(dropped, values_all[step]).view(batch_size, -1)  # (B, H d)
        output_pre = torch.addmm(o_b, attended, o_wt)  # (B, D)
        if output_shift is not None:
            output_pre = output_pre + output_shift[step]
        output = F.silu(output_pre) if plan.output_activation else output_pre
        output = output if masks.output is None else output * masks.output
        glu_pre = normed_gated = gated_norm = None
        if plan.cell_input_residual:
            glu_pre = torch.addmm(ag_b, normed, ag_wt)  # (B, 2 D)
            normed_gated, gated_norm = standardize(output + F.glu(glu_pre, dim=-1), eps)
            raw, raw_norm = standardize(torch.addcmul(an_b, normed_gated, an_w), eps)  # (B, D)
        else:
            raw, raw_norm = standardize(output, eps)
        raw = raw if masks.written is None else raw * masks.written
        residual = plan.use_cell_residual if step > 0 else first_residual
        residual_input = cell_gate = joined_norm = None
        if residual is False:
            new_cell = raw
        else:
            residual_input = previous_raw
            cell_gate = torch.addmm(cg_b, previous_raw, cg_wt)  # (B, 2 D)
            normed_joined, joined_norm = standardize(raw + F.glu(cell_gate, dim=-1), eps)
            new_cell = torch.addcmul(cn_b, normed_joined, cn_w)
            new_cell = new_cell if masks.cell is None else new_cell * masks.cell
            if residual is not True:
                new_cell = torch.where(residual, new_cell, raw)
        if plan.keep_for_backward:
            saved.append(
                SavedStep(input_norm, normed_cell, normed, qkv_pre, glu_pre, query, probs, attended, output_pre,
                          gated_norm, normed_gated, raw_norm, residual_input, cell_gate, joined_norm)
            )  # fmt: skip
        read_keys.append(key)
        read_values.append(value)
        raw_cells.append(raw)
        cells.append(new_cell)
        cell, previous_raw = new_cell, raw

    stacked_keys = torch.stack(read_keys).view(num_steps, batch_size, num_heads, head_dim)
    stacked_values = torch.stack(read_values).view(num_steps, batch_size, num_heads, head_dim)
    state = (saved, key_buffer, value_buffer, dropout) if plan.keep_for_backward else None
    return (stacked_keys, stacked_values, torch.stack(raw_cells), torch.stack(cells)), state


def scan_backward(plan: ScanPlan, state, weights, grads):
    """The scan's backward: `state` from `scan_forward`, `grads` those of its four outputs. Returns the gradients of
    cell, previous_raw, step_keys, step_values, the output shift (N, B, D) and the 14 weights (None for absent
    ones)."""
    saved, key_buffer, value_buffer, dropout = state
    grad_read_keys, grad_read_values, grad_raw_cells, grad_cells = grads
    in_w, in_b, qkv_w, qkv_b, o_w, o_b, ag_w, ag_b, an_w, an_b, cg_w, cg_b, cn_w, cn_b = weights
    num_steps, num_heads, head_dim = plan.num_steps, plan.num_heads, plan.head_dim
    batch_size = grad_cells.shape[1]
    heads, qkv_size, scale = batch_size * num_heads, 3 * num_heads * head_dim, head_dim**-0.5
    keys_all, values_t = key_buffer.unbind(0), value_buffer.transpose(-1, -2).unbind(0)
    grad_read_keys = grad_read_keys.reshape(num_steps, heads, 1, head_dim).unbind(0)
    grad_read_values = grad_read_values.reshape(num_steps, heads, 1, head_dim).unbind(0)
    grad_raw_cells, grad_cells = grad_raw_cells.unbind(0), grad_cells.unbind(0)

    # Per step (in reverse), what the weight and slot gradients are summed from once the loop is done.
    grad_qkv_pre, grad_glu_pre, grad_normed, grad_output_pre, grad_scores, grad_attended = [], [], [], [], [], []
    grad_written = []
    grad_gates, grad_updated = [], []
    grad_cell, grad_raw = grad_cells[-1], grad_raw_cells[-1]  # what reaches step's cell and raw cell
    grad_previous_raw = None
    for step in reversed(range(num_steps)):
        saved_step, masks = saved[step], dropout.step(step)
        # The cell update: cell = LN_cell(raw + GLU_cell(previous_raw)), or cell = raw.
        residual = plan.has_residual(step)
        if residual is False:
            grad_raw = grad_raw + grad_cell
            grad_raw_before = None if step == 0 else grad_raw_cells[step - 1]
        else:
            grad_update = grad_cell if residual is True else torch.where(residual, grad_cell, 0.0)
            if residual is not True:
                grad_raw = grad_raw + (grad_cell - grad_update)
            grad_update = drop(grad_update, masks.cell)
            grad_joined = standardize_backward(grad_update * cn_w, saved_step.joined_norm)  # (B, D)
            grad_gate = torch.ops.aten.glu_backward(grad_joined, saved_step.cell_gate, -1)  # (B, 2 D)
            if step == 0:  # the previous raw cell is the scan's `previous_raw` input
                grad_raw_before = grad_previous_raw = torch.mm(grad_gate, cg_w)
            else:
                grad_raw_before = torch.addmm(grad_raw_cells[step - 1], grad_gate, cg_w)
            grad_raw = grad_raw + grad_joined
            grad_gates.append(grad_gate)
            grad_updated.append(grad_update)

        # Writing the raw cell.
        grad_raw = standardize_backward(drop(grad_raw, masks.written), saved_step.raw_norm)
        if plan.cell_input_residual:
            grad_written.append(grad_raw)
            grad_raw = standardize_backward(grad_raw * an_w, saved_step.gated_norm)  # (B, D)
            grad_glu = torch.ops.aten.glu_backward(grad_raw, saved_step.glu_pre, -1)  # (B, 2 D)
        grad_pre = drop(grad_raw, masks.output)  # (B, D)
        if plan.output_activation:
            grad_pre = torch.ops.aten.silu_backward(grad_pre, saved_step.output_pre)
        grad_att = torch.mm(grad_pre, o_w).view(heads, 1, head_dim)

        # Attention of the cell over [its own key; the window's slots].
        probs, probs_mask = saved_step.probs, heads_first(masks.probs)
        grad_probs = drop(torch.bmm(grad_att, values_t[step]), probs_mask)  # (B H, 1, 1 + S)
        grad_score = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype).mul_(scale)
        probs = drop(probs, probs_mask)  # what the values were weighted by
        grad_query = torch.bmm(grad_score, keys_all[step])  # (B H, 1, d)
        grad_key = torch.addcmul(grad_read_keys[step], grad_score[..., :1], saved_step.query)
        grad_value = torch.addcmul(grad_read_values[step], probs[..., :1], grad_att)
        per_head = (batch_size, num_heads, head_dim)
        grad_qkv = torch.stack([grad_query.view(per_head), grad_key.view(per_head), grad_value.view(per_head)], 1)
        grad_qkv = activate_projections_backward(grad_qkv.view(batch_size, qkv_size), saved_step.qkv_pre, plan)
        if plan.cell_input_residual:
            grad_input = torch.addmm(torch.mm(grad_glu, ag_w), grad_qkv, qkv_w)  # (B, D)
            grad_glu_pre.append(grad_glu)
        else:
            grad_input = torch.mm(grad_qkv, qkv_w)
        grad_input = drop(grad_input, masks.input)  # now that of the input norm's output
        grad_cell_before = None if step == 0 else grad_cells[step - 1]
        grad_cell = standardize_backward(grad_input * in_w, saved_step.input_norm, add_to=grad_cell_before)
        grad_raw = grad_raw_before

        grad_qkv_pre.append(grad_qkv)
        grad_normed.append(grad_input)
        grad_output_pre.append(grad_pre)
        grad_scores.append(grad_score)
        grad_attended.append(grad_att)

    # Everything that is a sum over steps, in one product each. The lists above are in reverse step order.
    def flat(tensors, reverse=True):
        return torch.stack(tensors[::-1] if reverse else tensors).flatten(0, -2)  # (N B, F) in step order

    def saved_flat(name):
        return flat([getattr(saved_step, name) for saved_step in saved], reverse=False)

    normed = saved_flat("normed")  # (N B, D)
    grad_qkv_pre = flat(grad_qkv_pre)  # (N B, 3 H d)
    grad_qkv_w, grad_qkv_b = torch.mm(grad_qkv_pre.t(), normed), grad_qkv_pre.sum(0)
    grad_normed = flat(grad_normed)
    grad_in_w, grad_in_b = (grad_normed * saved_flat("normed_cell")).sum(0), grad_normed.sum(0)
    grad_output_pre = flat(grad_output_pre)
    grad_o_w, grad_o_b = torch.mm(grad_output_pre.t(), saved_flat("attended")), grad_output_pre.sum(0)
    grad_ag_w = grad_ag_b = grad_an_w = grad_an_b = None
    if plan.cell_input_residual:
        grad_glu_pre = flat(grad_glu_pre)  # (N B, 2 D)
        grad_ag_w, grad_ag_b = torch.mm(grad_glu_pre.t(), normed), grad_glu_pre.sum(0)
        grad_written = flat(grad_written)
        grad_an_w, grad_an_b = (grad_written * saved_flat("normed_gated")).sum(0), grad_written.sum(0)
    grad_cg_w = grad_cg_b = grad_cn_w = grad_cn_b = None
    if grad_gates:
        residual_steps = [saved_step for saved_step in saved if saved_step.cell_gate is not None]
        grad_gates, grad_updated = flat(grad_gates), flat(grad_updated)
        previous_raws = flat([saved_step.previous_raw for saved_step in residual_steps], reverse=False)
        normed_joined = flat([saved_step.joined_norm[1] for saved_step in residual_steps], reverse=False)
        grad_cg_w, grad_cg_b = torch.mm(grad_gates.t(), previous_raws), grad_gates.sum(0)
        grad_cn_w, grad_cn_b = (grad_updated * normed_joined).sum(0), grad_updated.sum(0)

    # The window slots: every step's score and value gradients at once (outer products), without slot 0, the
    # cell's own.
    grad_scores = torch.stack(grad_scores[::-1])[:, :, 0, 1:, None]  # (N, B H, S, 1)
    probs = drop(torch.stack([saved_step.probs for saved_step in saved]), heads_first(dropout.probs, num_steps))
    probs = probs[:, :, 0, 1:, None]  # (N, B H, S, 1)
    queries = torch.stack([saved_step.query for saved_step in saved])  # (N, B H, 1, d)
    grad_attended = torch.stack(grad_attended[::-1])  # (N, B H, 1, d)
    slot_shape = (num_steps, batch_size, num_heads, -1, head_dim)
    grad_step_keys = (grad_scores * queries).view(slot_shape)  # (N, B, H, S, d)
    grad_step_values = (probs * grad_attended).view(slot_shape)

    grad_output_shift = grad_output_pre.view(num_steps, batch_size, -1)  # (N, B, D)
    return (
        grad_cell, grad_previous_raw, grad_step_keys, grad_step_values, grad_output_shift,
        grad_in_w, grad_in_b, grad_qkv_w, grad_qkv_b, grad_o_w, grad_o_b, grad_ag_w, grad_ag_b,
        grad_an_w, grad_an_b, grad_cg_w, grad_cg_b, grad_cn_w, grad_cn_b,
    )  # fmt: skip
