"""RAN's Triton kernels (`triton.jit`) and the ops that launch them (`torch.library.triton_op`, one op a launch),
defined at the top of their modules.

Importing this package imports Triton, and fails where it cannot be imported: `ran_hf.kernels.choice` imports it only
where Triton is installed and a kernel is chosen, so `import ran_hf` (and a machine that runs no kernel) never does.
`TRITON_INTERPRET=1`, set before the import, runs the kernels on CPU tensors (slowly): how the CPU tests check them.
"""

import triton


# What a kernel that cannot be built for this GPU raises (too little shared memory, a compiler error).
KERNEL_BUILD_ERRORS = (triton.compiler.errors.CompilationError, triton.runtime.errors.OutOfResources)


def register_meta_no_ops(*ops) -> None:
    """The ops mutate preallocated outputs and return nothing: on the meta device (shape checks and kernel counts
    without a GPU) they do nothing."""
    for op in ops:
        register_on_meta(op, lambda *args, **kwargs: None)


def register_on_meta(op, kernel) -> None:
    """`kernel` runs `op` on the meta device, which runs no kernel (shape checks and kernel counts without a GPU)."""
    try:
        op.register_kernel("meta")(kernel)
    except RuntimeError:  # some PyTorch versions give every triton_op a meta kernel of their own
        pass
