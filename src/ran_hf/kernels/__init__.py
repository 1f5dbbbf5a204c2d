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
    choose_glu_forward,
    choose_norm_forward,
    choose_rotary,
    choose_standardize,
    choose_window_projection,
)


# The name a decorator of the model gives (`use_kernel_forward` on a module class, `use_kernel_function` on a function
# or method) -> the kernel's chooser, with the decorated callable's signature: the implementation to run for those
# arguments, or None for the plain one.
KERNELS = {
    "standard_normalize": choose_standardize,
    "RANCenteredRMSNorm": choose_norm_forward,
    "RANGatedLinearUnit": choose_glu_forward,
    "apply_interleaved_rotary": choose_rotary,
    "project_windows": choose_window_projection,
    "cell_scan": choose_cell_scan,
}
