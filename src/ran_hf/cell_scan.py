"""The cell scan: the one sequential part of a RAN layer, window by window.

`RANCellScan` is the layer's scan (`layer.cell_scan`): the shapes and switches of the cell's maths, its dropout, and
the parameters that are the cell's alone: with `use_cell_residual`, the gated residual of the raw cell before and
the norm that writes the cell (`cell_glu`, `cell_norm`; paper eq. 7). The modules that tokens and cells share (the
input norm, the projections, the attention's GLU and norm) are the layer's, handed to the scan at every call as
`CellScanWeights`, so that a module an adapter has replaced (PEFT's LoRA replaces `qkv_proj` and `o_proj`) is the
one the scan calls. Every implementation reads the scan's own modules from the scan.

Every implementation has one signature, `scan(cell_scan, weights, cell, previous_raw, keys, values, layout)`, and
returns `CellScanOutputs`; `ALL_SCAN_FUNCTIONS` holds them by name:
- "reference": the plain loop that autograd records op by op (`reference_cell_scan`);
- "export": the reference as one `scan` operator over the steps, for `torch.export` and ONNX;
- "fused" and "triton", where `ran_hf` is installed: the same maths as one autograd node with a hand-written
  backward (under `torch.compile` one custom op), and that node with each window's steps in Triton kernels, two
  launches per window forward and two backward. They are `ran_hf.kernels`', attached to `cell_scan` (kernel_hub.py).
"auto" (the default), "reference", "fused" and "triton" run `cell_scan`, where the kernels choose
(`ran_hf.kernels.choice.choose("scan", ...)`) from `config.scan_implementation`, the device, Triton, the activation and
whether the layer's modules are plain; without them, it is the reference. Other implementations (a benchmark's
variant of the design) join with `RANScanInterface.register`, as attention functions join Transformers'
`AttentionInterface`, and run where the config names them.
"""

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import nn
from transformers.utils.generic import GeneralInterface

from .building_blocks import (
    RANCenteredRMSNorm,
    RANGatedLinearUnit,
    activation_function,
    project_heads,
    standard_normalize,
)
from .decode_step import StepPositions
from .kernel_hub import use_kernel_function
from .scan_inputs import NO_DROPOUT, ScanDropout, draw_scan_dropout, drop, window_maxima
from .window_layout import RANWindowLayout


@dataclass(frozen=True, slots=True)
class CellScanWeights:
    """The layer's modules, shared with its tokens, whose weights a cell scan uses (None: the layer's design has no
    such step). The cell's own modules are the scan's (`RANCellScan.cell_glu`, `RANCellScan.cell_norm`). Not a tuple:
    Accelerate's hooks move every tensor and module in a tuple argument to the device, and offloaded modules must
    stay where they are until called."""

    input_norm: nn.Module  # the cell's input norm (the layer's concat norm of tokens and cells)
    qkv_proj: nn.Module  # queries, keys and values of the cell, as of the tokens
    o_proj: nn.Module  # the output projection that writes the raw cell
    attention_glu: nn.Module | None  # with `cell_input_residual`: the gated residual of the cell's input ...
    attention_norm: nn.Module | None  # ... and the norm after it


class CellScanOutputs(NamedTuple):
    """Per scan step j (the j-th window of every sequence in this pass), stacked as (N, B, ...); a decoding step's
    one step, as (B, ...)."""

    read_keys: torch.Tensor  # (N, B, H, d) the key of the cell the window reads
    read_values: torch.Tensor  # (N, B, H, d) its value
    raw_cells: torch.Tensor  # (N, B, D) the raw cell ĉ the window writes
    cells: torch.Tensor  # (N, B, D) the cell c the window writes


def reference_cell_scan(
    scan: "RANCellScan",
    weights: CellScanWeights,
    cell: torch.Tensor,
    previous_raw: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: RANWindowLayout,
) -> CellScanOutputs:
    """Window by window, the cell attends over itself and its window's tokens, then is updated (paper eq. 5-7).

    `cell` (B, D) is the cell the first window reads; `previous_raw` (B, D) the raw output of the window before it,
    if any (continuing a cached sequence); `keys`/`values` (K, H, S, d) the window slots' keys and values.

    Under autocast the loop runs in the layer's weights' dtype (float32 in mixed precision), and so do the cells it
    returns.
    """
    device = cell.device.type
    if device != "meta" and torch.is_autocast_enabled(device):  # meta: no autocast state to ask
        # The cell is a running state rewritten every window, through standardisations that divide by a mean of
        # squares: in bfloat16 its gradients were up to 28% off their float32 values.
        dtype = weights.qkv_proj.weight.dtype
        with torch.autocast(device, enabled=False):
            read_keys, read_values, raw_cells, cells = reference_cell_scan(
                scan, weights, cell.to(dtype), previous_raw.to(dtype), keys.to(dtype), values.to(dtype), layout
            )
        return CellScanOutputs(read_keys.to(keys.dtype), read_values.to(values.dtype), raw_cells, cells)
    # Step-major views of every sequence's windows. `unbind` (not indexing inside the loop) keeps the backward pass
    # linear in the number of steps.
    step_keys, step_values, step_mask = layout.step_major(keys, values)
    maxima = window_maxima(step_values, step_mask).unbind(0) if scan.cell_max_pool else None
    step_keys, step_values, step_mask = step_keys.unbind(0), step_values.unbind(0), step_mask.unbind(0)
    # Every window after a sequence's first has a cell residual; at step 0 only sequences continued from a cache.
    first_step_continues = layout.first_window[:, None] > 0  # (B, 1)
    dropout = draw_scan_dropout(scan, layout.num_steps, cell.shape[0], keys.shape[-2], cell.dtype, cell.device)

    read_keys, read_values, raw_cells, cells = [], [], [], []
    for step in range(layout.num_steps):
        if not scan.use_cell_residual or (step == 0 and layout.continued_rows == 0):
            continues = None
        elif step == 0 and layout.continued_rows < layout.batch_size:
            continues = first_step_continues
        else:
            continues = True
        key, value, raw, cell = cell_step(
            scan, weights, cell, previous_raw, step_keys[step], step_values[step], step_mask[step],
            None if maxima is None else maxima[step], dropout.step(step), continues,
        )  # fmt: skip
        previous_raw = raw
        read_keys.append(key)
        read_values.append(value)
        raw_cells.append(raw)
        cells.append(cell)
    return CellScanOutputs(*(torch.stack(per_step) for per_step in (read_keys, read_values, raw_cells, cells)))


def cell_step(scan, weights, cell, previous_raw, keys, values, mask, maxima, masks: ScanDropout, continues):
    """One window of the scan: the cell reads itself and the window's slots, then writes its raw cell.

    `keys`/`values` (B, H, S, d) and `mask` (B, S) are the window's slots, `maxima` (B, H, d) or None their soft
    maxima, `masks` the step's dropout. `continues` says which rows add the cell residual of the window before:
    None (no row: the cell is the raw cell), True (every row) or a (B, 1) boolean. Returns the key and value of the
    cell read (B, H, d), the raw cell and the cell (B, D).
    """
    normed = drop(weights.input_norm(cell), masks.input)  # (B, D)
    query, key, value = scan.project(weights.qkv_proj, normed).unbind(-3)  # (B, H, d) each
    token_scores = torch.einsum("bhd,bhsd->bhs", query, keys)  # (B, H, S)
    token_scores = token_scores.masked_fill(~mask[:, None, :], float("-inf"))
    cell_score = (query * key).sum(-1, keepdim=True)  # (B, H, 1)
    scale = 1.0 / math.sqrt(scan.head_dim)
    probs = torch.softmax(torch.cat([cell_score, token_scores], -1) * scale, dim=-1)  # (B, H, 1 + S)
    probs = drop(probs, masks.probs)
    attended = probs[..., :1] * value + torch.einsum("bhs,bhsd->bhd", probs[..., 1:], values)
    if maxima is not None:
        attended = attended + maxima
    raw = scan.write_cell(weights, attended.flatten(-2), normed, masks.output, masks.written)  # (B, D)
    if continues is None:
        return key, value, raw, raw
    updated = drop(scan.cell_norm(raw + scan.cell_glu(previous_raw)), masks.cell)
    return key, value, raw, updated if continues is True else torch.where(continues, updated, raw)


def exportable_cell_scan(scan, weights, cell, previous_raw, keys, values, layout) -> CellScanOutputs:
    """`reference_cell_scan` as one `scan` operator over the steps (ONNX `Scan`), for `torch.export` and ONNX, where
    a Python loop would be unrolled for the example's number of windows. Inference only."""
    from torch._higher_order_ops.scan import scan as scan_operator

    step_keys, step_values, step_mask = layout.step_major(keys, values)
    # (N, B, 1): a row adds the cell residual of the window before from its second window on, or from its first
    # where it continues a cached sequence.
    later_step = torch.arange(step_mask.shape[0], device=cell.device)[:, None, None] > 0
    continues = later_step | (layout.first_window > 0)[None, :, None]
    per_step = [step_keys, step_values, step_mask, continues]
    if scan.cell_max_pool:
        per_step.append(window_maxima(step_values, step_mask))

    def step(carry, inputs):
        window_keys, window_values, mask, window_continues, *maxima = inputs
        key, value, raw, cell = cell_step(
            scan, weights, *carry, window_keys, window_values, mask, maxima[0] if maxima else None, NO_DROPOUT,
            window_continues if scan.use_cell_residual else None,
        )  # fmt: skip
        # The scan's outputs may alias neither each other (views of one projection) nor the carried state, whose two
        # parts are one tensor without the cell residual.
        carry = (cell, raw.clone() if raw is cell else raw)
        return carry, tuple(output.clone() for output in (key, value, raw, cell))

    # The carried state as the step returns it, dense: a layer's learned starting cell is expanded over the batch,
    # and the operator wants its carry's strides to stay the same from step to step.
    _, outputs = scan_operator(step, (cell.contiguous(), previous_raw.contiguous()), per_step)
    return CellScanOutputs(*outputs)


@use_kernel_function("cell_scan")
def cell_scan(scan, weights, cell, previous_raw, keys, values, layout) -> CellScanOutputs:
    """The scan `config.scan_implementation` names among "auto", "reference", "fused" and "triton": the kernel
    attached here gives the fused or Triton one where it runs; else the reference, or under `torch.export` its `scan`
    operator form."""
    if torch.compiler.is_exporting():
        return exportable_cell_scan(scan, weights, cell, previous_raw, keys, values, layout)
    return reference_cell_scan(scan, weights, cell, previous_raw, keys, values, layout)


class RANScanInterface(GeneralInterface):
    """The cell scans a RAN layer can run, by name (`config.scan_implementation`; "auto" is `cell_scan`'s). "fused"
    and "triton" are `cell_scan` too: its kernel runs them where they can run, and says why not once."""

    _global_mapping = {
        "reference": reference_cell_scan,
        "fused": cell_scan,
        "triton": cell_scan,
        "export": exportable_cell_scan,
    }


CHOSEN_SCANS = ("auto", "reference", "fused", "triton")  # the names `cell_scan` runs, choosing


ALL_SCAN_FUNCTIONS = RANScanInterface()


class RANCellScan(nn.Module):
    """The cell scan of one layer: what shapes its maths (heads, switches of the layer's design), its dropout, and
    the parameters only the cell uses: with `config.use_cell_residual`, `cell_glu` (the gated residual of the raw
    cell before) and `cell_norm` (the norm that writes the cell). The weights it shares with the tokens are the
    layer's, passed at every call as `CellScanWeights`."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size, self.eps = config.hidden_size, config.layer_norm_eps
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.cell_input_residual = config.cell_input_residual
        self.use_cell_residual = config.use_cell_residual
        if config.use_cell_residual:
            self.cell_glu = RANGatedLinearUnit(config.hidden_size)
            self.cell_norm = RANCenteredRMSNorm(config.hidden_size, config.layer_norm_eps)
        self.qk_activation = config.attention_qk_activation
        self.output_activation = config.memory_value_activation  # of what the cell writes
        self.cell_max_pool = config.cell_max_pool
        self.hidden_act = config.hidden_act  # an architecture field: fixed once built
        self.act = activation_function(config.hidden_act)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.attention_dropout = config.attention_probs_dropout_prob

    def modules_read(self, weights: CellScanWeights) -> dict[str, nn.Module]:
        """Every module whose weights the scan reads, by name: the layer's (`weights`), then its own."""
        own = {"cell_glu": self.cell_glu, "cell_norm": self.cell_norm} if self.use_cell_residual else {}
        shared = {field.name: getattr(weights, field.name) for field in fields(weights)}
        return {name: module for name, module in (shared | own).items() if module is not None}

    def project(self, qkv_proj: nn.Module, normed: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., 3, H, d) queries, keys and values, as the layer projects its tokens."""
        return project_heads(qkv_proj(normed), self.num_heads, self.head_dim, self.act, self.qk_activation)

    def write_cell(self, weights, attended: torch.Tensor, normed_cell: torch.Tensor, output_mask=None,
                   written_mask=None):  # fmt: skip
        """The raw cell ĉ of a window, (B, H * d) -> standardised (B, D); the masks are the scan's dropout
        (scan_inputs.py), None where nothing is dropped.

        Without `cell_input_residual` the cell is what its attention read from the window: the gated residual of
        the cell's own input would add a term that is the same for every text in the first window and drowns it.
        With it (and the official activation of what the cell writes), this is the layer's `finish_attention` for
        the cell.
        """
        written = weights.o_proj(attended)
        written = drop(self.act(written) if self.output_activation else written, output_mask)
        if self.cell_input_residual:
            written = weights.attention_norm(written + weights.attention_glu(normed_cell))
        return drop(standard_normalize(written, self.eps), written_mask)

    def forward(self, weights: CellScanWeights, cell, previous_raw, keys, values, layout) -> CellScanOutputs:
        """Run the implementation `config.scan_implementation` names (`cell_scan` for the built-in ones); see
        `reference_cell_scan` for the arguments.

        A decoding step (`layout` is its `StepPositions`) takes one scan step for the window each row's token ends:
        keys and values (B, H, S, d) are that window's slots, rotated; it returns (B, ...) tensors (`step`)."""
        if type(layout) is StepPositions:
            return self.step(weights, cell, previous_raw, keys, values, layout)
        requested = self.config.scan_implementation
        if requested != "auto" and requested not in ALL_SCAN_FUNCTIONS:
            raise ValueError(
                f"`config.scan_implementation` is {requested!r}, which is not a registered cell scan; registered: "
                f"{sorted(ALL_SCAN_FUNCTIONS)}. Add one with `ran_hf.cell_scan.RANScanInterface.register(name, "
                f"function)`."
            )
        scan = cell_scan if requested in CHOSEN_SCANS else ALL_SCAN_FUNCTIONS[requested]
        return CellScanOutputs(*scan(self, weights, cell, previous_raw, keys, values, layout))

    def step(self, weights: CellScanWeights, cell, previous_raw, keys, values, at: StepPositions) -> CellScanOutputs:
        """A decoding step's scan step (`cell_step`), for every row (the layer keeps it where the row's window ended).
        In the weights' dtype under autocast, as the scan runs: the cell is a running state."""
        device = cell.device.type
        if device != "meta" and torch.is_autocast_enabled(device):
            dtype = weights.qkv_proj.weight.dtype
            with torch.autocast(device, enabled=False):
                return self.step(weights, cell.to(dtype), previous_raw.to(dtype), keys.to(dtype), values.to(dtype), at)
        maxima = window_maxima(values[None], at.visible[None])[0] if self.cell_max_pool else None  # (B, H, d)
        continues = (at.window > 0)[:, None] if self.use_cell_residual else None
        return CellScanOutputs(
            *cell_step(self, weights, cell, previous_raw, keys, values, at.visible, maxima, NO_DROPOUT, continues)
        )
