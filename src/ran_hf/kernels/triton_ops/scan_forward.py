"""The Triton scan's kernels (`triton.jit`) and the ops that launch them (`torch.library.triton_op`, one op a
launch). triton_scan.py runs them step by step and says what each computes.

Without Triton this module still imports; `TRITON_AVAILABLE` says whether the kernels exist. `TRITON_INTERPRET=1`
runs them on CPU tensors (slowly), which is how CPU tests check them.

Shapes: N scan steps, B batch, H heads, d head size, D hidden size, S window slots.
"""

import functools
import importlib.util

import torch


# Whether Triton is installed (optional: the reference and fused scans need none), asked without importing it.
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
KERNEL_BUILD_ERRORS: tuple = ()  # see `kernel_build_errors`

# `hidden_act` names of SiLU, the one activation the fused and Triton kernels compute
SILU_ACTIVATIONS = ("silu", "swish")

# Rows of the batch per program, and the least block of any side: tl.dot needs at least 16 on each side, so small
# batches are padded (masked) to 16.
MIN_BLOCK = 16
# Chosen on an H200 at BERT-base width (benchmarks/cuda/tune_triton_scan.json): the matrix-vector kernels are
# bound by the latency of their reduction loops, so long reduction blocks and more, narrower column programs win.
BLOCK_K = 256  # the reduction block of every matrix-vector product
BLOCK_N = 32  # output columns per program of the column-parallel products
BLOCK_S = 64  # window slots per iteration of the attention loops
NUM_WARPS = 8  # of the matrix-vector kernels
# Programs a head's window attention is split over, by rows of the batch: each walks at most 16 / 8 rows' windows.
ROW_SPLITS = 8


def register_meta_no_ops(*ops) -> None:
    """The ops mutate preallocated outputs and return nothing: on the meta device (shape checks and kernel counts
    without a GPU) they do nothing."""
    for op in ops:
        try:
            op.register_kernel("meta")(lambda *args, **kwargs: None)
        except RuntimeError:  # some PyTorch versions give every triton_op a meta kernel of their own
            pass


def kernel_build_errors() -> tuple:
    """What a kernel that cannot be built for this GPU raises (too little shared memory, a compiler error): Triton's
    exceptions, set when the kernels are defined (none before)."""
    return KERNEL_BUILD_ERRORS


def check_kernels(ready: bool, what: str) -> None:
    """Raise where a module's kernels could not be defined (`ready` is its `kernels_ready()`)."""
    if not ready:
        raise ImportError(f"{what} runs Triton kernels, and Triton cannot be imported here (`pip install triton`).")


def _block_rows(batch_size: int) -> int:
    """Rows per program: 16, whatever the batch (more rows are more programs). With 32 rows and 256-long reduction
    blocks the kernels ran out of shared memory on an H200."""
    return MIN_BLOCK


def _block(size: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(size))


@functools.cache
def kernels_ready() -> bool:
    """Imports Triton and defines this module's kernels and the ops that launch them, once, when first asked for: a
    machine that runs none of them never imports Triton. Whether they exist (False: Triton cannot be imported). Every
    name defined here is a module global, where `triton.jit` looks up a kernel's helpers."""
    global triton, tl, triton_op, wrap_triton, KERNEL_BUILD_ERRORS, scan_attention_grad, scan_input_grad, scan_output
    global scan_project, scan_write, scan_write_grad, _attention_grad_kernel, _input_grad_kernel, _output_kernel
    global _project_kernel, _rows_times, _sigmoid, _silu_grad, _standardize, _standardize_grad, _write_grad_kernel
    global _write_grad_rows, _write_kernel, _write_rows
    # In a `try`, Triton is not among the packages Transformers requires before it loads a saved folder's code.
    try:
        import triton
        import triton.language as tl
        from torch.library import triton_op, wrap_triton
    except ImportError:
        return False
    KERNEL_BUILD_ERRORS = (triton.compiler.errors.CompilationError, triton.runtime.errors.OutOfResources)

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
        block_rows = _block_rows(batch_size)
        glu_blocks = triton.cdiv(2 * hidden, BLOCK_N)
        programs = num_heads + glu_blocks * has_glu + glu_blocks * has_gate
        grid = (programs, triton.cdiv(batch_size, block_rows), min(ROW_SPLITS, batch_size))
        wrap_triton(_project_kernel)[grid](
            normed, prev_raw, qkv_w, qkv_b, ag_w, ag_b, cg_w, cg_b, keys, values, bias, probs_mask,
            qkv_pre, query, read_key, read_value, attended, glu_pre, gate_pre,
            w_out_pre, w_glu_pre, w_gate_pre, residual_rows, output_mask, written_mask, cell_mask, input_mask,
            an_w, an_b, cn_w, cn_b, in_w, in_b, raw_out, cell_out, gated_out, joined_out, normed_cell_out, normed_out,
            batch_size, hidden, num_heads, head_dim, num_slots, head_dim**-0.5, eps,
            QK_ACT=qk_act, HAS_GLU=has_glu, HAS_GATE=has_gate, HAS_PROBS_MASK=has_probs_mask, WRITE=write,
            OUTPUT_ACT=output_act, WRITE_GATE=write_gate, HAS_OUTPUT_MASK=has_output_mask,
            HAS_WRITTEN_MASK=has_written_mask, HAS_CELL_MASK=has_cell_mask, HAS_INPUT_MASK=has_input_mask,
            BLOCK_B=block_rows, BLOCK_K=BLOCK_K, BLOCK_D=_block(head_dim), BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S,
            BLOCK_HIDDEN=triton.next_power_of_2(hidden), num_warps=NUM_WARPS,
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
        block_rows = _block_rows(batch_size)
        grid = (num_heads, triton.cdiv(batch_size, block_rows), min(ROW_SPLITS, batch_size))
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
            BLOCK_B=block_rows, BLOCK_K=BLOCK_K, BLOCK_D=_block(head_dim), BLOCK_S=BLOCK_S,
            BLOCK_HIDDEN=triton.next_power_of_2(hidden), num_warps=NUM_WARPS,
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

    register_meta_no_ops(scan_project, scan_output, scan_write, scan_write_grad, scan_attention_grad, scan_input_grad)
    return True
