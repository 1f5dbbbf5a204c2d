"""RAN's building blocks, shared by the layer and the cell scans: the official normalisation (`standard_normalize`,
`RANCenteredRMSNorm`, langml's `LayerNormalization`), unit vectors, the gated linear unit, the interleaved rotary
embedding, the row gather every layout uses and the token shift's projection.

Each op is plain PyTorch here. On CUDA, where `ran_hf` is installed, the normalisations, the gated linear unit and the
rotary embedding run as one Triton kernel each way: `use_kernel_forward` and `use_kernel_function` (kernel_hub.py)
attach them from `ran_hf.kernels`, which says where they run. Each op's PyTorch form is also a function of its own
(`standard_normalize_reference`, `centered_rms_norm_reference`, `gated_linear_unit_reference`,
`rotate_pairs_reference`), with nothing attached, so that it stays the reference the kernels are tested against.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kernel_hub import use_kernel_forward, use_kernel_function


# `hidden_act` names of SiLU, which the layers call as `F.silu` itself
SILU_ACTIVATIONS = ("silu", "swish")


@use_kernel_function("standard_normalize")
def standard_normalize(hidden_states: torch.Tensor, eps: float, dropout: nn.Dropout | None = None) -> torch.Tensor:
    """(x - mean(x)) / sqrt(mean(x^2) + eps) over the last axis: the official RAN normalisation; then `dropout` where
    given (inside the kernel on CUDA).

    Note the denominator: the mean of x^2, not the variance. Computed in float32 so that bf16/fp16 inputs keep
    their precision. Under autocast the result stays float32 (CUDA's autocast runs `nn.LayerNorm` in float32 too):
    cast back to bf16, the token states lose the small differences that context makes between two occurrences of
    a token, and max pooling then splits its gradient between tokens that tie.
    """
    return standard_normalize_reference(hidden_states, eps, dropout)


def standard_normalize_reference(
    hidden_states: torch.Tensor, eps: float, dropout: nn.Dropout | None = None
) -> torch.Tensor:
    """`standard_normalize` in PyTorch ops, wherever the kernel does not run."""
    input_dtype = hidden_states.dtype
    # (the meta device, which checks shapes and counts kernels, has no autocast state to ask)
    autocast = hidden_states.device.type != "meta" and torch.is_autocast_enabled(hidden_states.device.type)
    hidden_states = hidden_states if input_dtype == torch.float64 else hidden_states.float()
    mean = hidden_states.mean(-1, keepdim=True)
    mean_square = hidden_states.pow(2).mean(-1, keepdim=True)
    normalized = (hidden_states - mean) * torch.rsqrt(mean_square + eps)
    normalized = normalized if autocast else normalized.to(input_dtype)
    return apply_dropout(dropout, normalized) if dropout is not None and dropout.training else normalized


def apply_dropout(dropout: nn.Dropout | None, states: torch.Tensor) -> torch.Tensor:
    """`dropout(states)` where a dropout module is given and training: in inference it is the identity, and not
    calling it saves a module call per norm and branch of every step. (The hot paths ask `dropout.training`
    before calling this: a Python call each.)"""
    return states if dropout is None or not dropout.training else dropout(states)


def activation_function(name: str):
    """The activation `config.hidden_act` names, as the layers call it: SiLU ("silu", "swish", the default) as
    `F.silu` itself, any other as Transformers' module (`ACT2FN`). A module costs three Python calls more a call,
    and a forward pass activates a dozen times."""
    if name in SILU_ACTIVATIONS:
        return F.silu
    from transformers.activations import ACT2FN  # here: `import ran_hf` does not import the activations

    return ACT2FN[name]


def unit_vectors(states: torch.Tensor) -> torch.Tensor:
    """L2-normalised along the last axis, in float32: in half precision the guard against a zero vector (padding)
    underflows to 0, and 0 / 0 is NaN."""
    # (`F.normalize`'s maths, without its two Python wrappers)
    wide = states if states.dtype == torch.float64 else states.float()
    return (wide / torch.linalg.vector_norm(wide, dim=-1, keepdim=True).clamp_min(1e-12)).to(states.dtype)


@use_kernel_forward("RANCenteredRMSNorm")
class RANCenteredRMSNorm(nn.Module):
    """weight * (x - mean(x)) / sqrt(mean(x^2) + eps) + bias: `standard_normalize` followed by a learned scale and
    shift; then, where `forward` is asked to, `standard_normalize` again (the official layer's ending) and the
    `dropout` given (inside the kernel on CUDA).

    The official code (langml) and the paper call it LayerNorm (langml's `LayerNormalization`), and RAN checkpoints
    name its weights that way. It is not `nn.LayerNorm`: the input is centred, but divided by its root mean square
    (of the uncentred input), not by its standard deviation; nor is it an RMS norm, which does not centre.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self, hidden_states: torch.Tensor, dropout: nn.Dropout | None = None, then_standardize: bool = False
    ) -> torch.Tensor:
        return centered_rms_norm_reference(hidden_states, self.weight, self.bias, self.eps, dropout, then_standardize)


def centered_rms_norm_reference(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dropout: nn.Dropout | None = None,
    then_standardize: bool = False,
) -> torch.Tensor:
    """`RANCenteredRMSNorm` in PyTorch ops, wherever the kernel does not run."""
    normalized = weight * standard_normalize_reference(hidden_states, eps) + bias
    if then_standardize:
        return standard_normalize_reference(normalized, eps, dropout)
    return apply_dropout(dropout, normalized) if dropout is not None and dropout.training else normalized


@use_kernel_forward("RANGatedLinearUnit")
class RANGatedLinearUnit(nn.Module):
    """GLU(x) = (A x + a) * sigmoid(G x + g), with A and G fused into one projection; plus a residual branch
    dropout(activation(residual)) where a residual is given; then, where given, a `norm` (`RANCenteredRMSNorm`, with
    its `then_standardize` and `norm_dropout`). One kernel each way on CUDA, where the branch's activation, dropout and
    sum, and the norm, would be kernels of their own. With `residual_rows`, the residual is rows of another order:
    output row r adds row `residual_rows[r]` (read through the map by the kernel, not gathered)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 2 * hidden_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None = None,
        residual_activation=None,
        residual_dropout: nn.Dropout | None = None,
        residual_rows: torch.Tensor | None = None,
        then: "NormAfter | None" = None,
    ) -> torch.Tensor:
        norm, norm_dropout, then_standardize = (None, None, False) if then is None else then
        out = gated_linear_unit_reference(
            self.proj(hidden_states), residual, residual_activation, residual_dropout, residual_rows
        )
        return out if norm is None else norm(out, norm_dropout, then_standardize)


@dataclass(frozen=True, slots=True)
class NormAfter:
    """A norm the gated linear unit applies to its output (inside its kernel on CUDA), with the norm's dropout and
    whether it standardises again after it (`RANCenteredRMSNorm.forward`). Not a tuple and not the module itself:
    Accelerate's hooks move what they find in a call's arguments to the device, an offloaded norm included."""

    norm: nn.Module
    dropout: nn.Dropout | None = None
    then_standardize: bool = False

    def __iter__(self):
        return iter((self.norm, self.dropout, self.then_standardize))


def residual_branch(
    residual: torch.Tensor | None,
    activation=None,
    dropout: nn.Dropout | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """dropout(activation(residual[rows])) in PyTorch ops, each step where given; None without a residual."""
    if residual is None:
        return None
    residual = residual if rows is None else gather_rows(residual, rows)
    residual = residual if activation is None else activation(residual)
    return apply_dropout(dropout, residual) if dropout is not None and dropout.training else residual


def gated_linear_unit_reference(
    projected: torch.Tensor,
    residual: torch.Tensor | None = None,
    residual_activation=None,
    residual_dropout: nn.Dropout | None = None,
    residual_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`RANGatedLinearUnit` in PyTorch ops, wherever the kernel does not run, from the projection's output
    (..., 2 D): value * sigmoid(gate), plus the residual branch where a residual is given."""
    residual = residual_branch(residual, residual_activation, residual_dropout, residual_rows)
    value, gate = projected.chunk(2, dim=-1)
    gated = value * torch.sigmoid(gate)
    return gated if residual is None else residual + gated


def project_heads(qkv: torch.Tensor, num_heads: int, head_dim: int, act: nn.Module, qk_activation: bool):
    """A query/key/value projection's output (..., 3 H d) -> (..., 3, H, d) queries, keys and values; the values
    activated, and the queries and keys where `qk_activation` (`config.attention_qk_activation`)."""
    qkv = torch.unflatten(qkv, -1, (3, num_heads, head_dim))  # (torch's own, not the Tensor methods' Python wrappers)
    if qk_activation:
        return act(qkv)
    query_key, value = qkv.split_with_sizes([2, 1], dim=-3)
    return torch.cat([query_key, act(value)], dim=-3)


def rotary_rotations(num_positions: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """(num_positions, head_dim / 2, 2): cosine and sine of each pair's rotation at positions 0, 1, ..."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(num_positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


@use_kernel_function("apply_interleaved_rotary")
def apply_interleaved_rotary(states: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x_2i, x_2i+1) of the last axis by the angles whose cosines and sines are
    `rotations` (..., d / 2, 2), which broadcasts against (..., d / 2, 2) pairs.

    RAN rotates neighbouring pairs, not the two halves of the head as Llama does. Real arithmetic, not a complex
    product: ONNX has no complex numbers.
    """
    return rotate_pairs_reference(states, rotations)


def rotate_pairs_reference(states: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """`apply_interleaved_rotary` in PyTorch ops, wherever the kernel does not run."""
    x, y = (states if states.dtype == torch.float64 else states.float()).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = rotations.unbind(-1)
    return torch.stack([x * cos - y * sin, x * sin + y * cos], dim=-1).flatten(-2).to(states.dtype)


def rotate_pairs_complex(states: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """`rotate_pairs_reference` with `rotations` as complex numbers, (..., d / 2) `cos + i sin`: the pair (x, y) times
    them, in four ops whatever the size, for a decoding step whose tensors are small. Not exportable to ONNX. Real
    `rotations` (a compiled step's: inductor generates no code for complex products) take the reference's form."""
    if not rotations.is_complex():
        return rotate_pairs_reference(states, rotations)
    pairs = torch.view_as_complex(
        torch.unflatten(states if states.dtype == torch.float64 else states.float(), -1, (-1, 2))
    )
    return torch.view_as_real(pairs * rotations).flatten(-2).to(states.dtype)


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`source[index]` for an integer `index` of any shape into the first axis, as `index_select`: its gradient adds
    rows back with `index_add_`, where advanced indexing's sorts the indices first (on an H200, 12% of a training
    step's GPU time)."""
    return source.index_select(0, index.reshape(-1)).view(*index.shape, *source.shape[1:])


class RANTokenShift(nn.Linear):
    """The projection of a token's predecessor that `config.token_shift` adds to it; zero at initialisation, so that
    a model starts as one without it."""
