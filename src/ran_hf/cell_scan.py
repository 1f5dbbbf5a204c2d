"""The cell scan: the one sequential part of a RAN layer, window by window.

A scan function has the signature of `reference_cell_scan`. It takes the layer (whose projections and norms it
uses) and returns, per scan step, the key and value of the cell each window reads, its raw cell and its cell. The
layer calls the function that `config.scan_implementation` names in `ALL_SCAN_FUNCTIONS`; other implementations
(a benchmark's variant of the design) join with `RANScanInterface.register`, as attention functions join
Transformers' `AttentionInterface`.

Registered here: "reference", the plain loop that autograd records op by op; "fused", the same maths as one
autograd node with a hand-written backward (fused_scan.py), which runs the reference, warning once, where it cannot;
"triton", that node with each window's steps in Triton kernels (triton_scan.py), which runs the fused scan where it
cannot; and "auto" (the default), Triton on CUDA where it can run, the reference elsewhere. The fused and Triton
scans take tensors and plain weights: `fused_scan` below reads them from the layer.
"""

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging
from transformers.utils.generic import GeneralInterface

from .building_blocks import RANLayerNorm, gather_rows
from .fused_scan import FusedCellScan, ScanPlan, window_maxima
from .scan_dropout import NO_DROPOUT, ScanDropout, draw_scan_dropout, drop
from .scan_op import cell_scan_op
from .triton_scan import BUILD_FAILURES, TRITON_KERNELS, kernel_build_errors, triton_scan_unsupported
from .triton_scan_kernels import SILU_ACTIVATIONS
from .window_layout import RANWindowLayout

logger = logging.get_logger(__name__)


def step_major(keys: torch.Tensor, values: torch.Tensor, layout: RANWindowLayout):
    """The window slots each scan step reads, (N, B, H, S, d) keys and values and their (N, B, S) mask.

    A sequence that has run out of windows reads its first one with every slot masked (its results are never
    used). One sequence needs no gather at all.
    """
    if layout.full_grid:  # every sequence has every step's window, packed step-major: a view
        steps = (layout.num_steps, layout.batch_size)
        return keys.unflatten(0, steps), values.unflatten(0, steps), layout.slot_mask.unflatten(0, steps)
    has_window = layout.step_windows < keys.shape[0]  # (N, B)
    windows = torch.where(has_window, layout.step_windows, 0)
    step_mask = layout.slot_mask[windows] & has_window[..., None]  # (N, B, S)
    return gather_rows(keys, windows), gather_rows(values, windows), step_mask


def reference_cell_scan(
    layer: nn.Module,  # a RANLayer
    cell: torch.Tensor,
    previous_raw: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: RANWindowLayout,
):
    """Window by window, the cell attends over itself and its window's tokens, then is updated (paper eq. 5-7).

    `cell` (B, D) is the cell the first window reads; `previous_raw` (B, D) the raw output of the window before it,
    if any (continuing a cached sequence); `keys`/`values` (K, H, S, d) the window slots' keys and values. Returns,
    per step j (the j-th window of every sequence in this pass), stacked as (N, B, ...): the key and value of the
    cell the window reads, its raw cell ĉ and its cell c.

    Under autocast the loop runs in the layer's weights' dtype (float32 in mixed precision), and so do the cells it
    returns. Under `torch.compile`, where the fused scan applies, its single op runs instead (the same results to
    float rounding): traced, this loop would be unrolled, one copy per window and a new graph per window count.
    """
    if torch.compiler.is_exporting():
        return exportable_cell_scan(layer, cell, previous_raw, keys, values, layout)
    if torch.compiler.is_compiling():
        reason = fused_scan_unsupported(layer, cell)
        if reason is None:
            return fused_scan(layer, cell, previous_raw, *step_major(keys, values, layout), layout)
        logger.warning_once(
            f"Compiled, the cell scan is unrolled into the graph, which is then rebuilt for every number of windows: "
            f"its single-op form cannot run here, as {reason}."
        )
    device = cell.device.type
    if device != "meta" and torch.is_autocast_enabled(device):  # meta: no autocast state to ask
        # The cell is a running state rewritten every window, through standardisations that divide by a mean of
        # squares: in bfloat16 its gradients were up to 28% off their float32 values.
        dtype = layer.qkv_proj.weight.dtype
        with torch.autocast(device, enabled=False):
            read_keys, read_values, raw_cells, cells = reference_cell_scan(
                layer, cell.to(dtype), previous_raw.to(dtype), keys.to(dtype), values.to(dtype), layout
            )
        return read_keys.to(keys.dtype), read_values.to(values.dtype), raw_cells, cells
    # Step-major views of every sequence's windows. `unbind` (not indexing inside the loop) keeps the backward pass
    # linear in the number of steps.
    step_keys, step_values, step_mask = step_major(keys, values, layout)
    maxima = window_maxima(step_values, step_mask).unbind(0) if layer.config.layer_option("cell_max_pool") else None
    step_keys, step_values, step_mask = step_keys.unbind(0), step_values.unbind(0), step_mask.unbind(0)
    # Every window after a sequence's first has a cell residual; at step 0 only sequences continued from a cache.
    use_residual = layer.config.use_cell_residual
    first_step_continues = layout.first_window[:, None] > 0  # (B, 1)
    dropout = draw_scan_dropout(layer, layout.num_steps, cell.shape[0], keys.shape[-2], cell.dtype, cell.device)

    read_keys, read_values, raw_cells, cells = [], [], [], []
    for step in range(layout.num_steps):
        if not use_residual or (step == 0 and layout.continued_rows == 0):
            continues = None
        elif step == 0 and layout.continued_rows < layout.batch_size:
            continues = first_step_continues
        else:
            continues = True
        key, value, raw, cell = cell_step(
            layer, cell, previous_raw, step_keys[step], step_values[step], step_mask[step],
            None if maxima is None else maxima[step], dropout.step(step), continues,
        )  # fmt: skip
        previous_raw = raw
        read_keys.append(key)
        read_values.append(value)
        raw_cells.append(raw)
        cells.append(cell)
    return torch.stack(read_keys), torch.stack(read_values), torch.stack(raw_cells), torch.stack(cells)


def cell_step(layer, cell, previous_raw, keys, values, mask, maxima, masks: ScanDropout, continues):
    """One window of the scan: the cell reads itself and the window's slots, then writes its raw cell.

    `keys`/`values` (B, H, S, d) and `mask` (B, S) are the window's slots, `maxima` (B, H, d) or None their soft
    maxima, `masks` the step's dropout. `continues` says which rows add the cell residual of the window before:
    None (no row: the cell is the raw cell), True (every row) or a (B, 1) boolean. Returns the key and value of the
    cell read (B, H, d), the raw cell and the cell (B, D).
    """
    normed = drop(layer.input_norm(cell), masks.input)  # (B, D)
    query, key, value = layer.project(normed).unbind(-3)  # (B, H, d) each
    token_scores = torch.einsum("bhd,bhsd->bhs", query, keys)  # (B, H, S)
    token_scores = token_scores.masked_fill(~mask[:, None, :], float("-inf"))
    cell_score = (query * key).sum(-1, keepdim=True)  # (B, H, 1)
    scale = 1.0 / math.sqrt(layer.head_dim)
    probs = torch.softmax(torch.cat([cell_score, token_scores], -1) * scale, dim=-1)  # (B, H, 1 + S)
    probs = drop(probs, masks.probs)
    attended = probs[..., :1] * value + torch.einsum("bhs,bhsd->bhd", probs[..., 1:], values)
    if maxima is not None:
        attended = attended + maxima
    raw = layer.write_cell(attended.flatten(-2), normed, masks.output, masks.written)  # (B, D)
    if continues is None:
        return key, value, raw, raw
    updated = drop(layer.cell_norm(raw + layer.cell_glu(previous_raw)), masks.cell)
    return key, value, raw, updated if continues is True else torch.where(continues, updated, raw)


def exportable_cell_scan(layer, cell, previous_raw, keys, values, layout):
    """`reference_cell_scan` as one `scan` operator over the steps (ONNX `Scan`), for `torch.export` and ONNX, where
    a Python loop would be unrolled for the example's number of windows. Inference only, without a cache."""
    from torch._higher_order_ops.scan import scan

    step_keys, step_values, step_mask = step_major(keys, values, layout)
    # (N, B, 1): a row adds the cell residual of the window before from its second window on.
    continues = torch.arange(step_mask.shape[0], device=cell.device)[:, None, None] > 0
    per_step = [step_keys, step_values, step_mask, continues.expand(-1, cell.shape[0], 1)]
    if layer.config.layer_option("cell_max_pool"):
        per_step.append(window_maxima(step_values, step_mask))

    def step(carry, inputs):
        window_keys, window_values, mask, window_continues, *maxima = inputs
        key, value, raw, cell = cell_step(
            layer, *carry, window_keys, window_values, mask, maxima[0] if maxima else None, NO_DROPOUT,
            window_continues if layer.config.use_cell_residual else None,
        )  # fmt: skip
        # The scan's outputs may alias neither each other (views of one projection) nor the carried state.
        return (cell, raw), tuple(output.clone() for output in (key, value, raw, cell))

    _, (read_keys, read_values, raw_cells, cells) = scan(step, (cell, previous_raw), per_step)
    return read_keys, read_values, raw_cells, cells


def fused_cell_scan(
    layer: nn.Module,  # a RANLayer
    cell: torch.Tensor,
    previous_raw: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: RANWindowLayout,
    kernels=None,
):
    """`reference_cell_scan`'s results from one autograd node with a hand-written backward (fused_scan.py).

    Where the fused scan does not apply (an activation other than SiLU), it runs the reference and says why,
    once. It computes in float32 whatever the inputs' dtype and autocast.
    """
    reason = fused_scan_unsupported(layer, cell)
    if reason is not None:
        logger.warning_once(f"The fused cell scan runs the reference scan instead: {reason}.")
        return reference_cell_scan(layer, cell, previous_raw, keys, values, layout)
    return fused_scan(layer, cell, previous_raw, *step_major(keys, values, layout), layout, kernels)


def triton_cell_scan(
    layer: nn.Module,  # a RANLayer
    cell: torch.Tensor,
    previous_raw: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: RANWindowLayout,
):
    """`reference_cell_scan`'s results from Triton kernels, three launches per window each way (triton_scan.py).

    Where they cannot run (no Triton, no CUDA device, float64, an activation other than SiLU, wrapped projections)
    it runs the fused scan, or the reference where that cannot run either, saying why once. Under `torch.compile`
    it runs the fused scan's single custom op, whose graph does not grow with the number of windows.
    """
    reason = triton_scan_unsupported(cell)
    if reason is None and not torch.compiler.is_compiling():
        try:
            return fused_cell_scan(layer, cell, previous_raw, keys, values, layout, kernels=TRITON_KERNELS)
        except kernel_build_errors() as error:  # built on first use: a GPU it cannot be built for gets the fused scan
            BUILD_FAILURES.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            reason = triton_scan_unsupported(cell)
    if reason is not None:
        logger.warning_once(f"The Triton cell scan runs the fused scan instead: {reason}.")
    return fused_cell_scan(layer, cell, previous_raw, keys, values, layout)


def auto_cell_scan(
    layer: nn.Module,  # a RANLayer
    cell: torch.Tensor,
    previous_raw: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: RANWindowLayout,
):
    """The default: the Triton scan on a CUDA device where Triton is installed, the reference scan elsewhere (on a
    CPU the reference is as fast as any other for a whole model, and it is the one the tests are written from)."""
    if cell.device.type == "cuda" and triton_scan_unsupported(cell) is None:
        return triton_cell_scan(layer, cell, previous_raw, keys, values, layout)
    return reference_cell_scan(layer, cell, previous_raw, keys, values, layout)


# --------------------------------------------------------------------------------------------------------------------
# The layer-to-kernel adapter: the fused and Triton scans take tensors and plain weights, read from the layer here.
# --------------------------------------------------------------------------------------------------------------------


def scan_modules(layer) -> dict:
    """The modules whose weights the fused scan reads directly, by name."""
    names = ["input_norm", "qkv_proj", "o_proj"]
    if layer.cell_input_residual:
        names += ["attention_glu.proj", "attention_norm"]
    if layer.config.use_cell_residual:
        names += ["cell_glu.proj", "cell_norm"]
    return {name: layer.get_submodule(name) for name in names}


def fused_scan_unsupported(layer, cell: torch.Tensor) -> str | None:
    """Why the fused scan cannot run this layer on this input, or None if it can."""
    if layer.config.hidden_act not in SILU_ACTIVATIONS:
        return f"it computes SiLU activations only (`hidden_act` is {layer.config.hidden_act!r})"
    # It reads weights, not modules: a wrapped projection (LoRA adapters, quantisation, hooks) would be bypassed.
    for name, module in scan_modules(layer).items():
        if type(module) not in (nn.Linear, RANLayerNorm) or module._forward_hooks or module._forward_pre_hooks:
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            return f"it reads plain weights, and `{name}` is wrapped ({kind}, or forward hooks): adapters would be skipped"
    return None


def fused_scan(layer, cell, previous_raw, step_keys, step_values, step_mask, layout, kernels=None):
    """Run `FusedCellScan` for `layer`, its steps computed by `kernels` (a forward and a backward function with
    `scan_forward`'s and `scan_backward`'s signatures, such as the Triton scan's) or by fused_scan.py's: the step-major
    slots (N, B, H, S, d) and their mask (N, B, S) as in the reference scan. Returns what `reference_cell_scan`
    returns."""
    config = layer.config
    num_heads = layer.num_heads
    num_steps, batch_size = step_mask.shape[:2]
    attention_glu = attention_norm = cell_glu = cell_norm = (None, None)
    if layer.cell_input_residual:
        attention_glu = (layer.attention_glu.proj.weight, layer.attention_glu.proj.bias)
        attention_norm = (layer.attention_norm.weight, layer.attention_norm.bias)
    first_step_residual = False
    if config.use_cell_residual:
        cell_glu = (layer.cell_glu.proj.weight, layer.cell_glu.proj.bias)
        cell_norm = (layer.cell_norm.weight, layer.cell_norm.bias)
        if layout.continued_rows == batch_size:
            first_step_residual = True
        elif layout.continued_rows > 0:
            first_step_residual = layout.first_window[:, None] > 0  # (B, 1)
    plan = ScanPlan(
        num_steps=num_steps,
        num_heads=num_heads,
        head_dim=layer.head_dim,
        eps=config.layer_norm_eps,
        cell_input_residual=layer.cell_input_residual,
        use_cell_residual=config.use_cell_residual,
        qk_activation=config.layer_option("attention_qk_activation"),
        output_activation=config.layer_option("memory_value_activation"),
        first_step_residual=first_step_residual,
        keep_for_backward=torch.is_grad_enabled(),
        kernels=kernels,
    )
    # Float32 (float64 if the cell is) whatever the inputs and autocast say: the cell is a running state, written
    # once per window from the one before, and its standardisations divide by a mean of squares.
    compute_dtype = torch.float64 if cell.dtype == torch.float64 else torch.float32
    visible = F.pad(step_mask, (1, 0), value=True)  # (N, B, 1 + S): the cell's own key is always visible
    score_bias = torch.zeros(visible.shape, dtype=compute_dtype, device=cell.device)
    score_bias = score_bias.masked_fill_(~visible, float("-inf"))
    score_bias = score_bias[:, :, None, None].expand(-1, -1, num_heads, 1, -1).flatten(1, 2)  # (N, B H, 1, 1 + S)
    weights = (
        layer.input_norm.weight, layer.input_norm.bias, layer.qkv_proj.weight, layer.qkv_proj.bias,
        layer.o_proj.weight, layer.o_proj.bias, *attention_glu, *attention_norm, *cell_glu, *cell_norm,
    )  # fmt: skip
    weights = tuple(None if weight is None else weight.to(compute_dtype) for weight in weights)
    dropout = draw_scan_dropout(layer, num_steps, batch_size, step_keys.shape[-2], compute_dtype, cell.device)
    output_shift = None
    if config.layer_option("cell_max_pool"):  # the reference adds the maxima before `o_proj`: the same, by linearity
        maxima = window_maxima(step_values, step_mask).flatten(-2).to(compute_dtype)  # (N, B, H d)
        output_shift = torch.mm(maxima.flatten(0, 1), weights[4].t()).view(num_steps, batch_size, -1)
    inputs = (cell, previous_raw, step_keys, step_values)
    # (the meta device, which checks shapes and counts kernels, has no autocast to switch off)
    no_autocast = nullcontext() if cell.device.type == "meta" else torch.autocast(cell.device.type, enabled=False)
    with no_autocast:
        if torch.compiler.is_compiling():
            # One opaque op for dynamo: the steps are not unrolled into the graph, whose shapes then follow the
            # number of windows instead of being rebuilt for each one.
            outputs = cell_scan_op(
                plan, *(tensor.to(compute_dtype) for tensor in inputs), output_shift, score_bias, dropout, weights
            )
        else:
            outputs = FusedCellScan.apply(
                plan, *(tensor.to(compute_dtype) for tensor in inputs), output_shift, score_bias, dropout, *weights
            )
    # The cells keep the dtype of the cell read (float32 under autocast); the keys and values that of the tokens'.
    dtypes = (step_keys.dtype, step_values.dtype, cell.dtype, cell.dtype)
    return tuple(output.to(dtype) for output, dtype in zip(outputs, dtypes))


class RANScanInterface(GeneralInterface):
    """The cell scans a RAN layer can run, by name (`config.scan_implementation`)."""

    _global_mapping = {
        "auto": auto_cell_scan,
        "reference": reference_cell_scan,
        "fused": fused_cell_scan,
        "triton": triton_cell_scan,
    }


ALL_SCAN_FUNCTIONS = RANScanInterface()


def scan_function(name: str):
    """The cell scan registered under `name` in `ALL_SCAN_FUNCTIONS`."""
    if name not in ALL_SCAN_FUNCTIONS:
        raise ValueError(
            f"`config.scan_implementation` is {name!r}, which is not a registered cell scan; registered: "
            f"{sorted(ALL_SCAN_FUNCTIONS)}. Add one with `ran_hf.cell_scan.RANScanInterface.register(name, function)`."
        )
    return ALL_SCAN_FUNCTIONS[name]
