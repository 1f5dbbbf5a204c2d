"""The token-wise ops' kernels, attached to the model's plain PyTorch ops (ran_hf/kernel_hub.py): the normalisations
and the gated linear unit of ran_hf/building_blocks.py, its rotary embedding, and the layer's window projection
(`RANLayer.project_windows`).

Each op has an entry of the mapping (`token_op`, or `chosen_by` a chooser of the op's signature), which wraps the
plain op in one that runs the Triton implementation where `choice.choose` says "triton" and the plain op elsewhere;
and that implementation, with the same signature, which launches the kernels of `triton_ops/` (imported there, on
the first launch: only where Triton imports). A kernel reads a module's weights past its call only where
`choice.plain_module` allows it, and calls the module otherwise (a LoRA or quantised projection runs as it is).
"""

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from .choice import CHOSEN, FORCED, TRITON_DEVICES, choose, plain_module


def token_op(op: str, kernel, states_at: int = 0):
    """The mapping's entry for the token-wise op `op`: given the plain op, the op that runs `kernel` (of the same
    signature) where `choice.choose(op, states)` says "triton" and the plain op elsewhere; `states_at`, where its input
    tensor stands among its arguments. One Python call per op, not two: the question is asked inline first (off a
    Triton device, with nothing forced, `choose` answers "pytorch"; where `CHOSEN` records that answer already,
    nothing is left to ask)."""

    def attach(plain):
        states_name = list(inspect.signature(plain).parameters)[states_at]

        def kernel_or_plain(*args, **kwargs):
            states = args[states_at] if len(args) > states_at else kwargs[states_name]
            if states.device.type not in TRITON_DEVICES and not FORCED and CHOSEN.get(op) == "pytorch":
                return plain(*args, **kwargs)
            return (kernel if choose(op, states) == "triton" else plain)(*args, **kwargs)

        return kernel_or_plain

    return attach


def chosen_by(chooser):
    """The mapping's entry for an op whose `chooser` (of the op's signature) gives the implementation to run for its
    arguments, or None for the plain op."""

    def attach(plain):
        def kernel_or_plain(*args, **kwargs):
            return (chooser(*args, **kwargs) or plain)(*args, **kwargs)

        return kernel_or_plain

    return attach


def autocast_on(states: torch.Tensor) -> bool:
    """Whether autocast is on for the device of `states` (the meta device has no autocast state to ask)."""
    return states.device.type != "meta" and torch.is_autocast_enabled(states.device.type)


def dropout_rate(dropout: nn.Dropout | None) -> float:
    """The rate at which a dropout module drops units now: its `p` in training, else 0."""
    return dropout.p if dropout is not None and dropout.training else 0.0


# ---- the normalisations --------------------------------------------------------------------------------------------


def triton_standardize(hidden_states: torch.Tensor, eps: float, dropout: nn.Dropout | None = None) -> torch.Tensor:
    """`standard_normalize` in one kernel each way, not seven to nine ops (and dropout's two)."""
    from .triton_ops.norm import TritonNorm

    out_dtype = torch.float32 if autocast_on(hidden_states) else hidden_states.dtype
    return TritonNorm.apply(hidden_states, None, None, eps, out_dtype, dropout_rate(dropout))


def triton_norm_forward(norm, hidden_states: torch.Tensor, dropout=None, then_standardize: bool = False):
    """`RANCenteredRMSNorm.forward` in one kernel each way."""
    from .triton_ops.norm import TritonNorm

    autocast = hidden_states.device.type == "cuda" and torch.is_autocast_enabled("cuda")
    normalized_dtype = torch.float32 if autocast else hidden_states.dtype
    out_dtype = torch.promote_types(norm.weight.dtype, normalized_dtype)
    rate = dropout_rate(dropout)
    return TritonNorm.apply(hidden_states, norm.weight, norm.bias, norm.eps, out_dtype, rate, then_standardize)


# ---- the gated linear unit -----------------------------------------------------------------------------------------


def triton_glu_forward(
    glu,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None = None,
    residual_activation=None,
    residual_dropout: nn.Dropout | None = None,
    residual_rows: torch.Tensor | None = None,
    then=None,
) -> torch.Tensor:
    """The unit, its residual branch and the norm after it (`then`) in one kernel each way, where the branch's
    activation, dropout and sum, and the norm, would be kernels of their own."""
    from .triton_ops.glu import NO_ACTIVATION, branch_activation, triton_glu

    norm, norm_dropout, then_standardize = (None, None, False) if then is None else then
    # The bias is added by the kernel, which also sums its gradient: one pass over the projection's gradient fewer.
    # A wrapped projection (LoRA, quantised) runs as it is.
    bias = glu.proj.bias if plain_module(glu.proj, "Linear") else None
    projected = glu.proj(hidden_states) if bias is None else F.linear(hidden_states, glu.proj.weight)  # (.., 2D)
    width = projected.shape[-1] // 2
    activation = branch_activation(residual_activation) if residual is not None else NO_ACTIVATION
    fits = residual is None or (
        residual.dtype == projected.dtype
        and (residual.shape == (*projected.shape[:-1], width) or (residual_rows is not None and residual.dim() == 2))
    )
    if activation is not None and fits:  # the whole branch, and the norm, in the kernel
        out_dtype, norm_args = projected.dtype, None
        norm_fused = norm is not None and plain_module(norm, "RANCenteredRMSNorm")
        if norm_fused and choose("norm", projected[..., :width]) == "triton":
            autocast = projected.device.type == "cuda" and torch.is_autocast_enabled("cuda")
            out_dtype = torch.promote_types(norm.weight.dtype, torch.float32 if autocast else projected.dtype)
            norm_args = (norm.weight, norm.bias, norm.eps, then_standardize, dropout_rate(norm_dropout))
        dropout = dropout_rate(residual_dropout)
        out = triton_glu(projected, residual, activation, dropout, residual_rows, bias, norm_args, out_dtype)
        if norm is None or norm_args is not None:
            return out
        return norm(out, norm_dropout, then_standardize)
    residual = residual_branch(residual, residual_activation, residual_dropout, residual_rows)
    out = triton_glu(projected, residual, bias=bias)  # one kernel each way instead of two (three with the sum)
    return out if norm is None else norm(out, norm_dropout, then_standardize)


def residual_branch(residual: torch.Tensor, activation, dropout: nn.Dropout | None, rows: torch.Tensor | None):
    """dropout(activation(residual[rows])) in PyTorch ops, each step where given, for a branch the kernel cannot
    compute (as the model's `building_blocks.residual_branch`)."""
    if residual is None:
        return None
    if rows is not None:
        residual = residual.index_select(0, rows.reshape(-1)).view(*rows.shape, *residual.shape[1:])
    residual = residual if activation is None else activation(residual)
    return residual if dropout is None or not dropout.training else dropout(residual)


# ---- the rotary embedding ------------------------------------------------------------------------------------------


def triton_rotary(states: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """`apply_interleaved_rotary` in one kernel each way instead of about fifteen and twenty ops."""
    from .triton_ops.rotary import triton_rotate_pairs

    return triton_rotate_pairs(states, rotations)


# ---- the window projection -----------------------------------------------------------------------------------------


def choose_window_projection(layer, normed_tokens, layout, cache, chunk_features=None):
    """`RANLayer.project_windows`: one kernel each way from the projections to the windows' queries, keys and
    values; not with the associative memory, which reads the projections of the plain path."""
    fused = choose("window_projection", normed_tokens, layer.hidden_act, cache is not None) == "triton"
    return triton_window_projection if fused and not layer.uses_associative_memory else None


def triton_window_projection(layer, normed_tokens, layout, cache, chunk_features=None) -> tuple:
    """`RANLayer.project_windows`'s `WindowProjections`, as a tuple: no projections kept for a cache or a memory,
    and the keys and values again with a slot 0 for the read cell (`ReadCellSlots`)."""
    from .triton_ops.window_projection import triton_window_projection

    config = layer.config
    rotations = layout.rotary(layer.head_dim, config.rope_theta, normed_tokens.device) if config.use_rotary else None
    # The kernel adds the bias and sums its gradient (a wrapped projection, LoRA or quantised, runs as it is).
    bias = layer.qkv_proj.bias if plain_module(layer.qkv_proj, "Linear") else None
    qkv = layer.qkv_proj(normed_tokens) if bias is None else F.linear(normed_tokens, layer.qkv_proj.weight)
    qkv = qkv.unflatten(-1, (3, layer.num_heads, layer.head_dim))
    query, key, value, *joined = triton_window_projection(qkv, layout, rotations, layer.qk_activation, bias)
    return query, key, value, None, None, ReadCellSlots(*joined)


class ReadCellSlots:
    """The windows' keys and values as the window attention reads them, (K, H, 1 + S, d), written by the window
    projection's kernel with slot 0 left for each window's read cell: `join` writes it there in place, the keys
    and values without a concatenation."""

    def __init__(self, key_joined: torch.Tensor, value_joined: torch.Tensor):
        self.key_joined, self.value_joined = key_joined, value_joined

    def join(self, cell_key: torch.Tensor, cell_value: torch.Tensor):
        """The joined keys and values, (K, H, 1 + S, d) each, with the read cells' (K, H, d) in slot 0."""
        return JoinReadCells.apply(self.key_joined, self.value_joined, cell_key, cell_value)


class JoinReadCells(torch.autograd.Function):
    """Writes each window's read cell key and value (K, H, d) into slot 0 of the joined keys and values
    (K, H, 1 + S, d) that the window projection wrote, in place. The joined tensors' gradient goes back whole; the
    projection's backward reads its slots 1.. only."""

    @staticmethod
    def forward(ctx, key_joined, value_joined, cell_key, cell_value):
        key_joined[:, :, 0].copy_(cell_key)
        value_joined[:, :, 0].copy_(cell_value)
        ctx.mark_dirty(key_joined, value_joined)
        return key_joined, value_joined

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        return grad_key, grad_value, grad_key[:, :, 0], grad_value[:, :, 0]
