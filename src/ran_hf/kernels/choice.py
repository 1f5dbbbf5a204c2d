"""Which implementation each op runs, chosen here and nowhere else.

Five ops have a fast path beside their plain PyTorch one:

    op                  implementations                       where the fast one runs
    "norm"              "triton" | "pytorch"                  CUDA (and meta), not compiled, D <= 16384
    "glu"               "triton" | "pytorch"                  CUDA (and meta), not compiled
    "rotary"            "triton" | "pytorch"                  CUDA (and meta), not compiled, at most 4 axes
    "window_projection" "triton" | "pytorch"                  CUDA (and meta), not compiled, SiLU, no cached tokens
    "scan"              "triton" | "fused" | "reference"      `config.scan_implementation`, below
                        | "export" | a registered name

Each Triton op also needs Triton installed and its kernels defined (`kernels_ready`, which imports Triton the first
time it is asked, and only then: `import ran_hf` never imports it). The meta device stands in for CUDA: it runs no
kernel, and counts the launches a GPU would make (scripts/benchmarks/benchmark_kernels.py). Under `torch.compile`
the token-wise ops run their PyTorch form, which the compiler fuses itself.

The cell scan (`config.scan_implementation`):
- "auto" (the default): "triton" on a CUDA device where it can run; elsewhere "fused" in float32 inference (no
  gradient recorded, not compiled), where it can run: the same loop in fewer, larger ops and a third of the Python
  calls (8K tokens on a CPU: 529 ms instead of 717); else "reference".
- "triton": the fused scan's autograd node with its steps in Triton kernels; "fused" where those cannot run (no
  Triton, not CUDA, float64, kernels that could not be built for this GPU) or under `torch.compile`.
- "fused": one autograd node with a hand-written backward; "reference" where it cannot run (an activation other
  than SiLU, or a wrapped projection or norm whose weights it would read past: LoRA adapters, quantisation, hooks).
- "reference": the plain loop; under `torch.compile` the fused scan's single custom op where it can run (the loop
  would be unrolled into a graph rebuilt for every window count), and under `torch.export` its `scan` operator form
  ("export").
Every fallback says why, once. A name registered with `RANScanInterface.register` runs as it is.

The modeling code asks `choose(op, ...)` at its one call site per op and runs what it is told. `CHOSEN` keeps the
last choice per op (outside compiled code), so a test can list the path every op took. `TRITON` switches a Triton
token-wise kernel off (`ran_hf.kernel_choice.TRITON["glu"] = False`); `FORCED` makes `choose` return a given
implementation whatever the rule says (tests run the Triton kernels on CPU in Triton's interpreter that way).
"""

import torch
from torch import nn
from transformers.utils import logging

from .triton_glu import kernels_ready as glu_kernels_ready
from .triton_norm import kernels_ready as norm_kernels_ready
from .triton_rotary import kernels_ready as rotary_kernels_ready
from .triton_scan import triton_scan_unsupported
from .triton_scan_kernels import SILU_ACTIVATIONS, TRITON_AVAILABLE
from .triton_window_projection import kernels_ready as window_projection_kernels_ready


logger = logging.get_logger(__name__)

TRITON_TOKEN_OPS = ("norm", "glu", "rotary", "window_projection")
# Whether each Triton token-wise kernel may run. On by default: the Triton norm and rotary embedding took a BERT-base
# 8 x 8K training step from 789 to 651 ms on an H200 (benchmarks/cuda/profile_h200_four_launch_8x8192.json).
TRITON = dict.fromkeys(TRITON_TOKEN_OPS, True)
FORCED: dict[str, str] = {}  # op -> implementation, whatever the rule says
CHOSEN: dict[str, str] = {}  # op -> the implementation it last ran (not recorded inside compiled code)
# Modules whose weights the fused scans read instead of calling the module, with the children whose weights they
# read: anything else (a LoRA wrapper, a quantised linear, a subclass) is called by the reference scan only.
# building_blocks.py adds its norm and its gated linear unit.
PLAIN_WEIGHT_MODULES: dict = {nn.Linear: ()}


TRITON_DEVICES = ("cuda", "meta")  # the meta device counts the launches a GPU would make


def _on_a_triton_device(op: str, tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type in TRITON_DEVICES and TRITON[op] and TRITON_AVAILABLE and not torch.compiler.is_compiling()
    )


def _norm(hidden_states: torch.Tensor) -> str:
    fits = hidden_states.shape[-1] <= 16384  # a program holds whole rows
    runs = _on_a_triton_device("norm", hidden_states) and fits and norm_kernels_ready()
    return "triton" if runs else "pytorch"


def _glu(projected: torch.Tensor) -> str:
    return "triton" if _on_a_triton_device("glu", projected) and glu_kernels_ready() else "pytorch"


def _rotary(states: torch.Tensor) -> str:
    fits = states.dim() <= 4
    return "triton" if _on_a_triton_device("rotary", states) and fits and rotary_kernels_ready() else "pytorch"


def _window_projection(projected: torch.Tensor, hidden_act: str, cached: bool) -> str:
    # A continuation's slots also read the cache's tail, which the kernel does not.
    fits = hidden_act in SILU_ACTIVATIONS and not cached
    runs = _on_a_triton_device("window_projection", projected) and fits and window_projection_kernels_ready()
    return "triton" if runs else "pytorch"


def fused_scan_unsupported(hidden_act: str, modules_read: dict) -> str | None:
    """Why the fused scan cannot run a layer with activation `hidden_act` and `modules_read`, every module whose
    weights the scan reads by name (`cell_scan.RANCellScan.modules_read`: the layer's and the scan's own), or None if
    it can."""
    if hidden_act not in SILU_ACTIVATIONS:
        return f"it computes SiLU activations only (`hidden_act` is {hidden_act!r})"
    # It reads weights, not modules: a wrapped projection (LoRA adapters, quantisation, hooks) would be bypassed.
    modules = [(name, module) for name, module in modules_read.items() if module is not None]
    while modules:
        name, module = modules.pop(0)
        if type(module) not in PLAIN_WEIGHT_MODULES or module._forward_hooks or module._forward_pre_hooks:
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            wrapped = f"`{name}` is wrapped ({kind}, or forward hooks)"
            return f"it reads plain weights, and {wrapped}: adapters would be skipped"
        if "_hf_hook" in module.__dict__:  # Accelerate's hooks replace `forward`, not torch's hook registries
            return (
                f"it reads plain weights, and `{name}` has an Accelerate hook (offloaded weights arrive on its call)"
            )
        for child in PLAIN_WEIGHT_MODULES[type(module)]:
            modules.append((f"{name}.{child}", module._modules[child]))
    return None


def inference_in_float32(cell: torch.Tensor) -> bool:
    """No gradient recorded, not compiled, and a float32 cell: where "auto" runs the fused scan off CUDA. (It computes
    in float32 whatever the dtype; the reference, in the cell's, would differ from it in bfloat16.)"""
    return not torch.is_grad_enabled() and cell.dtype == torch.float32 and not torch.compiler.is_compiling()


def _scan(requested: str, hidden_act: str, modules_read: dict, cell: torch.Tensor) -> str:
    """The cell scan that runs for `config.scan_implementation == requested` (see the module's docstring)."""
    if requested == "auto":
        if cell.device.type == "cuda" and triton_scan_unsupported(cell) is None:
            requested = "triton"
        elif inference_in_float32(cell) and fused_scan_unsupported(hidden_act, modules_read) is None:
            return "fused"  # the same loop in fewer, larger ops and Python calls, where its backward is not needed
        else:
            requested = "reference"
    if requested == "triton":
        reason = triton_scan_unsupported(cell)
        if reason is None and not torch.compiler.is_compiling():
            if fused_scan_unsupported(hidden_act, modules_read) is None:
                return "triton"
        elif reason is not None:
            logger.warning_once(f"The Triton cell scan runs the fused scan instead: {reason}.")
        requested = "fused"
    if requested == "fused":
        reason = fused_scan_unsupported(hidden_act, modules_read)
        if reason is None:
            return "fused"
        logger.warning_once(f"The fused cell scan runs the reference scan instead: {reason}.")
        requested = "reference"
    if requested != "reference":  # registered by name (`RANScanInterface.register`)
        return requested
    if torch.compiler.is_exporting():
        return "export"
    if torch.compiler.is_compiling():
        reason = fused_scan_unsupported(hidden_act, modules_read)
        if reason is None:
            return "fused"
        logger.warning_once(
            f"Compiled, the cell scan is unrolled into the graph, which is then rebuilt for every number of windows: "
            f"its single-op form cannot run here, as {reason}."
        )
    return "reference"


RULES = {
    "norm": _norm,
    "glu": _glu,
    "rotary": _rotary,
    "window_projection": _window_projection,
    "scan": _scan,
}


def choose(op: str, *args) -> str:
    """The implementation `op` runs for these arguments: `FORCED[op]` where set, else its rule's answer.

    norm: (hidden_states); glu: (projected); rotary: (states); window_projection: (projected, hidden_act, cached);
    scan: (config.scan_implementation, config.hidden_act, the modules the scan reads, the starting cell).
    """
    if FORCED:
        name = FORCED.get(op) or RULES[op](*args)
    elif op in TRITON and args[0].device.type not in TRITON_DEVICES:  # a token-wise op off CUDA: no rule to ask
        name = "pytorch"
    else:
        name = RULES[op](*args)
    if name != CHOSEN.get(op) and not torch.compiler.is_compiling():  # (a dict store is cheaper than the question)
        CHOSEN[op] = name
    return name
