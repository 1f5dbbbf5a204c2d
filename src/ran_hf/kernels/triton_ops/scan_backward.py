"""The Triton scan's backward kernels and the ops that launch them: `attention_grad`, `input_grad` and `write_grad`
(scan.py runs them step by step in reverse and says what each computes).

Shapes: N scan steps, B batch, H heads, d head size, D hidden size, S window slots.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from . import register_meta_no_ops
from . import scan_tiles as tiles
from .scan_forward import _rows_times, _sigmoid, _silu_grad, _standardize


@triton.jit
def _standardize_grad(grad, x, ok, D, eps):
    """The gradient of SN at x, applied to `grad`: rstd (g - mean(g) - x rstd mean(g SN(x)))."""
    x = tl.where(ok, x, 0.0)
    normed, rstd = _standardize(x, ok, D, eps)
    grad = tl.where(ok, grad, 0.0)
    mean_grad = tl.sum(grad, 0) / D
    mean_product = tl.sum(grad * normed, 0) / D
    return tl.where(ok, rstd * (grad - mean_grad - x * rstd * mean_product), 0.0)


@triton.jit
def _write_grad_rows(
    first_row, last_row, keep_all,
    grad_cells, grad_raw_cells, grad_normed_next, grad_prev_raw_next, next_input_mask, read_cell, in_w,
    out_pre, glu_pre, gate_pre, raw, residual_rows, output_mask, written_mask, cell_mask, an_w, an_b, cn_w,
    grad_input_norm_out, grad_update_out, grad_gate_pre_out, grad_written_out, grad_glu_pre_out, grad_out_pre_out,
    grad_cell_out, grad_raw_out, D, eps,
    LAST: tl.constexpr, FIRST: tl.constexpr, NEXT_GATE: tl.constexpr,
    OUTPUT_ACT: tl.constexpr, HAS_GLU: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_OUTPUT_MASK: tl.constexpr, HAS_WRITTEN_MASK: tl.constexpr, HAS_CELL_MASK: tl.constexpr,
    HAS_INPUT_MASK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows [first_row, last_row) of step t's row-wise backward, after finishing step t + 1's (its input norm,
    reading `read_cell`, the cell of step t). FIRST: only that finish, for the cell and raw cell the scan started
    from. The output projection's gradient, which the attention's backward reads, is always stored; the rest
    only where `keep_all` (one program of a launch that computes the same rows in every program)."""
    i = tl.arange(0, BLOCK_D)
    ok = i < D
    kept = tl.where(keep_all, ok, False)
    for b in range(first_row, last_row):
        row = b * D + i
        grad_cell = tl.zeros((BLOCK_D,), dtype=tl.float32)
        grad_raw = tl.zeros((BLOCK_D,), dtype=tl.float32)
        if not FIRST:
            grad_cell += tl.load(grad_cells + row, mask=ok, other=0.0)
            grad_raw += tl.load(grad_raw_cells + row, mask=ok, other=0.0)
        if not LAST:  # step t + 1 read this cell through its input norm, and this raw cell through its cell GLU
            grad_normed = tl.load(grad_normed_next + row, mask=ok, other=0.0)
            if HAS_INPUT_MASK:
                grad_normed *= tl.load(next_input_mask + row, mask=ok, other=0.0)
            tl.store(grad_input_norm_out + row, grad_normed, mask=kept)
            cell = tl.load(read_cell + row, mask=ok, other=0.0)
            grad_cell += _standardize_grad(grad_normed * tl.load(in_w + i, mask=ok, other=0.0), cell, ok, D, eps)
            if NEXT_GATE:
                grad_raw += tl.load(grad_prev_raw_next + row, mask=ok, other=0.0)
        if FIRST:
            tl.store(grad_cell_out + row, grad_cell, mask=kept)
            tl.store(grad_raw_out + row, grad_raw, mask=kept)
        else:
            raw_cell = tl.load(raw + row, mask=ok, other=0.0)
            if HAS_GATE:
                has_residual = tl.load(residual_rows + b) > 0
                grad_update = tl.where(has_residual, grad_cell, 0.0)
                grad_raw += tl.where(has_residual, 0.0, grad_cell)
                if HAS_CELL_MASK:
                    grad_update *= tl.load(cell_mask + row, mask=ok, other=0.0)
                tl.store(grad_update_out + row, grad_update, mask=kept)
                value = tl.load(gate_pre + b * 2 * D + i, mask=ok, other=0.0)
                gate = tl.load(gate_pre + b * 2 * D + D + i, mask=ok, other=0.0)
                sigmoid = _sigmoid(gate)
                grad_joined = _standardize_grad(grad_update * tl.load(cn_w + i, mask=ok, other=0.0),
                                                raw_cell + value * sigmoid, ok, D, eps)  # fmt: skip
                tl.store(grad_gate_pre_out + b * 2 * D + i, grad_joined * sigmoid, mask=kept)
                grad_gate = grad_joined * value * sigmoid * (1.0 - sigmoid)
                tl.store(grad_gate_pre_out + b * 2 * D + D + i, grad_gate, mask=kept)
                grad_raw += grad_joined
            else:
                grad_raw += grad_cell
            if HAS_WRITTEN_MASK:
                grad_raw *= tl.load(written_mask + row, mask=ok, other=0.0)
            # Recompute what the raw cell was standardised from.
            output_pre = tl.load(out_pre + row, mask=ok, other=0.0)
            output = output_pre
            if OUTPUT_ACT:
                output = output_pre * _sigmoid(output_pre)
            output_keep = tl.full((BLOCK_D,), 1.0, tl.float32)
            if HAS_OUTPUT_MASK:
                output_keep = tl.load(output_mask + row, mask=ok, other=0.0)
            output *= output_keep
            written = output
            if HAS_GLU:
                value = tl.load(glu_pre + b * 2 * D + i, mask=ok, other=0.0)
                gate = tl.load(glu_pre + b * 2 * D + D + i, mask=ok, other=0.0)
                sigmoid = _sigmoid(gate)
                summed = output + value * sigmoid
                gated, _ = _standardize(summed, ok, D, eps)
                an_weight = tl.load(an_w + i, mask=ok, other=0.0)
                written = gated * an_weight + tl.load(an_b + i, mask=ok, other=0.0)
            grad = _standardize_grad(grad_raw, written, ok, D, eps)
            if HAS_GLU:
                tl.store(grad_written_out + row, grad, mask=kept)
                grad = _standardize_grad(grad * an_weight, summed, ok, D, eps)
                tl.store(grad_glu_pre_out + b * 2 * D + i, grad * sigmoid, mask=kept)
                tl.store(grad_glu_pre_out + b * 2 * D + D + i, grad * value * sigmoid * (1.0 - sigmoid), mask=kept)
            grad *= output_keep
            if OUTPUT_ACT:
                grad *= _silu_grad(output_pre)
            tl.store(grad_out_pre_out + row, grad, mask=ok)


@triton.jit
def _write_grad_kernel(
    grad_cells, grad_raw_cells, grad_normed_next, grad_prev_raw_next, next_input_mask, read_cell, in_w,
    out_pre, glu_pre, gate_pre, raw, residual_rows, output_mask, written_mask, cell_mask, an_w, an_b, cn_w,
    grad_input_norm_out, grad_update_out, grad_gate_pre_out, grad_written_out, grad_glu_pre_out, grad_out_pre_out,
    grad_cell_out, grad_raw_out, D, eps,
    LAST: tl.constexpr, FIRST: tl.constexpr, NEXT_GATE: tl.constexpr,
    OUTPUT_ACT: tl.constexpr, HAS_GLU: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_OUTPUT_MASK: tl.constexpr, HAS_WRITTEN_MASK: tl.constexpr, HAS_CELL_MASK: tl.constexpr,
    HAS_INPUT_MASK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """`_write_grad_rows`, one sequence a program: the finish for the cell the scan started from."""
    b = tl.program_id(0)
    _write_grad_rows(
        b, b + 1, True, grad_cells, grad_raw_cells, grad_normed_next, grad_prev_raw_next, next_input_mask,
        read_cell, in_w, out_pre, glu_pre, gate_pre, raw, residual_rows, output_mask, written_mask, cell_mask,
        an_w, an_b, cn_w, grad_input_norm_out, grad_update_out, grad_gate_pre_out, grad_written_out,
        grad_glu_pre_out, grad_out_pre_out, grad_cell_out, grad_raw_out, D, eps, LAST, FIRST, NEXT_GATE,
        OUTPUT_ACT, HAS_GLU, HAS_GATE, HAS_OUTPUT_MASK, HAS_WRITTEN_MASK, HAS_CELL_MASK, HAS_INPUT_MASK, BLOCK_D,
    )  # fmt: skip


@triton.jit
def _attention_grad_kernel(
    grad_out_pre, o_w, qkv_pre, query, read_key, read_value, attended, keys, values, bias, probs_mask,
    grad_read_keys, grad_read_values, grad_attended, grad_qkv_pre, grad_keys, grad_values,
    grad_cells, grad_raw_cells, grad_normed_next, grad_prev_raw_next, next_input_mask, read_cell, in_w,
    out_pre, glu_pre, gate_pre, raw, residual_rows, output_mask, written_mask, cell_mask, an_w, an_b, cn_w,
    grad_input_norm_out, grad_update_out, grad_gate_pre_out, grad_written_out, grad_glu_pre_out,
    B, D, H, d, S, scale, eps,
    QK_ACT: tl.constexpr, HAS_PROBS_MASK: tl.constexpr,
    LAST: tl.constexpr, NEXT_GATE: tl.constexpr, OUTPUT_ACT: tl.constexpr,
    HAS_GLU: tl.constexpr, HAS_GATE: tl.constexpr, HAS_OUTPUT_MASK: tl.constexpr,
    HAS_WRITTEN_MASK: tl.constexpr, HAS_CELL_MASK: tl.constexpr, HAS_INPUT_MASK: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
):  # fmt: skip
    """First the step's row-wise backward (`_write_grad_rows`), whose output projection gradient `grad_out_pre`
    the products below read: every program computes it for its rows, one program of each row block keeps the
    rest. A launch fewer a step, for a few row-wise sums repeated in every program."""
    h = tl.program_id(0)
    split, splits = tl.program_id(2), tl.num_programs(2)
    first_row = tl.program_id(1) * BLOCK_B
    rows = first_row + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    HD = H * d
    _write_grad_rows(
        first_row, tl.minimum(B, first_row + BLOCK_B), (h == 0) & (split == 0), grad_cells, grad_raw_cells,
        grad_normed_next, grad_prev_raw_next, next_input_mask, read_cell, in_w, out_pre, glu_pre, gate_pre, raw,
        residual_rows, output_mask, written_mask, cell_mask, an_w, an_b, cn_w, grad_input_norm_out,
        grad_update_out, grad_gate_pre_out, grad_written_out, grad_glu_pre_out, grad_out_pre, grad_cells,
        grad_raw_cells, D, eps, LAST, False, NEXT_GATE, OUTPUT_ACT, HAS_GLU, HAS_GATE, HAS_OUTPUT_MASK,
        HAS_WRITTEN_MASK, HAS_CELL_MASK, HAS_INPUT_MASK, BLOCK_HIDDEN,
    )  # fmt: skip
    tl.debug_barrier()  # the rows just stored are what the products below read
    j = tl.arange(0, BLOCK_D)
    j_ok = j < d
    # The gradient of head h's attended value: grad_out_pre @ o_w[:, h d : (h + 1) d].
    grad_head = _rows_times(grad_out_pre, D, o_w + h * d, HD, 1, rows, row_ok, j, j_ok, D, BLOCK_B, BLOCK_K,
                            BLOCK_D)  # fmt: skip
    head = (rows[:, None] * H + h) * d + j[None, :]
    tl.store(grad_attended + head, grad_head, mask=row_ok[:, None] & j_ok[None, :])
    tl.debug_barrier()
    last_row = tl.minimum(B, first_row + BLOCK_B)
    for b in range(first_row + split, last_row, splits):  # split over programs by rows, as in `_project_kernel`
        own = (b * H + h) * d + j
        q = tl.load(query + own, mask=j_ok, other=0.0)
        cell_key = tl.load(read_key + own, mask=j_ok, other=0.0)
        cell_value = tl.load(read_value + own, mask=j_ok, other=0.0)
        grad_att = tl.load(grad_attended + own, mask=j_ok, other=0.0)
        # sum_k p_k keep_k (grad_att . v_k): the attended value is sum_k p_k keep_k v_k
        delta = tl.sum(grad_att * tl.load(attended + b * HD + h * d + j, mask=j_ok, other=0.0), 0)
        cell_score = tl.sum(q * cell_key, 0) * scale
        running_max = cell_score
        total = cell_score * 0.0 + 1.0
        for s0 in range(0, S, BLOCK_S):  # the softmax's maximum and normaliser
            s = s0 + tl.arange(0, BLOCK_S)
            s_ok = s < S
            slot = ((b * H + h) * S + s[:, None]) * d + j[None, :]
            scores = tl.sum(tl.load(keys + slot, mask=s_ok[:, None] & j_ok[None, :], other=0.0) * q[None, :], 1)
            scores = scores * scale + tl.load(bias + b * S + s, mask=s_ok, other=float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 0))
            total = total * tl.exp(running_max - new_max) + tl.sum(tl.exp(scores - new_max), 0)
            running_max = new_max
        keep = 1.0
        if HAS_PROBS_MASK:
            keep = tl.load(probs_mask + (b * H + h) * (S + 1))
        cell_prob = tl.exp(cell_score - running_max) / total
        grad_cell_score = cell_prob * (keep * tl.sum(grad_att * cell_value, 0) - delta) * scale
        grad_query = grad_cell_score * cell_key
        grad_key = grad_cell_score * q + tl.load(grad_read_keys + own, mask=j_ok, other=0.0)
        grad_value = cell_prob * keep * grad_att + tl.load(grad_read_values + own, mask=j_ok, other=0.0)
        for s0 in range(0, S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            s_ok = s < S
            slot = ((b * H + h) * S + s[:, None]) * d + j[None, :]
            slot_ok = s_ok[:, None] & j_ok[None, :]
            slot_keys = tl.load(keys + slot, mask=slot_ok, other=0.0)
            slot_values = tl.load(values + slot, mask=slot_ok, other=0.0)
            scores = tl.sum(slot_keys * q[None, :], 1) * scale
            scores += tl.load(bias + b * S + s, mask=s_ok, other=float("-inf"))
            probs = tl.exp(scores - running_max) / total
            keep_slots = tl.full((BLOCK_S,), 1.0, tl.float32)
            if HAS_PROBS_MASK:
                keep_slots = tl.load(probs_mask + (b * H + h) * (S + 1) + 1 + s, mask=s_ok, other=0.0)
            grad_scores = probs * (keep_slots * tl.sum(slot_values * grad_att[None, :], 1) - delta) * scale
            grad_query += tl.sum(grad_scores[:, None] * slot_keys, 0)
            tl.store(grad_keys + slot, grad_scores[:, None] * q[None, :], mask=slot_ok)
            tl.store(grad_values + slot, (probs * keep_slots)[:, None] * grad_att[None, :], mask=slot_ok)
        pre = b * 3 * HD + h * d + j
        if QK_ACT:
            grad_query *= _silu_grad(tl.load(qkv_pre + pre, mask=j_ok, other=0.0))
            grad_key *= _silu_grad(tl.load(qkv_pre + pre + HD, mask=j_ok, other=0.0))
        grad_value *= _silu_grad(tl.load(qkv_pre + pre + 2 * HD, mask=j_ok, other=0.0))
        tl.store(grad_qkv_pre + pre, grad_query, mask=j_ok)
        tl.store(grad_qkv_pre + pre + HD, grad_key, mask=j_ok)
        tl.store(grad_qkv_pre + pre + 2 * HD, grad_value, mask=j_ok)


@triton.jit
def _input_grad_kernel(grad_qkv_pre, qkv_w, grad_glu_pre, ag_w, grad_gate_pre, cg_w, grad_normed, grad_prev_raw,
                       B, D, HD, HAS_GLU: tl.constexpr, HAS_GATE: tl.constexpr,
                       BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < B, cols < D
    ok = row_ok[:, None] & col_ok[None, :]
    where = rows[:, None] * D + cols[None, :]
    acc = _rows_times(grad_qkv_pre, 3 * HD, qkv_w, D, 1, rows, row_ok, cols, col_ok, 3 * HD, BLOCK_B, BLOCK_K,
                      BLOCK_N)  # fmt: skip
    if HAS_GLU:
        acc += _rows_times(grad_glu_pre, 2 * D, ag_w, D, 1, rows, row_ok, cols, col_ok, 2 * D, BLOCK_B, BLOCK_K,
                           BLOCK_N)  # fmt: skip
    tl.store(grad_normed + where, acc, mask=ok)
    if HAS_GATE:
        acc = _rows_times(grad_gate_pre, 2 * D, cg_w, D, 1, rows, row_ok, cols, col_ok, 2 * D, BLOCK_B, BLOCK_K,
                          BLOCK_N)  # fmt: skip
        tl.store(grad_prev_raw + where, acc, mask=ok)


# Each launch is one op: `torch.compile`, export and a dispatch counter see it as such. The outputs are
# preallocated step slices of the scan's buffers, so the ops mutate them and return nothing; on the meta device
# (shape checks and kernel counts without a GPU) they do nothing.


@triton_op(
    "ran_hf::scan_write_grad",
    mutates_args={
        "grad_input_norm_out", "grad_update_out", "grad_gate_pre_out", "grad_written_out", "grad_glu_pre_out",
        "grad_out_pre_out", "grad_cell_out", "grad_raw_out",
    },
)  # fmt: skip
def scan_write_grad(
    grad_cells: torch.Tensor, grad_raw_cells: torch.Tensor, grad_normed_next: torch.Tensor,
    grad_prev_raw_next: torch.Tensor, next_input_mask: torch.Tensor, read_cell: torch.Tensor,
    in_w: torch.Tensor, out_pre: torch.Tensor, glu_pre: torch.Tensor, gate_pre: torch.Tensor, raw: torch.Tensor,
    residual_rows: torch.Tensor, output_mask: torch.Tensor, written_mask: torch.Tensor, cell_mask: torch.Tensor,
    an_w: torch.Tensor, an_b: torch.Tensor, cn_w: torch.Tensor, grad_input_norm_out: torch.Tensor,
    grad_update_out: torch.Tensor, grad_gate_pre_out: torch.Tensor, grad_written_out: torch.Tensor,
    grad_glu_pre_out: torch.Tensor, grad_out_pre_out: torch.Tensor, grad_cell_out: torch.Tensor,
    grad_raw_out: torch.Tensor, eps: float, flags: list[bool],
) -> None:  # fmt: skip
    (last, first, next_gate, output_act, has_glu, has_gate, has_output_mask, has_written_mask, has_cell_mask,
     has_input_mask) = flags  # fmt: skip
    batch_size, hidden = read_cell.shape
    wrap_triton(_write_grad_kernel)[(batch_size,)](
        grad_cells, grad_raw_cells, grad_normed_next, grad_prev_raw_next, next_input_mask, read_cell, in_w,
        out_pre, glu_pre, gate_pre, raw, residual_rows, output_mask, written_mask, cell_mask, an_w, an_b, cn_w,
        grad_input_norm_out, grad_update_out, grad_gate_pre_out, grad_written_out, grad_glu_pre_out,
        grad_out_pre_out, grad_cell_out, grad_raw_out, hidden, eps,
        LAST=last, FIRST=first, NEXT_GATE=next_gate, OUTPUT_ACT=output_act, HAS_GLU=has_glu, HAS_GATE=has_gate,
        HAS_OUTPUT_MASK=has_output_mask, HAS_WRITTEN_MASK=has_written_mask, HAS_CELL_MASK=has_cell_mask,
        HAS_INPUT_MASK=has_input_mask, BLOCK_D=triton.next_power_of_2(hidden),
    )  # fmt: skip


@triton_op(
    "ran_hf::scan_attention_grad",
    mutates_args={
        "grad_attended", "grad_qkv_pre", "grad_keys", "grad_values", "grad_input_norm_out", "grad_update_out",
        "grad_gate_pre_out", "grad_written_out", "grad_glu_pre_out", "grad_out_pre",
    },
)  # fmt: skip
def scan_attention_grad(
    o_w: torch.Tensor, qkv_pre: torch.Tensor, query: torch.Tensor, read_key: torch.Tensor,
    read_value: torch.Tensor, attended: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
    probs_mask: torch.Tensor, grad_read_keys: torch.Tensor, grad_read_values: torch.Tensor,
    grad_attended: torch.Tensor, grad_qkv_pre: torch.Tensor, grad_keys: torch.Tensor, grad_values: torch.Tensor,
    grad_cells: torch.Tensor, grad_raw_cells: torch.Tensor, grad_normed_next: torch.Tensor,
    grad_prev_raw_next: torch.Tensor, next_input_mask: torch.Tensor, read_cell: torch.Tensor, in_w: torch.Tensor,
    out_pre: torch.Tensor, glu_pre: torch.Tensor, gate_pre: torch.Tensor, raw: torch.Tensor,
    residual_rows: torch.Tensor, output_mask: torch.Tensor, written_mask: torch.Tensor, cell_mask: torch.Tensor,
    an_w: torch.Tensor, an_b: torch.Tensor, cn_w: torch.Tensor, grad_input_norm_out: torch.Tensor,
    grad_update_out: torch.Tensor, grad_gate_pre_out: torch.Tensor, grad_written_out: torch.Tensor,
    grad_glu_pre_out: torch.Tensor, grad_out_pre: torch.Tensor, eps: float, flags: list[bool],
) -> None:  # fmt: skip
    """The step's row-wise backward (`scan_write_grad`'s flags but FIRST), then the attention's."""
    (qk_act, has_probs_mask, last, next_gate, output_act, has_glu, has_gate, has_output_mask, has_written_mask,
     has_cell_mask, has_input_mask) = flags  # fmt: skip
    batch_size, num_heads, num_slots, head_dim = keys.shape
    hidden = grad_out_pre.shape[-1]
    block_rows = tiles.block_rows(batch_size)
    grid = (num_heads, triton.cdiv(batch_size, block_rows), min(tiles.ROW_SPLITS, batch_size))
    wrap_triton(_attention_grad_kernel)[grid](
        grad_out_pre, o_w, qkv_pre, query, read_key, read_value, attended, keys, values, bias, probs_mask,
        grad_read_keys, grad_read_values, grad_attended, grad_qkv_pre, grad_keys, grad_values,
        grad_cells, grad_raw_cells, grad_normed_next, grad_prev_raw_next, next_input_mask, read_cell, in_w,
        out_pre, glu_pre, gate_pre, raw, residual_rows, output_mask, written_mask, cell_mask, an_w, an_b, cn_w,
        grad_input_norm_out, grad_update_out, grad_gate_pre_out, grad_written_out, grad_glu_pre_out,
        batch_size, hidden, num_heads, head_dim, num_slots, head_dim**-0.5, eps,
        QK_ACT=qk_act, HAS_PROBS_MASK=has_probs_mask, LAST=last, NEXT_GATE=next_gate, OUTPUT_ACT=output_act,
        HAS_GLU=has_glu, HAS_GATE=has_gate, HAS_OUTPUT_MASK=has_output_mask, HAS_WRITTEN_MASK=has_written_mask,
        HAS_CELL_MASK=has_cell_mask, HAS_INPUT_MASK=has_input_mask,
        BLOCK_B=block_rows, BLOCK_K=tiles.BLOCK_K, BLOCK_D=tiles.block(head_dim), BLOCK_S=tiles.BLOCK_S,
        BLOCK_HIDDEN=triton.next_power_of_2(hidden), num_warps=tiles.NUM_WARPS,
    )  # fmt: skip


@triton_op("ran_hf::scan_input_grad", mutates_args={"grad_normed", "grad_prev_raw"})
def scan_input_grad(
    grad_qkv_pre: torch.Tensor, qkv_w: torch.Tensor, grad_glu_pre: torch.Tensor, ag_w: torch.Tensor,
    grad_gate_pre: torch.Tensor, cg_w: torch.Tensor, grad_normed: torch.Tensor, grad_prev_raw: torch.Tensor,
    has_glu: bool, has_gate: bool,
) -> None:  # fmt: skip
    batch_size, hidden = grad_normed.shape
    block_rows = tiles.block_rows(batch_size)
    grid = (triton.cdiv(hidden, tiles.BLOCK_N), triton.cdiv(batch_size, block_rows))
    wrap_triton(_input_grad_kernel)[grid](
        grad_qkv_pre, qkv_w, grad_glu_pre, ag_w, grad_gate_pre, cg_w, grad_normed, grad_prev_raw,
        batch_size, hidden, qkv_w.shape[0] // 3, HAS_GLU=has_glu, HAS_GATE=has_gate,
        BLOCK_B=block_rows, BLOCK_K=tiles.BLOCK_K, BLOCK_N=tiles.BLOCK_N, num_warps=tiles.NUM_WARPS,
    )  # fmt: skip


register_meta_no_ops(scan_write_grad, scan_attention_grad, scan_input_grad)
