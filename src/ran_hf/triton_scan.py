"""The cell scan in Triton: three kernels per window forward, three backward, whatever the layer's width.

`fused_scan.py` runs each window step as ~40 forward and ~56 backward PyTorch ops; on a GPU every one is a kernel
launch of a few microseconds around very little arithmetic. Here a step is three launches each way, each a
`torch.library.triton_op` (one op for `torch.compile`, export and a dispatch counter):

forward, step t (the cell c read by the window, its input norm `normed` already computed):
  1. `project`  one program per head: q, k, v of the cell (a matrix-vector product per sequence with `tl.dot`), their
                activation, then the head's attention over [the cell's own key; the window's slots] (online softmax,
                dropout on the weights). Further programs compute the two GLU projections (attention GLU of `normed`,
                cell GLU of the previous raw cell), which need no attention.
  2. `output`   the output projection of the attended heads, column blocks in parallel.
  3. `write`    one program per sequence, the whole row: activation, gated residual, the standardisations and norms
                that write the raw cell and the cell, and the input norm of the next step's cell.
backward, step t in reverse: `write_grad` (the row-wise chain of `write` and the next step's input norm, in reverse),
`attention_grad` (per head: the output projection's transpose, the attention's backward, the window slots'
gradients), `input_grad` (the transposed input projections, column blocks in parallel).

Weight gradients are sums over steps, taken after the loop by a few batched products, as in the fused scan.

It computes what `FusedCellScan` computes (same inputs, outputs, dropout masks) in float32, the matrix products in
IEEE float32 (`input_precision="ieee"`, no TF32). Without Triton this module still imports; `TRITON_AVAILABLE` says
whether the kernels exist. `TRITON_INTERPRET=1` runs them on CPU tensors (slowly), which is how CPU tests check them.

Shapes: N scan steps, B batch, H heads, d head size, D hidden size, S window slots.
"""

import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


try:  # optional: the reference and fused scans need no Triton
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    TRITON_AVAILABLE = True
    # What a kernel that cannot be built for this GPU raises (too little shared memory, a compiler error).
    KERNEL_BUILD_ERRORS = (triton.compiler.errors.CompilationError, triton.runtime.errors.OutOfResources)
except ImportError:  # pragma: no cover - exercised where Triton is absent
    TRITON_AVAILABLE = False
    KERNEL_BUILD_ERRORS = ()

# Rows of the batch per program, and the least block of any side: tl.dot needs at least 16 on each side, so small
# batches are padded (masked) to 16.
MIN_BLOCK = 16
# Chosen on an H200 at BERT-base width (benchmarks/cuda/tune_triton_scan.json): the matrix-vector kernels are
# bound by the latency of their reduction loops, so long reduction blocks and more, narrower column programs win.
BLOCK_K = 256  # the reduction block of every matrix-vector product
BLOCK_N = 32  # output columns per program of the column-parallel products
BLOCK_S = 64  # window slots per iteration of the attention loops
NUM_WARPS = 8  # of the matrix-vector kernels


BUILD_FAILURES: list = []  # a kernel that could not be built here: the Triton scan is not tried again


def triton_scan_unsupported(cell: torch.Tensor) -> str | None:
    """Why the Triton scan cannot run on this input, or None if it can."""
    if not TRITON_AVAILABLE:
        return "Triton is not installed"
    if BUILD_FAILURES:
        return f"its kernels could not be built on this device ({BUILD_FAILURES[0]})"
    # The meta device runs no kernel at all: it checks shapes and counts launches (benchmark_kernels.py).
    if cell.device.type not in ("cuda", "meta") and os.environ.get("TRITON_INTERPRET") != "1":
        return f"its kernels run on CUDA devices (the input is on {cell.device.type})"
    if cell.dtype == torch.float64:
        return "it computes in float32, and the input is float64"
    return None


if TRITON_AVAILABLE:

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
        B, D, H, d, S, scale,
        QK_ACT: tl.constexpr, HAS_GLU: tl.constexpr, HAS_GATE: tl.constexpr, HAS_PROBS_MASK: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        first_row = tl.program_id(1) * BLOCK_B
        rows = first_row + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        HD = H * d
        if pid < H:  # head h: the cell's query, key and value, then its attention over the window
            h = pid
            j = tl.arange(0, BLOCK_D)
            j_ok = j < d
            out_ok = row_ok[:, None] & j_ok[None, :]
            q = _rows_times(normed, D, qkv_w, 1, D, rows, row_ok, h * d + j, j_ok, D, BLOCK_B, BLOCK_K, BLOCK_D)
            k = _rows_times(normed, D, qkv_w, 1, D, rows, row_ok, HD + h * d + j, j_ok, D, BLOCK_B, BLOCK_K, BLOCK_D)
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
            for b in range(first_row, last_row):
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
                acc = _rows_times(prev_raw, D, cg_w, 1, D, rows, row_ok, cols, col_ok, D, BLOCK_B, BLOCK_K, BLOCK_N)
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
    def _write_kernel(
        out_pre, glu_pre, gate_pre, residual_rows, output_mask, written_mask, cell_mask, next_input_mask,
        an_w, an_b, cn_w, cn_b, in_w, in_b,
        raw_out, cell_out, gated_out, joined_out, next_normed_cell, next_normed, D, eps,
        OUTPUT_ACT: tl.constexpr, HAS_GLU: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NEXT: tl.constexpr,
        HAS_OUTPUT_MASK: tl.constexpr, HAS_WRITTEN_MASK: tl.constexpr, HAS_CELL_MASK: tl.constexpr,
        HAS_INPUT_MASK: tl.constexpr, START: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Step t's raw cell and cell, then step t + 1's input norm; START: only the input norm of the cell the scan
        starts from, read from `out_pre` (an input, where `cell_out` would be declared written)."""
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK_D)
        ok = i < D
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
                tl.store(gated_out + row, gated, mask=ok)
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
                tl.store(joined_out + row, joined, mask=ok)
                updated = joined * tl.load(cn_w + i, mask=ok, other=0.0) + tl.load(cn_b + i, mask=ok, other=0.0)
                if HAS_CELL_MASK:
                    updated *= tl.load(cell_mask + row, mask=ok, other=0.0)
                cell = tl.where(tl.load(residual_rows + b) > 0, updated, raw)
            tl.store(cell_out + row, cell, mask=ok)
        if HAS_NEXT:  # the next step's input norm
            normed_cell, _ = _standardize(cell, ok, D, eps)
            tl.store(next_normed_cell + row, normed_cell, mask=ok)
            normed = normed_cell * tl.load(in_w + i, mask=ok, other=0.0) + tl.load(in_b + i, mask=ok, other=0.0)
            if HAS_INPUT_MASK:
                normed *= tl.load(next_input_mask + row, mask=ok, other=0.0)
            tl.store(next_normed + row, normed, mask=ok)

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
        """Step t's row-wise backward, after finishing step t + 1's (its input norm, reading `read_cell`, the cell
        of step t). FIRST: only that finish, for the cell and raw cell the scan started from."""
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK_D)
        ok = i < D
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
            tl.store(grad_input_norm_out + row, grad_normed, mask=ok)
            cell = tl.load(read_cell + row, mask=ok, other=0.0)
            grad_cell += _standardize_grad(grad_normed * tl.load(in_w + i, mask=ok, other=0.0), cell, ok, D, eps)
            if NEXT_GATE:
                grad_raw += tl.load(grad_prev_raw_next + row, mask=ok, other=0.0)
        if FIRST:
            tl.store(grad_cell_out + row, grad_cell, mask=ok)
            tl.store(grad_raw_out + row, grad_raw, mask=ok)
        else:
            raw_cell = tl.load(raw + row, mask=ok, other=0.0)
            if HAS_GATE:
                has_residual = tl.load(residual_rows + b) > 0
                grad_update = tl.where(has_residual, grad_cell, 0.0)
                grad_raw += tl.where(has_residual, 0.0, grad_cell)
                if HAS_CELL_MASK:
                    grad_update *= tl.load(cell_mask + row, mask=ok, other=0.0)
                tl.store(grad_update_out + row, grad_update, mask=ok)
                value = tl.load(gate_pre + b * 2 * D + i, mask=ok, other=0.0)
                gate = tl.load(gate_pre + b * 2 * D + D + i, mask=ok, other=0.0)
                sigmoid = _sigmoid(gate)
                grad_joined = _standardize_grad(grad_update * tl.load(cn_w + i, mask=ok, other=0.0),
                                                raw_cell + value * sigmoid, ok, D, eps)  # fmt: skip
                tl.store(grad_gate_pre_out + b * 2 * D + i, grad_joined * sigmoid, mask=ok)
                grad_gate = grad_joined * value * sigmoid * (1.0 - sigmoid)
                tl.store(grad_gate_pre_out + b * 2 * D + D + i, grad_gate, mask=ok)
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
                tl.store(grad_written_out + row, grad, mask=ok)
                grad = _standardize_grad(grad * an_weight, summed, ok, D, eps)
                tl.store(grad_glu_pre_out + b * 2 * D + i, grad * sigmoid, mask=ok)
                tl.store(grad_glu_pre_out + b * 2 * D + D + i, grad * value * sigmoid * (1.0 - sigmoid), mask=ok)
            grad *= output_keep
            if OUTPUT_ACT:
                grad *= _silu_grad(output_pre)
            tl.store(grad_out_pre_out + row, grad, mask=ok)

    @triton.jit
    def _attention_grad_kernel(
        grad_out_pre, o_w, qkv_pre, query, read_key, read_value, attended, keys, values, bias, probs_mask,
        grad_read_keys, grad_read_values, grad_attended, grad_qkv_pre, grad_keys, grad_values,
        B, D, H, d, S, scale,
        QK_ACT: tl.constexpr, HAS_PROBS_MASK: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        h = tl.program_id(0)
        first_row = tl.program_id(1) * BLOCK_B
        rows = first_row + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        HD = H * d
        j = tl.arange(0, BLOCK_D)
        j_ok = j < d
        # The gradient of head h's attended value: grad_out_pre @ o_w[:, h d : (h + 1) d].
        grad_head = _rows_times(grad_out_pre, D, o_w + h * d, HD, 1, rows, row_ok, j, j_ok, D, BLOCK_B, BLOCK_K,
                                BLOCK_D)  # fmt: skip
        head = (rows[:, None] * H + h) * d + j[None, :]
        tl.store(grad_attended + head, grad_head, mask=row_ok[:, None] & j_ok[None, :])
        tl.debug_barrier()
        last_row = tl.minimum(B, first_row + BLOCK_B)
        for b in range(first_row, last_row):
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


def _block_rows(batch_size: int) -> int:
    """Rows per program: 16, whatever the batch (more rows are more programs). With 32 rows and 256-long reduction
    blocks the kernels ran out of shared memory on an H200."""
    return MIN_BLOCK


def _block(size: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(size))


if TRITON_AVAILABLE:
    # Each launch is one op: `torch.compile`, export and a dispatch counter see it as such. The outputs are
    # preallocated step slices of the scan's buffers, so the ops mutate them and return nothing; on the meta device
    # (shape checks and kernel counts without a GPU) they do nothing.

    @triton_op(
        "ran_hf::scan_project",
        mutates_args={"qkv_pre", "query", "read_key", "read_value", "attended", "glu_pre", "gate_pre"},
    )
    def scan_project(
        normed: torch.Tensor, prev_raw: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor, ag_w: torch.Tensor,
        ag_b: torch.Tensor, cg_w: torch.Tensor, cg_b: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
        bias: torch.Tensor, probs_mask: torch.Tensor, qkv_pre: torch.Tensor, query: torch.Tensor,
        read_key: torch.Tensor, read_value: torch.Tensor, attended: torch.Tensor, glu_pre: torch.Tensor,
        gate_pre: torch.Tensor, qk_act: bool, has_glu: bool, has_gate: bool, has_probs_mask: bool,
    ) -> None:  # fmt: skip
        batch_size, num_heads, num_slots, head_dim = keys.shape
        hidden = normed.shape[-1]
        block_rows = _block_rows(batch_size)
        glu_blocks = triton.cdiv(2 * hidden, BLOCK_N)
        programs = num_heads + glu_blocks * has_glu + glu_blocks * has_gate
        grid = (programs, triton.cdiv(batch_size, block_rows))
        wrap_triton(_project_kernel)[grid](
            normed, prev_raw, qkv_w, qkv_b, ag_w, ag_b, cg_w, cg_b, keys, values, bias, probs_mask,
            qkv_pre, query, read_key, read_value, attended, glu_pre, gate_pre,
            batch_size, hidden, num_heads, head_dim, num_slots, head_dim**-0.5,
            QK_ACT=qk_act, HAS_GLU=has_glu, HAS_GATE=has_gate, HAS_PROBS_MASK=has_probs_mask,
            BLOCK_B=block_rows, BLOCK_K=BLOCK_K, BLOCK_D=_block(head_dim), BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S,
            num_warps=NUM_WARPS,
        )  # fmt: skip

    @triton_op("ran_hf::scan_output", mutates_args={"out_pre"})
    def scan_output(
        attended: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor, shift: torch.Tensor, out_pre: torch.Tensor,
        has_shift: bool,
    ) -> None:  # fmt: skip
        batch_size, hidden = out_pre.shape
        block_rows = _block_rows(batch_size)
        grid = (triton.cdiv(hidden, BLOCK_N), triton.cdiv(batch_size, block_rows))
        wrap_triton(_output_kernel)[grid](
            attended, o_w, o_b, shift, out_pre, batch_size, hidden, attended.shape[-1], HAS_SHIFT=has_shift,
            BLOCK_B=block_rows, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
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
        mutates_args={"grad_attended", "grad_qkv_pre", "grad_keys", "grad_values"},
    )
    def scan_attention_grad(
        grad_out_pre: torch.Tensor, o_w: torch.Tensor, qkv_pre: torch.Tensor, query: torch.Tensor,
        read_key: torch.Tensor, read_value: torch.Tensor, attended: torch.Tensor, keys: torch.Tensor,
        values: torch.Tensor, bias: torch.Tensor, probs_mask: torch.Tensor, grad_read_keys: torch.Tensor,
        grad_read_values: torch.Tensor, grad_attended: torch.Tensor, grad_qkv_pre: torch.Tensor,
        grad_keys: torch.Tensor, grad_values: torch.Tensor, qk_act: bool, has_probs_mask: bool,
    ) -> None:  # fmt: skip
        batch_size, num_heads, num_slots, head_dim = keys.shape
        block_rows = _block_rows(batch_size)
        wrap_triton(_attention_grad_kernel)[(num_heads, triton.cdiv(batch_size, block_rows))](
            grad_out_pre, o_w, qkv_pre, query, read_key, read_value, attended, keys, values, bias, probs_mask,
            grad_read_keys, grad_read_values, grad_attended, grad_qkv_pre, grad_keys, grad_values,
            batch_size, grad_out_pre.shape[-1], num_heads, head_dim, num_slots, head_dim**-0.5,
            QK_ACT=qk_act, HAS_PROBS_MASK=has_probs_mask,
            BLOCK_B=block_rows, BLOCK_K=BLOCK_K, BLOCK_D=_block(head_dim), BLOCK_S=BLOCK_S, num_warps=NUM_WARPS,
        )  # fmt: skip

    @triton_op("ran_hf::scan_input_grad", mutates_args={"grad_normed", "grad_prev_raw"})
    def scan_input_grad(
        grad_qkv_pre: torch.Tensor, qkv_w: torch.Tensor, grad_glu_pre: torch.Tensor, ag_w: torch.Tensor,
        grad_gate_pre: torch.Tensor, cg_w: torch.Tensor, grad_normed: torch.Tensor, grad_prev_raw: torch.Tensor,
        has_glu: bool, has_gate: bool,
    ) -> None:  # fmt: skip
        batch_size, hidden = grad_normed.shape
        block_rows = _block_rows(batch_size)
        grid = (triton.cdiv(hidden, BLOCK_N), triton.cdiv(batch_size, block_rows))
        wrap_triton(_input_grad_kernel)[grid](
            grad_qkv_pre, qkv_w, grad_glu_pre, ag_w, grad_gate_pre, cg_w, grad_normed, grad_prev_raw,
            batch_size, hidden, qkv_w.shape[0] // 3, HAS_GLU=has_glu, HAS_GATE=has_gate,
            BLOCK_B=block_rows, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
        )  # fmt: skip

    for _op in (scan_project, scan_output, scan_write, scan_write_grad, scan_attention_grad, scan_input_grad):
        try:
            _op.register_kernel("meta")(lambda *args, **kwargs: None)
        except RuntimeError:  # some PyTorch versions give every triton_op a meta kernel of their own
            pass


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

    project, output, write = launchers(cell, scan_project, scan_output, scan_write)
    write(  # the input norm of the cell the scan starts from
        cell, absent(), absent(), rows[0], absent(), absent(), absent(), at(dropout.input, 0), absent(), absent(),
        absent(), absent(), in_w, in_b, absent(), absent(), absent(), absent(), normed_cells[0], normed[0], eps,
        [False, False, False, True, False, False, False, dropout.input is not None, True],
    )  # fmt: skip
    for step in range(num_steps):
        gate_on = step_has_gate(plan, step)
        project(
            normed[step], previous_raw if step == 0 else raw_cells[step - 1], qkv_w, qkv_b, absent(ag_w),
            absent(ag_b), absent(cg_w), absent(cg_b), keys[step], values[step], bias[step], at(dropout.probs, step),
            qkv_pre[step], query[step], read_keys[step], read_values[step], attended[step], at(glu_pre, step),
            at(gate_pre, step), plan.qk_activation, has_glu, gate_on, dropout.probs is not None,
        )  # fmt: skip
        output(attended[step], o_w, o_b, at(output_shift, step), out_pre[step], output_shift is not None)
        has_next = step + 1 < num_steps
        write(
            out_pre[step], at(glu_pre, step), at(gate_pre, step), rows[min(step, 1)], at(dropout.output, step),
            at(dropout.written, step), at(dropout.cell, step), at(dropout.input, step + 1) if has_next else absent(),
            absent(an_w), absent(an_b), absent(cn_w), absent(cn_b), in_w, in_b, raw_cells[step], cells[step],
            at(gated, step), at(joined, step), normed_cells[step + 1] if has_next else absent(),
            normed[step + 1] if has_next else absent(), eps,
            [plan.output_activation, has_glu, gate_on, has_next, dropout.output is not None,
             dropout.written is not None, dropout.cell is not None, dropout.input is not None, False],
        )  # fmt: skip
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

    write_grad, attention_grad, input_grad = launchers(
        cell, scan_write_grad, scan_attention_grad, scan_input_grad
    )
    for step in reversed(range(num_steps)):
        last, gate_on = step == num_steps - 1, step_has_gate(plan, step)
        write_grad(
            grad_cells[step], grad_raw_cells[step], grad_normed, grad_prev_raw,
            absent() if last else at(dropout.input, step + 1), state["cells"][step], in_w, state["out_pre"][step],
            at(state["glu_pre"], step), at(state["gate_pre"], step), state["raw_cells"][step], rows[min(step, 1)],
            at(dropout.output, step), at(dropout.written, step), at(dropout.cell, step), absent(an_w), absent(an_b),
            absent(cn_w), absent() if last else grad_input_norm[step + 1], at(grad_update, step),
            at(grad_gate_pre, step), at(grad_written, step), at(grad_glu_pre, step), grad_out_pre[step], absent(),
            absent(), eps,
            [last, False, has_gate and not last, plan.output_activation, has_glu, gate_on, *masks, has_input_mask],
        )  # fmt: skip
        attention_grad(
            grad_out_pre[step], o_w, qkv_pre[step], state["query"][step], state["read_keys"][step],
            state["read_values"][step], state["attended"][step], keys[step], state["values"][step],
            state["bias"][step], at(dropout.probs, step), grad_read_keys[step], grad_read_values[step], grad_attended,
            grad_qkv_pre[step], grad_keys[step], grad_values[step], plan.qk_activation, dropout.probs is not None,
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
