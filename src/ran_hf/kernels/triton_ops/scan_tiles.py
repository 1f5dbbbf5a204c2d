"""How the Triton scan's kernels tile their work, read at every launch (scripts/benchmarks/tune_triton_scan.py and the
CPU tests set them).

Shapes: B batch, d head size.
"""

import triton


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


def block_rows(batch_size: int) -> int:
    """Rows per program: 16, whatever the batch (more rows are more programs). With 32 rows and 256-long reduction
    blocks the kernels ran out of shared memory on an H200."""
    return MIN_BLOCK


def block(size: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(size))
