"""RAN's fast implementations: the fused cell scan, and the Triton kernels of the scan and the token-wise ops. The plain
PyTorch implementations are the model's; these attach to them by name (ran_hf/kernel_hub.py), as Transformers
attaches Hub kernels, from the mapping below. Saved folders do not ship this folder: where `ran_hf` is installed,
their code takes its kernels from here; elsewhere it runs its plain implementations.

    token_ops.py         the normalisations, the gated linear unit, the rotary embedding, the window projection
    cell_scan.py         the fused and Triton cell scans, and the adapter from the layer's modules to their weights
    choice.py            which implementation each op runs (`choose`), and the switches `TRITON`, `FORCED`, `CHOSEN`
    fused_scan.py        the scan as one autograd node with a hand-written backward (tensors and weights)
    scan_op.py           that scan as one custom op (`torch.ops.ran_hf.cell_scan`) for `torch.compile`
    triton_ops/          the Triton kernels, at the top of their modules: imported only where Triton imports

Importing this package imports neither Triton nor any modeling module.
"""

from .cell_scan import choose_cell_scan
from .token_ops import (
    choose_window_projection,
    chosen_by,
    token_op,
    triton_glu_forward,
    triton_norm_forward,
    triton_rotary,
    triton_standardize,
)


# The name a decorator of the model gives (`use_kernel_forward` on a module class, `use_kernel_function` on a function
# or method) -> what attaches the kernel to the plain op: given the plain op, the op that runs (of the same
# signature), which takes the fast implementation where it can run and the plain op elsewhere.
KERNELS = {
    "standard_normalize": token_op("norm", triton_standardize),
    "RANCenteredRMSNorm": token_op("norm", triton_norm_forward, states_at=1),
    "RANGatedLinearUnit": token_op("glu", triton_glu_forward, states_at=1),
    "apply_interleaved_rotary": token_op("rotary", triton_rotary),
    "project_windows": chosen_by(choose_window_projection),
    "cell_scan": chosen_by(choose_cell_scan),
}
