"""Which implementation each op runs, chosen here and nowhere else.

Five ops have a fast path beside their plain PyTorch one (the model's; the fast ones attach to it through
ran_hf/kernel_hub.py, each from this folder's mapping, `ran_hf.kernels.KERNELS`):

    op                  implementations                       where the fast one runs
    "norm"              "triton" | "pytorch"                  CUDA (and meta), not compiled, D <= 16384
    "glu"               "triton" | "pytorch"                  CUDA (and meta), not compiled
    "rotary"            "triton" | "pytorch"                  CUDA (and meta), not compiled, at most 4 axes
    "window_projection" "triton" | "pytorch"                  CUDA (and meta), not compiled, SiLU, no cached tokens
    "scan"              "triton" | "fused" | "reference"      `config.scan_implementation`, below
                        | "export" | a registered name

Each Triton op also needs Triton installed and importable (`triton_ready`, which imports Triton and the kernels'
modules, `triton_ops/`, the first time it is asked, and only then: `import ran_hf` never imports it). The meta device stands in for CUDA: it runs no
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

The kernels' entries (token_ops.py, cell_scan.py) ask `choose(op, ...)` at every call of a decorated op and run
what it says. `CHOSEN` keeps the last choice per op (outside compiled code), so a test can list the path every op
took. `TRITON` switches a Triton token-wise kernel off (`ran_hf.kernels.choice.TRITON["glu"] = False`); `FORCED`
makes `choose` return a given implementation whatever the rule says (tests run the Triton kernels on CPU in
Triton's interpreter that way).
"""

import functools
import importlib.util
import os

import torch
from torch import nn
from transformers.utils import logging


logger = logging.get_logger(__name__)

# Whether Triton is installed (optional: the reference and fused scans need none), asked without importing it.
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
# `hidden_act` names of SiLU, the one activation the fused and Triton kernels compute
SILU_ACTIVATIONS = ("silu", "swish")

TRITON_TOKEN_OPS = ("norm", "glu", "rotary", "window_projection")
# Whether each Triton token-wise kernel may run. On by default: the Triton norm and rotary embedding took a BERT-base
# 8 x 8K training step from 789 to 651 ms on an H200 (benchmarks/cuda/profile_h200_four_launch_8x8192.json).
TRITON = dict.fromkeys(TRITON_TOKEN_OPS, True)
FORCED: dict[str, str] = {}  # op -> implementation, whatever the rule says
CHOSEN: dict[str, str] = {}  # op -> the implementation it last ran (not recorded inside compiled code)
# The children whose weights the fused scans read, with the module's own, instead of calling it; by the name the
# module's class declares with `kernel_layer_name` (ran_hf/kernel_hub.py), or `nn.Linear`. Anything else (a LoRA
# wrapper, a quantised linear, a subclass) is called by the reference scan only.
PLAIN_WEIGHT_CHILDREN = {"RANCenteredRMSNorm": (), "RANGatedLinearUnit": ("proj",)}
BUILD_FAILURES: list = []  # a scan kernel that could not be built here: the Triton scan is not tried again


TRITON_DEVICES = ("cuda", "meta")  # the meta device counts the launches a GPU would make


@functools.cache
def triton_ready() -> bool:
    """Whether the Triton kernels can run here: Triton imports, and with it `triton_ops`, whose modules define the
    kernels. Imported here, once, when a rule first asks: a machine that runs no kernel never imports Triton."""
    if not TRITON_AVAILABLE:
        return False
    try:
        from . import triton_ops  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_build_errors() -> tuple:
    """What a kernel that cannot be built for this GPU raises (too little shared memory, a compiler error): Triton's
    exceptions where it imports (none elsewhere)."""
    if not triton_ready():
        return ()
    from .triton_ops import KERNEL_BUILD_ERRORS

    return KERNEL_BUILD_ERRORS


def record_build_failure(error: Exception) -> None:
    """A kernel could not be built for this GPU (`kernel_build_errors`): the Triton scan is not tried again here, and
    `triton_scan_unsupported` says why."""
    BUILD_FAILURES.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


def triton_scan_unsupported(cell: torch.Tensor) -> str | None:
    """Why the Triton scan cannot run on this input, or None if it can."""
    if not TRITON_AVAILABLE:
        return "Triton is not installed"
    if BUILD_FAILURES:
        return f"its kernels could not be built on this device ({BUILD_FAILURES[0]})"
    # The meta device runs no kernel at all: it checks shapes and counts launches (benchmark_kernels.py).
    if cell.device.type not in TRITON_DEVICES and os.environ.get("TRITON_INTERPRET") != "1":
        return f"its kernels run on CUDA devices (the input is on {cell.device.type})"
    if cell.dtype == torch.float64:
        return "it computes in float32, and the input is float64"
    if not triton_ready():
        return "Triton cannot be imported"
    return None


def plain_module(module: nn.Module, name: str) -> bool:
    """Whether a kernel may read `module`'s weights past its call: its class is the one `name` names itself
    (`kernel_layer_name` on the class itself, not inherited: an adapter's wrapper or a quantised subclass is called),
    or `nn.Linear` for "Linear", and it has no Accelerate hook (offloaded weights arrive only when it is called)."""
    kind = type(module)
    named = kind is nn.Linear if name == "Linear" else kind.__dict__.get("kernel_layer_name") == name
    return named and "_hf_hook" not in module.__dict__


def _on_a_triton_device(op: str, tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type in TRITON_DEVICES and TRITON[op] and TRITON_AVAILABLE and not torch.compiler.is_compiling()
    )


def _norm(hidden_states: torch.Tensor) -> str:
    fits = hidden_states.shape[-1] <= 16384  # a program holds whole rows
    runs = _on_a_triton_device("norm", hidden_states) and fits and triton_ready()
    return "triton" if runs else "pytorch"


def _glu(projected: torch.Tensor) -> str:
    return "triton" if _on_a_triton_device("glu", projected) and triton_ready() else "pytorch"


def _rotary(states: torch.Tensor) -> str:
    fits = states.dim() <= 4
    return "triton" if _on_a_triton_device("rotary", states) and fits and triton_ready() else "pytorch"


def _window_projection(projected: torch.Tensor, hidden_act: str, cached: bool) -> str:
    # A continuation's slots also read the cache's tail, which the kernel does not.
    fits = hidden_act in SILU_ACTIVATIONS and not cached
    runs = _on_a_triton_device("window_projection", projected) and fits and triton_ready()
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
        children = (
            ()
            if type(module) is nn.Linear
            else PLAIN_WEIGHT_CHILDREN.get(type(module).__dict__.get("kernel_layer_name"))
        )
        if children is None or module._forward_hooks or module._forward_pre_hooks:
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            wrapped = f"`{name}` is wrapped ({kind}, or forward hooks)"
            return f"it reads plain weights, and {wrapped}: adapters would be skipped"
        if "_hf_hook" in module.__dict__:  # Accelerate's hooks replace `forward`, not torch's hook registries
            return (
                f"it reads plain weights, and `{name}` has an Accelerate hook (offloaded weights arrive on its call)"
            )
        for child in children:
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
