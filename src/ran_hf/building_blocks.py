"""RAN's building blocks, shared by the layer and the cell scans: the official normalisation (`standard_normalize`,
`RANLayerNorm`, langml's), unit vectors, and the gated linear unit.

On CUDA the normalisations can run as one Triton kernel each way (`triton_norm.py`, opt-in).
"""

import torch
import torch.nn.functional as F
from torch import nn

from .triton_norm import TritonNorm, triton_norm_applies


def standard_normalize(hidden_states: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean(x)) / sqrt(mean(x^2) + eps) over the last axis: the official RAN normalisation.

    Note the denominator: the mean of x^2, not the variance. Computed in float32 so that bf16/fp16 inputs keep
    their precision. Under autocast the result stays float32 (CUDA's autocast runs `nn.LayerNorm` in float32 too):
    cast back to bf16, the token states lose the small differences that context makes between two occurrences of
    a token, and max pooling then splits its gradient between tokens that tie.
    """
    input_dtype = hidden_states.dtype
    # (the meta device, which checks shapes and counts kernels, has no autocast state to ask)
    autocast = hidden_states.device.type != "meta" and torch.is_autocast_enabled(hidden_states.device.type)
    if triton_norm_applies(hidden_states):  # one kernel each way instead of seven to nine ops
        return TritonNorm.apply(hidden_states, None, None, eps, torch.float32 if autocast else input_dtype)
    hidden_states = hidden_states.float()
    mean = hidden_states.mean(-1, keepdim=True)
    mean_square = hidden_states.pow(2).mean(-1, keepdim=True)
    normalized = (hidden_states - mean) * torch.rsqrt(mean_square + eps)
    return normalized if autocast else normalized.to(input_dtype)


def unit_vectors(states: torch.Tensor) -> torch.Tensor:
    """L2-normalised along the last axis, in float32: in half precision the guard against a zero vector (padding)
    underflows to 0, and 0 / 0 is NaN."""
    return F.normalize(states.float(), dim=-1).to(states.dtype)


class RANLayerNorm(nn.Module):
    """`standard_normalize` followed by a learned scale and shift (langml's LayerNorm, which RAN checkpoints use)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if triton_norm_applies(hidden_states):
            autocast = hidden_states.device.type == "cuda" and torch.is_autocast_enabled("cuda")
            normalized_dtype = torch.float32 if autocast else hidden_states.dtype
            out_dtype = torch.promote_types(self.weight.dtype, normalized_dtype)
            return TritonNorm.apply(hidden_states, self.weight, self.bias, self.eps, out_dtype)
        return self.weight * standard_normalize(hidden_states, self.eps) + self.bias


class RANGatedLinearUnit(nn.Module):
    """GLU(x) = (A x + a) * sigmoid(G x + g), with A and G fused into one projection."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 2 * hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(hidden_states).chunk(2, dim=-1)
        return value * torch.sigmoid(gate)
