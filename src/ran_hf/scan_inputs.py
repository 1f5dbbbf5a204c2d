"""What every cell scan (the reference here, the fused and Triton ones of `ran_hf.kernels`) reads besides its weights,
computed before its loop: the dropout masks of every step and the soft maxima of every window (`cell_max_pool`).

Every scan reads the same masks, drawn before its loop, so that they all drop the same units for the same seed, and
the fused scan's backward reuses them. On a GPU that is two random-number kernels for a layer's scan (the masks of
the hidden size, the attention weights'), not five per window.

Shapes: N scan steps, B batch, H heads, d head size, D hidden size, S window slots.
"""

from typing import NamedTuple

import torch


# `cell_max_pool`'s soft maximum: temperature 0.03 keeps it within 0.03 * ln(S) of the maximum of S values (swish
# outputs, above -0.28), while its gradient is shared among values that near-tie, so that bfloat16 rounding cannot move
# it from one token to another (the hard maximum's relative gradient error under autocast was 9%, this one's 1.2%).
MAX_POOL_TEMPERATURE = 0.03
_HIDDEN_VALUE = -1e4  # finite, so that a window with no readable slot gets finite (and then unused) gradients


def window_maxima(step_values: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """(N, B, H, d): per scan step, the feature-wise soft maximum (log-sum-exp) of the values of the window slots its
    cell reads (`config.cell_max_pool`), computed in float32 at least and returned in the values' dtype; zeros where a
    sequence has no window at that step. It does not depend on the cell: every step's is computed before the scan."""
    values = step_values.to(torch.promote_types(step_values.dtype, torch.float32))
    values = values.masked_fill(~step_mask[:, :, None, :, None], _HIDDEN_VALUE)  # (N, B, H, S, d)
    maxima = MAX_POOL_TEMPERATURE * torch.logsumexp(values / MAX_POOL_TEMPERATURE, dim=-2)
    return maxima.masked_fill(~step_mask.any(-1)[..., None, None], 0.0).to(step_values.dtype)


class ScanDropout(NamedTuple):
    """Keep-masks scaled by 1 / (1 - rate), per step; None where a rate is 0 (nothing is dropped there)."""

    input: torch.Tensor | None  # (N, B, D) the cell's input norm, which feeds its projections and gated residual
    probs: torch.Tensor | None  # (N, B, H, 1 + S) the cell's attention weights over its own key and the slots
    output: torch.Tensor | None  # (N, B, D) the activated output projection
    written: torch.Tensor | None  # (N, B, D) the standardised raw cell
    cell: torch.Tensor | None  # (N, B, D) the cell norm's output, on steps with a cell residual

    def step(self, index: int) -> "ScanDropout":
        """The masks of one step: (B, ...) each."""
        if self is NO_DROPOUT:  # (inference: every step of every scan asks)
            return self
        return ScanDropout(*(None if mask is None else mask[index] for mask in self))


NO_DROPOUT = ScanDropout(None, None, None, None, None)


def keep_mask(shape: tuple, rate: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    if rate == 0:
        return None
    keep = torch.empty(shape, dtype=torch.float32, device=device).bernoulli_(1 - rate).to(dtype)
    return keep if rate == 1 else keep.mul_(1 / (1 - rate))


def draw_scan_dropout(scan, num_steps: int, batch_size: int, num_slots: int, dtype, device) -> ScanDropout:
    """The masks of one run of `scan` (a `cell_scan.RANCellScan`: its rates; none outside training). The masks of the
    hidden size are drawn in one call: two kernels on a GPU, whatever their number."""
    rate, attention_rate = scan.dropout.p, scan.attention_dropout
    if not scan.training or (rate == 0 and attention_rate == 0):
        return NO_DROPOUT
    num_hidden_masks = 4 if scan.use_cell_residual else 3
    hidden = keep_mask((num_hidden_masks, num_steps, batch_size, scan.hidden_size), rate, dtype, device)
    hidden = [None] * num_hidden_masks if hidden is None else hidden.unbind(0)
    probs = (num_steps, batch_size, scan.num_heads, 1 + num_slots)
    return ScanDropout(
        input=hidden[0],
        probs=keep_mask(probs, attention_rate, dtype, device),
        output=hidden[1],
        written=hidden[2],
        cell=hidden[3] if scan.use_cell_residual else None,
    )


def drop(states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return states if mask is None else states * mask
