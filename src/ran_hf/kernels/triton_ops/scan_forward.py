"""The Triton scan's forward kernels and the ops that launch them: `project`, `output` and `write` (scan.py runs
them step by step and says what each computes), with the row-wise helpers the backward kernels share.

Shapes: N scan steps, B batch, H heads, d head size, D hidden size, S window slots.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from . import register_meta_no_ops
from . import scan_tiles as tiles


@triton.jit
def _rows_times(x_ptr, x_stride, w_ptr, stride_k, stride_n, rows, row_ok, cols, col_ok, K,
                BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(BLOCK_B, BLOCK_N) = x[rows, :K] @ W[:K, cols], W's element (k, n) at w_ptr + k stride_k + n stride_n."""
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x_mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=x_mask, other=0.0)
        w = tl.load(w_ptr + kk[:, None] * stride_k + cols[None, :] * stride_n,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(x, w, input_precision="ieee")
    return acc


@triton.jit
def _standardize(x, ok, D, eps):
    """SN(x) = (x - mean(x)) / sqrt(mean(x^2) + eps) over a row; returns SN(x) and 1 / sqrt(mean(x^2) + eps)."""
    x = tl.where(ok, x, 0.0)
    mean = tl.sum(x, 0) / D
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    return tl.where(ok, (x - mean) * rstd, 0.0), rstd


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _silu_grad(x):
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


@triton.jit
def _project_kernel(
    normed, prev_raw, qkv_w, qkv_b, ag_w, ag_b, cg_w, cg_b, keys, values, bias, probs_mask,
    qkv_pre, query, read_key, read_value, attended, glu_pre, gate_pre,
    w_out_pre, w_glu_pre, w_gate_pre, residual_rows, output_mask, written_mask, cell_mask, input_mask,
    an_w, an_b, cn_w, cn_b, in_w, in_b, raw_out, cell_out, gated_out, joined_out, normed_cell_out, normed_out,
    B, D, H, d, S, scale, eps,
    QK_ACT: tl.constexpr, HAS_GLU: tl.constexpr, HAS_GATE: tl.constexpr, HAS_PROBS_MASK: tl.constexpr,
    WRITE: tl.constexpr, OUTPUT_ACT: tl.constexpr, WRITE_GATE: tl.constexpr, HAS_OUTPUT_MASK: tl.constexpr,
    HAS_WRITTEN_MASK: tl.constexpr, HAS_CELL_MASK: tl.constexpr, HAS_INPUT_MASK: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_HIDDEN: tl.constexpr,
):  # fmt: skip
    """WRITE: first the previous step's write (`_write_rows`, `w_*` its inputs), whose raw cell and input norm
    this step projects: every program computes it for its rows, one program of each row block keeps the rest.
    A launch fewer a step, for a few row-wise sums repeated in every program. A head's attention is split over
    `splits` programs by rows (the third grid axis), each computing the head's projections of the whole row
    block: latency, not arithmetic, bounds these loops."""
    pid = tl.program_id(0)
    first_row = tl.program_id(1) * BLOCK_B
    rows = first_row + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    HD = H * d
    split, splits = tl.program_id(2), tl.num_programs(2)
    if (pid < H) | (split == 0):  # the GLU projections are not split by rows
        if WRITE:
            _write_rows(
                first_row, tl.minimum(B, first_row + BLOCK_B), (pid == 0) & (split == 0), w_out_pre, w_glu_pre,
                w_gate_pre, residual_rows, output_mask, written_mask, cell_mask, input_mask, an_w, an_b, cn_w,
                cn_b, in_w, in_b, raw_out, cell_out, gated_out, joined_out, normed_cell_out, normed_out, D, eps,
                OUTPUT_ACT, HAS_GLU, WRITE_GATE, True, HAS_OUTPUT_MASK, HAS_WRITTEN_MASK, HAS_CELL_MASK,
                HAS_INPUT_MASK, False, BLOCK_HIDDEN,
            )  # fmt: skip
            normed, prev_raw = normed_out, raw_out
            tl.debug_barrier()  # the rows just stored are what the projections below read
        if pid < H:  # head h: the cell's query, key and value, then its attention over the window
            h = pid
            j = tl.arange(0, BLOCK_D)
            j_ok = j < d
            out_ok = row_ok[:, None] & j_ok[None, :]
            q = _rows_times(normed, D, qkv_w, 1, D, rows, row_ok, h * d + j, j_ok, D, BLOCK_B, BLOCK_K, BLOCK_D)
            k = _rows_times(normed, D, qkv_w, 1, D, rows, row_ok, HD + h * d + j, j_ok, D, BLOCK_B, BLOCK_K,
                            BLOCK_D)  # fmt: skip
            v = _rows_times(normed, D, qkv_w, 1, D, rows, row_ok, 2 * HD + h * d + j, j_ok, D, BLOCK_B, BLOCK_K,
                            BLOCK_D)  # fmt: skip
            q += tl.load(qkv_b + h * d + j, mask=j_ok, other=0.0)[None, :]
            k += tl.load(qkv_b + HD + h * d + j, mask=j_ok, other=0.0)[None, :]
            v += tl.load(qkv_b + 2 * HD + h * d + j, mask=j_ok, other=0.0)[None, :]
            pre = qkv_pre + rows[:, None] * (3 * HD) + h * d + j[None, :]
            tl.store(pre, q, mask=out_ok)
            tl.store(pre + HD, k, mask=out_ok)
            tl.store(pre + 2 * HD, v, mask=out_ok)
            if QK_ACT:
                q = q * _sigmoid(q)
                k = k * _sigmoid(k)
            v = v * _sigmoid(v)
            head = (rows[:, None] * H + h) * d + j[None, :]
            tl.store(query + head, q, mask=out_ok)
            tl.store(read_key + head, k, mask=out_ok)
            tl.store(read_value + head, v, mask=out_ok)
            tl.debug_barrier()  # the rows just stored are read back one sequence at a time below
            last_row = tl.minimum(B, first_row + BLOCK_B)
            for b in range(first_row + split, last_row, splits):
                own = (b * H + h) * d + j
                q_b = tl.load(query + own, mask=j_ok, other=0.0)
                cell_score = tl.sum(q_b * tl.load(read_key + own, mask=j_ok, other=0.0), 0) * scale
                keep = 1.0
                if HAS_PROBS_MASK:
                    keep = tl.load(probs_mask + (b * H + h) * (S + 1))
                acc = tl.load(read_value + own, mask=j_ok, other=0.0) * keep
                running_max = cell_score
                total = cell_score * 0.0 + 1.0
                for s0 in range(0, S, BLOCK_S):
                    s = s0 + tl.arange(0, BLOCK_S)
                    s_ok = s < S
                    slot = ((b * H + h) * S + s[:, None]) * d + j[None, :]
                    slot_ok = s_ok[:, None] & j_ok[None, :]
                    scores = tl.sum(tl.load(keys + slot, mask=slot_ok, other=0.0) * q_b[None, :], 1) * scale
                    scores += tl.load(bias + b * S + s, mask=s_ok, other=float("-inf"))
                    new_max = tl.maximum(running_max, tl.max(scores, 0))
                    rescale = tl.exp(running_max - new_max)
                    weights = tl.exp(scores - new_max)
                    total = total * rescale + tl.sum(weights, 0)
                    if HAS_PROBS_MASK:
                        weights *= tl.load(probs_mask + (b * H + h) * (S + 1) + 1 + s, mask=s_ok, other=0.0)
                    slot_values = tl.load(values + slot, mask=slot_ok, other=0.0)
                    acc = acc * rescale + tl.sum(weights[:, None] * slot_values, 0)
                    running_max = new_max
                tl.store(attended + b * HD + h * d + j, acc / total, mask=j_ok)
        else:  # a block of columns of a GLU projection: the attention GLU of `normed`, the cell GLU of `prev_raw`
            block = pid - H
            glu_blocks = 0
            if HAS_GLU:
                glu_blocks = tl.cdiv(2 * D, BLOCK_N)
            cols = tl.arange(0, BLOCK_N)
            # (names assigned in both branches of `pid < H` must keep one shape: nothing here reuses `out_ok`)
            if block < glu_blocks:
                cols += block * BLOCK_N
                col_ok = cols < 2 * D
                acc = _rows_times(normed, D, ag_w, 1, D, rows, row_ok, cols, col_ok, D, BLOCK_B, BLOCK_K, BLOCK_N)
                acc += tl.load(ag_b + cols, mask=col_ok, other=0.0)[None, :]
                tl.store(glu_pre + rows[:, None] * (2 * D) + cols[None, :], acc,
                         mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip
            elif HAS_GATE:
                cols += (block - glu_blocks) * BLOCK_N
                col_ok = cols < 2 * D
                acc = _rows_times(prev_raw, D, cg_w, 1, D, rows, row_ok, cols, col_ok, D, BLOCK_B, BLOCK_K,
                                  BLOCK_N)  # fmt: skip
                acc += tl.load(cg_b + cols, mask=col_ok, other=0.0)[None, :]
                tl.store(gate_pre + rows[:, None] * (2 * D) + cols[None, :], acc,
                         mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _output_kernel(attended, o_w, o_b, shift, out_pre, B, D, HD, HAS_SHIFT: tl.constexpr,
                   BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < B, cols < D
    acc = _rows_times(attended, HD, o_w, 1, HD, rows, row_ok, cols, col_ok, HD, BLOCK_B, BLOCK_K, BLOCK_N)
    acc += tl.load(o_b + cols, mask=col_ok, other=0.0)[None, :]
    where = rows[:, None] * D + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if HAS_SHIFT:
        acc += tl.load(shift + where, mask=ok, other=0.0)
    tl.store(out_pre + where, acc, mask=ok)


@triton.jit
def _write_rows(
    first_row, last_row, keep_all, out_pre, glu_pre, gate_pre, residual_rows, output_mask, written_mask,
    cell_mask, next_input_mask, an_w, an_b, cn_w, cn_b, in_w, in_b,
    raw_out, cell_out, gated_out, joined_out, next_normed_cell, next_normed, D, eps,
    OUTPUT_ACT: tl.constexpr, HAS_GLU: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NEXT: tl.constexpr,
    HAS_OUTPUT_MASK: tl.constexpr, HAS_WRITTEN_MASK: tl.constexpr, HAS_CELL_MASK: tl.constexpr,
    HAS_INPUT_MASK: tl.constexpr, START: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows [first_row, last_row) of step t's raw cell and cell, then of step t + 1's input norm; START: only the
    input norm of the cell the scan starts from, read from `out_pre` (an input, where `cell_out` would be declared
    written). The raw cell and the next input norm, which the next step's projections read, are always stored;
    the rest only where `keep_all` (one program of a launch that computes the same rows in every program)."""
    i = tl.arange(0, BLOCK_D)
    ok = i < D
    kept = tl.where(keep_all, ok, False)
    for b in range(first_row, last_row):
        row = b * D + i
        if START:
            cell = tl.load(out_pre + row, mask=ok, other=0.0)
        else:
            output = tl.load(out_pre + row, mask=ok, other=0.0)
            if OUTPUT_ACT:
                output = output * _sigmoid(output)
            if HAS_OUTPUT_MASK:
                output *= tl.load(output_mask + row, mask=ok, other=0.0)
            if HAS_GLU:  # raw = SN(LN_attention(output + GLU(normed)))
                value = tl.load(glu_pre + b * 2 * D + i, mask=ok, other=0.0)
                gate = tl.load(glu_pre + b * 2 * D + D + i, mask=ok, other=0.0)
                gated, _ = _standardize(output + value * _sigmoid(gate), ok, D, eps)
                tl.store(gated_out + row, gated, mask=kept)
                output = gated * tl.load(an_w + i, mask=ok, other=0.0) + tl.load(an_b + i, mask=ok, other=0.0)
            raw, _ = _standardize(output, ok, D, eps)
            if HAS_WRITTEN_MASK:
                raw *= tl.load(written_mask + row, mask=ok, other=0.0)
            tl.store(raw_out + row, raw, mask=ok)
            cell = raw
            if HAS_GATE:  # cell = LN_cell(raw + GLU_cell(previous raw)) on rows with a residual
                value = tl.load(gate_pre + b * 2 * D + i, mask=ok, other=0.0)
                gate = tl.load(gate_pre + b * 2 * D + D + i, mask=ok, other=0.0)
                joined, _ = _standardize(raw + value * _sigmoid(gate), ok, D, eps)
                tl.store(joined_out + row, joined, mask=kept)
                updated = joined * tl.load(cn_w + i, mask=ok, other=0.0) + tl.load(cn_b + i, mask=ok, other=0.0)
                if HAS_CELL_MASK:
                    updated *= tl.load(cell_mask + row, mask=ok, other=0.0)
                cell = tl.where(tl.load(residual_rows + b) > 0, updated, raw)
            tl.store(cell_out + row, cell, mask=kept)
        if HAS_NEXT:  # the next step's input norm
            normed_cell, _ = _standardize(cell, ok, D, eps)
            tl.store(next_normed_cell + row, normed_cell, mask=kept)
            normed = normed_cell * tl.load(in_w + i, mask=ok, other=0.0) + tl.load(in_b + i, mask=ok, other=0.0)
            if HAS_INPUT_MASK:
                normed *= tl.load(next_input_mask + row, mask=ok, other=0.0)
            tl.store(next_normed + row, normed, mask=ok)


@triton.jit
def _write_kernel(
    out_pre, glu_pre, gate_pre, residual_rows, output_mask, written_mask, cell_mask, next_input_mask,
    an_w, an_b, cn_w, cn_b, in_w, in_b,
    raw_out, cell_out, gated_out, joined_out, next_normed_cell, next_normed, D, eps,
    OUTPUT_ACT: tl.constexpr, HAS_GLU: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NEXT: tl.constexpr,
    HAS_OUTPUT_MASK: tl.constexpr, HAS_WRITTEN_MASK: tl.constexpr, HAS_CELL_MASK: tl.constexpr,
    HAS_INPUT_MASK: tl.constexpr, START: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """`_write_rows`, one sequence a program: the write of the scan's start and of its last step."""
    b = tl.program_id(0)
    _write_rows(
        b, b + 1, True, out_pre, glu_pre, gate_pre, residual_rows, output_mask, written_mask, cell_mask,
        next_input_mask, an_w, an_b, cn_w, cn_b, in_w, in_b, raw_out, cell_out, gated_out, joined_out,
        next_normed_cell, next_normed, D, eps, OUTPUT_ACT, HAS_GLU, HAS_GATE, HAS_NEXT, HAS_OUTPUT_MASK,
        HAS_WRITTEN_MASK, HAS_CELL_MASK, HAS_INPUT_MASK, START, BLOCK_D,
    )  # fmt: skip


@triton_op(
    "ran_hf::scan_project",
    mutates_args={
        "qkv_pre", "query", "read_key", "read_value", "attended", "glu_pre", "gate_pre", "raw_out", "cell_out",
        "gated_out", "joined_out", "normed_cell_out", "normed_out",
    },
)  # fmt: skip
def scan_project(
    normed: torch.Tensor, prev_raw: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor, ag_w: torch.Tensor,
    ag_b: torch.Tensor, cg_w: torch.Tensor, cg_b: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    bias: torch.Tensor, probs_mask: torch.Tensor, qkv_pre: torch.Tensor, query: torch.Tensor,
    read_key: torch.Tensor, read_value: torch.Tensor, attended: torch.Tensor, glu_pre: torch.Tensor,
    gate_pre: torch.Tensor, w_out_pre: torch.Tensor, w_glu_pre: torch.Tensor, w_gate_pre: torch.Tensor,
    residual_rows: torch.Tensor, output_mask: torch.Tensor, written_mask: torch.Tensor, cell_mask: torch.Tensor,
    input_mask: torch.Tensor, an_w: torch.Tensor, an_b: torch.Tensor, cn_w: torch.Tensor, cn_b: torch.Tensor,
    in_w: torch.Tensor, in_b: torch.Tensor, raw_out: torch.Tensor, cell_out: torch.Tensor,
    gated_out: torch.Tensor, joined_out: torch.Tensor, normed_cell_out: torch.Tensor, normed_out: torch.Tensor,
    eps: float, flags: list[bool],
) -> None:  # fmt: skip
    """With `write` (flags[4]), the previous step's write first: its outputs `raw_out` and `normed_out` are then
    what this step reads, and `prev_raw` and `normed` are not read."""
    (qk_act, has_glu, has_gate, has_probs_mask, write, output_act, write_gate, has_output_mask, has_written_mask,
     has_cell_mask, has_input_mask) = flags  # fmt: skip
    batch_size, num_heads, num_slots, head_dim = keys.shape
    hidden = qkv_w.shape[-1]
    block_rows = tiles.block_rows(batch_size)
    glu_blocks = triton.cdiv(2 * hidden, tiles.BLOCK_N)
    programs = num_heads + glu_blocks * has_glu + glu_blocks * has_gate
    grid = (programs, triton.cdiv(batch_size, block_rows), min(tiles.ROW_SPLITS, batch_size))
    wrap_triton(_project_kernel)[grid](
        normed, prev_raw, qkv_w, qkv_b, ag_w, ag_b, cg_w, cg_b, keys, values, bias, probs_mask,
        qkv_pre, query, read_key, read_value, attended, glu_pre, gate_pre,
        w_out_pre, w_glu_pre, w_gate_pre, residual_rows, output_mask, written_mask, cell_mask, input_mask,
        an_w, an_b, cn_w, cn_b, in_w, in_b, raw_out, cell_out, gated_out, joined_out, normed_cell_out, normed_out,
        batch_size, hidden, num_heads, head_dim, num_slots, head_dim**-0.5, eps,
        QK_ACT=qk_act, HAS_GLU=has_glu, HAS_GATE=has_gate, HAS_PROBS_MASK=has_probs_mask, WRITE=write,
        OUTPUT_ACT=output_act, WRITE_GATE=write_gate, HAS_OUTPUT_MASK=has_output_mask,
        HAS_WRITTEN_MASK=has_written_mask, HAS_CELL_MASK=has_cell_mask, HAS_INPUT_MASK=has_input_mask,
        BLOCK_B=block_rows, BLOCK_K=tiles.BLOCK_K, BLOCK_D=tiles.block(head_dim), BLOCK_N=tiles.BLOCK_N, BLOCK_S=tiles.BLOCK_S,
        BLOCK_HIDDEN=triton.next_power_of_2(hidden), num_warps=tiles.NUM_WARPS,
    )  # fmt: skip


@triton_op("ran_hf::scan_output", mutates_args={"out_pre"})
def scan_output(
    attended: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor, shift: torch.Tensor, out_pre: torch.Tensor,
    has_shift: bool,
) -> None:  # fmt: skip
    batch_size, hidden = out_pre.shape
    block_rows = tiles.block_rows(batch_size)
    grid = (triton.cdiv(hidden, tiles.BLOCK_N), triton.cdiv(batch_size, block_rows))
    wrap_triton(_output_kernel)[grid](
        attended, o_w, o_b, shift, out_pre, batch_size, hidden, attended.shape[-1], HAS_SHIFT=has_shift,
        BLOCK_B=block_rows, BLOCK_K=tiles.BLOCK_K, BLOCK_N=tiles.BLOCK_N, num_warps=tiles.NUM_WARPS,
    )  # fmt: skip


@triton_op(
    "ran_hf::scan_write",
    mutates_args={"raw_out", "cell_out", "gated_out", "joined_out", "next_normed_cell", "next_normed"},
)
def scan_write(
    out_pre: torch.Tensor, glu_pre: torch.Tensor, gate_pre: torch.Tensor, residual_rows: torch.Tensor,
    output_mask: torch.Tensor, written_mask: torch.Tensor, cell_mask: torch.Tensor,
    next_input_mask: torch.Tensor, an_w: torch.Tensor, an_b: torch.Tensor, cn_w: torch.Tensor, cn_b: torch.Tensor,
    in_w: torch.Tensor, in_b: torch.Tensor, raw_out: torch.Tensor, cell_out: torch.Tensor,
    gated_out: torch.Tensor, joined_out: torch.Tensor, next_normed_cell: torch.Tensor, next_normed: torch.Tensor,
    eps: float, flags: list[bool],
) -> None:  # fmt: skip
    (output_act, has_glu, has_gate, has_next, has_output_mask, has_written_mask, has_cell_mask, has_input_mask,
     start) = flags  # fmt: skip
    batch_size, hidden = out_pre.shape
    wrap_triton(_write_kernel)[(batch_size,)](
        out_pre, glu_pre, gate_pre, residual_rows, output_mask, written_mask, cell_mask, next_input_mask,
        an_w, an_b, cn_w, cn_b, in_w, in_b, raw_out, cell_out, gated_out, joined_out, next_normed_cell,
        next_normed, hidden, eps,
        OUTPUT_ACT=output_act, HAS_GLU=has_glu, HAS_GATE=has_gate, HAS_NEXT=has_next,
        HAS_OUTPUT_MASK=has_output_mask, HAS_WRITTEN_MASK=has_written_mask, HAS_CELL_MASK=has_cell_mask,
        HAS_INPUT_MASK=has_input_mask, START=start, BLOCK_D=triton.next_power_of_2(hidden),
    )  # fmt: skip


register_meta_no_ops(scan_project, scan_output, scan_write)
