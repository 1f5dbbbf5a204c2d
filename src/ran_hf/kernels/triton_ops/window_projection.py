"""Phase 1 of the layer, from the token projections to the windows' queries, keys and values, as one Triton kernel
forward and one backward (on CUDA, where Triton is installed).

In PyTorch ops (`RANLayer.project_windows`) the projections are activated, concatenated, gathered into window slots
(the flat tokens into packed windows; with `window_overlap` a token also fills an enrichment slot of the next window),
permuted, and queries and keys rotated: each op reads and writes every token's q, k and v, and the gather's gradient
is a zero-filled buffer its `index_add` writes into. Here the forward reads each slot's token projection once and
writes the windows' rotated queries, rotated keys and values once; the backward reads, for each token, its query's
gradient and those of the (at most two) slots it fills, un-rotates and sums them, multiplies by the activation's
derivative and writes the projection's gradient once, without atomics: deterministic. Computed in float32 whatever the
dtype. Each launch is a `torch.library.triton_op` (one op for `torch.compile`, export and a dispatch counter).

The activation is SiLU, the default `hidden_act` (the Triton cell scan takes the same one); on the values always,
on queries and keys where `attention_qk_activation`.

Shapes: T tokens, K windows, S slots, Q query slots, H heads, d head size. projected (T, 3, H, d) [q, k, v] as the
layer's `qkv_proj` writes them; query (K, H, Q, d), key and value (K, H, S, d), contiguous.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from . import register_on_meta


ROWS_PER_PROGRAM = 8
BLOCK_PAIRS = 256  # (head, pair) columns of a row per program: elementwise, so any width tiles into these


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _silu_grad(x):
    sigmoid = 1.0 / (1.0 + tl.exp(-x))
    return sigmoid * (1.0 + x * (1.0 - sigmoid))


@triton.jit
def _load_pairs(base, at, ok):
    return tl.load(base + at, mask=ok, other=0.0).to(tl.float32), tl.load(base + at + 1, mask=ok, other=0.0).to(
        tl.float32
    )


@triton.jit
def _load_projection(projected, bias, at, columns, ok, BIAS: tl.constexpr):
    """Pairs of the token projections at `at`, plus the projection's bias at `columns` where it is given apart."""
    x, y = _load_pairs(projected, at, ok)
    if BIAS:
        bx, by = _load_pairs(bias, columns, columns >= 0)
        x, y = x + tl.where(ok, bx[None, :], 0.0), y + tl.where(ok, by[None, :], 0.0)  # empty slots stay 0
    return x, y


@triton.jit
def _window_projection_kernel(
    projected, bias, slot_tokens, query_tokens, query_slots, rotations, query, key, value, key_joined,
    value_joined, T, R, S, Q, H, half,
    BIAS: tl.constexpr, ACT_QK: tl.constexpr, ROTARY: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program axis 2: 0 fills key and value rows (window k, slot s), 1 fills query rows (window k, query q).
    Keys and values are written twice: as the scan reads them, and at slots 1.. of the attention's joined ones
    (slot 0, the read cell's, is left for the scan's output)."""
    is_query = tl.program_id(2) == 1
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    pairs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # h * half + i: pair i of head h
    width = S if not is_query else Q
    in_range = rows < R * width
    token = tl.load((slot_tokens if not is_query else query_tokens) + rows, mask=in_range, other=T)
    ok = (in_range & (token < T))[:, None] & (pairs < H * half)[None, :]  # empty slots are written as zeros
    out_ok = in_range[:, None] & (pairs < H * half)[None, :]
    window, slot = rows // width, rows % width
    if is_query:
        slot = tl.load(query_slots + rows, mask=in_range, other=0)
    head, pair = pairs // half, pairs % half
    # row (window, slot) of head h in (K, H, width, d)
    out_at = (
        ((window * H)[:, None] + head[None, :]) * (width * 2 * half)
        + (rows % width)[:, None] * (2 * half)
        + 2 * pair[None, :]
    )
    source = (token * 3 * H * 2 * half)[:, None] + 2 * pairs[None, :]  # q of the token; k and v after it
    if ROTARY:
        angle = (slot * 2 * half)[:, None] + 2 * pair[None, :]
        cos, sin = _load_pairs(rotations, angle, out_ok)
    for part in tl.static_range(2):  # part 0: the query, or the key; part 1: the value (key rows only)
        if part == 0 or not is_query:
            offset = 0 if is_query else (part + 1) * H * 2 * half
            columns = tl.where(pairs < H * half, offset + 2 * pairs, 0)
            x, y = _load_projection(projected, bias, source + offset, columns, ok, BIAS)
            if part == 1 or ACT_QK:
                x, y = _silu(x), _silu(y)
            if part == 0 and ROTARY:
                x, y = x * cos - y * sin, x * sin + y * cos
            out = query if is_query else (key if part == 0 else value)
            tl.store(out + out_at, x.to(out.dtype.element_ty), mask=out_ok)
            tl.store(out + out_at + 1, y.to(out.dtype.element_ty), mask=out_ok)
            if not is_query:  # row (window, 1 + slot) of (K, H, 1 + S, d)
                joined = key_joined if part == 0 else value_joined
                joined_at = out_at + ((window * H)[:, None] + head[None, :] + 1) * (2 * half)
                tl.store(joined + joined_at, x.to(joined.dtype.element_ty), mask=out_ok)
                tl.store(joined + joined_at + 1, y.to(joined.dtype.element_ty), mask=out_ok)


@triton.jit
def _window_projection_grad_kernel(
    projected, bias, token_slots, output_slot, query_slots, rotations, grad_query, grad_key, grad_value,
    grad_key_joined, grad_value_joined, grad_projected, grad_bias_parts,
    T, S, Q, H, half,
    gq_k, gq_h, gq_q, gq_d, gk_k, gk_h, gk_s, gk_d, gv_k, gv_h, gv_s, gv_d,
    jk_k, jk_h, jk_s, jk_d, jv_k, jv_h, jv_s, jv_d,
    BIAS: tl.constexpr, ACT_QK: tl.constexpr, ROTARY: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per block of tokens and (head, pair) columns: the gradient of the token's q, k and v. A slot's
    key and value gradients are the scan's (grad_key, grad_value) plus the attention's (at slot 1 + s of the
    joined ones): summed here, not by a kernel of their own."""
    tokens = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    pairs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    token_ok = tokens < T
    ok = token_ok[:, None] & (pairs < H * half)[None, :]
    head, pair = (pairs // half)[None, :], (pairs % half)[None, :]
    source = (tokens * 3 * H * 2 * half)[:, None] + 2 * pairs[None, :]
    columns = tl.where(pairs < H * half, 2 * pairs, 0)  # of the query's bias; the key's and value's after it
    parts_at = tl.program_id(0) * (3 * H * 2 * half) + columns  # this block's sums of the bias gradient

    # The query: one per token, at its output slot (window k, query q), rotated by the angle of its slot.
    at = tl.load(output_slot + tokens, mask=token_ok, other=0)
    window, row = at // Q, at % Q
    gq_at = (window * gq_k + row * gq_q)[:, None] + head * gq_h + 2 * pair * gq_d
    gx, gy = (
        tl.load(grad_query + gq_at, mask=ok, other=0.0).to(tl.float32),
        tl.load(grad_query + gq_at + gq_d, mask=ok, other=0.0).to(tl.float32),
    )
    if ROTARY:  # the transpose of the rotation
        slot = tl.load(query_slots + at, mask=token_ok, other=0)
        cos, sin = _load_pairs(rotations, (slot * 2 * half)[:, None] + 2 * pair, ok)
        gx, gy = gx * cos + gy * sin, gy * cos - gx * sin
    if ACT_QK:
        x, y = _load_projection(projected, bias, source, columns, ok, BIAS)
        gx, gy = gx * _silu_grad(x), gy * _silu_grad(y)
    tl.store(grad_projected + source, gx.to(grad_projected.dtype.element_ty), mask=ok)
    tl.store(grad_projected + source + 1, gy.to(grad_projected.dtype.element_ty), mask=ok)
    if BIAS:
        _store_column_sums(grad_bias_parts, parts_at, gx, gy, pairs < H * half)

    # The key and value: summed over the slots the token fills, its own and an enrichment one (-1: none).
    kx = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    ky = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    vx = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    vy = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for column in tl.static_range(2):
        at = tl.load(token_slots + tokens * 2 + column, mask=token_ok, other=-1)
        filled = ok & (at >= 0)[:, None]
        window, slot = at // S, at % S
        gk_at = (window * gk_k + slot * gk_s)[:, None] + head * gk_h + 2 * pair * gk_d
        jk_at = (window * jk_k + (slot + 1) * jk_s)[:, None] + head * jk_h + 2 * pair * jk_d
        gx = tl.load(grad_key + gk_at, mask=filled, other=0.0).to(tl.float32)
        gy = tl.load(grad_key + gk_at + gk_d, mask=filled, other=0.0).to(tl.float32)
        gx += tl.load(grad_key_joined + jk_at, mask=filled, other=0.0).to(tl.float32)
        gy += tl.load(grad_key_joined + jk_at + jk_d, mask=filled, other=0.0).to(tl.float32)
        if ROTARY:
            cos, sin = _load_pairs(rotations, (slot * 2 * half)[:, None] + 2 * pair, filled)
            gx, gy = gx * cos + gy * sin, gy * cos - gx * sin
        kx += gx
        ky += gy
        gv_at = (window * gv_k + slot * gv_s)[:, None] + head * gv_h + 2 * pair * gv_d
        jv_at = (window * jv_k + (slot + 1) * jv_s)[:, None] + head * jv_h + 2 * pair * jv_d
        vx += tl.load(grad_value + gv_at, mask=filled, other=0.0).to(tl.float32)
        vy += tl.load(grad_value + gv_at + gv_d, mask=filled, other=0.0).to(tl.float32)
        vx += tl.load(grad_value_joined + jv_at, mask=filled, other=0.0).to(tl.float32)
        vy += tl.load(grad_value_joined + jv_at + jv_d, mask=filled, other=0.0).to(tl.float32)
    key_at = source + H * 2 * half
    if ACT_QK:
        x, y = _load_projection(projected, bias, key_at, columns + H * 2 * half, ok, BIAS)
        kx, ky = kx * _silu_grad(x), ky * _silu_grad(y)
    tl.store(grad_projected + key_at, kx.to(grad_projected.dtype.element_ty), mask=ok)
    tl.store(grad_projected + key_at + 1, ky.to(grad_projected.dtype.element_ty), mask=ok)
    value_at = key_at + H * 2 * half
    x, y = _load_projection(projected, bias, value_at, columns + 2 * H * 2 * half, ok, BIAS)
    vx, vy = vx * _silu_grad(x), vy * _silu_grad(y)
    tl.store(grad_projected + value_at, vx.to(grad_projected.dtype.element_ty), mask=ok)
    tl.store(grad_projected + value_at + 1, vy.to(grad_projected.dtype.element_ty), mask=ok)
    if BIAS:
        _store_column_sums(grad_bias_parts, parts_at + H * 2 * half, kx, ky, pairs < H * half)
        _store_column_sums(grad_bias_parts, parts_at + 2 * H * 2 * half, vx, vy, pairs < H * half)


@triton.jit
def _store_column_sums(parts, at, gx, gy, ok):
    tl.store(parts + at, tl.sum(gx, axis=0), mask=ok)
    tl.store(parts + at + 1, tl.sum(gy, axis=0), mask=ok)


def _grid(rows: int, num_heads: int, half: int, *kinds: int) -> tuple:
    return (triton.cdiv(rows, ROWS_PER_PROGRAM), triton.cdiv(num_heads * half, BLOCK_PAIRS), *kinds)


@triton_op("ran_hf::window_projection", mutates_args={})
def window_projection(
    projected: torch.Tensor,
    bias: torch.Tensor | None,
    window_slots: torch.Tensor,
    query_index: torch.Tensor,
    query_slots: torch.Tensor,
    token_slots: torch.Tensor,
    output_slot: torch.Tensor,
    rotations: torch.Tensor,
    act_qk: bool,
    rotary: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """projected (T, 3, H, d) contiguous; window_slots (K, S) and query_index (K, Q) the token of each slot and
    query (T or more: none), query_slots (K, Q) the slot of each query; rotations (S, d / 2, 2) of the slots.
    Returns query (K, H, Q, d), key and value (K, H, S, d), and the key and value again at slots 1.. of
    (K, H, 1 + S, d), slot 0 left unwritten for the read cell (`token_ops.JoinReadCells`). token_slots (T, 2), the slots
    k * S + s each token fills (-1: none), and output_slot (T,), its query k * Q + q, are the inverse maps the
    backward reads. `bias` (3 H d): the projection's bias, added here where the projection left it out."""
    num_tokens, _, num_heads, head_dim = projected.shape
    (num_windows, num_slots), num_queries = window_slots.shape, query_index.shape[1]
    query = projected.new_empty(num_windows, num_heads, num_queries, head_dim)
    key = projected.new_empty(num_windows, num_heads, num_slots, head_dim)
    value = torch.empty_like(key)
    key_joined = projected.new_empty(num_windows, num_heads, 1 + num_slots, head_dim)
    value_joined = torch.empty_like(key_joined)
    rows = num_windows * max(num_slots, num_queries)
    wrap_triton(_window_projection_kernel)[_grid(rows, num_heads, head_dim // 2, 2)](
        projected, projected if bias is None else bias, window_slots, query_index, query_slots, rotations, query,
        key, value, key_joined, value_joined, num_tokens, num_windows, num_slots, num_queries, num_heads,
        head_dim // 2, BIAS=bias is not None, ACT_QK=act_qk, ROTARY=rotary, ROWS=ROWS_PER_PROGRAM,
        BLOCK=BLOCK_PAIRS,
    )  # fmt: skip
    return query, key, value, key_joined, value_joined


@triton_op("ran_hf::window_projection_backward", mutates_args={"grad_bias_parts"})
def window_projection_backward(
    projected: torch.Tensor,
    bias: torch.Tensor | None,
    token_slots: torch.Tensor,
    output_slot: torch.Tensor,
    query_slots: torch.Tensor,
    rotations: torch.Tensor,
    grad_query: torch.Tensor,
    grad_key: torch.Tensor,
    grad_value: torch.Tensor,
    grad_key_joined: torch.Tensor,
    grad_value_joined: torch.Tensor,
    grad_bias_parts: torch.Tensor,
    act_qk: bool,
    rotary: bool,
) -> torch.Tensor:
    """The gradient (T, 3, H, d) of `window_projection`'s input, given its outputs' (of any strides; a stride of
    0 reads a gradient of zeros). Where a bias is given, each block of tokens writes its sums of that gradient
    into its row of `grad_bias_parts` (token blocks, 3 H d)."""
    num_tokens, _, num_heads, head_dim = projected.shape
    grad_projected = torch.empty_like(projected)
    wrap_triton(_window_projection_grad_kernel)[_grid(num_tokens, num_heads, head_dim // 2)](
        projected, projected if bias is None else bias, token_slots, output_slot, query_slots, rotations,
        grad_query, grad_key, grad_value, grad_key_joined, grad_value_joined, grad_projected, grad_bias_parts,
        num_tokens, grad_key.shape[2], grad_query.shape[2], num_heads, head_dim // 2, *grad_query.stride(),
        *grad_key.stride(), *grad_value.stride(), *grad_key_joined.stride(), *grad_value_joined.stride(),
        BIAS=bias is not None, ACT_QK=act_qk, ROTARY=rotary, ROWS=ROWS_PER_PROGRAM, BLOCK=BLOCK_PAIRS,
    )  # fmt: skip
    return grad_projected


def _forward_on_meta(projected, bias, window_slots, query_index, *_):
    (num_windows, num_slots), (_, _, num_heads, head_dim) = window_slots.shape, projected.shape
    query = projected.new_empty(num_windows, num_heads, query_index.shape[1], head_dim)
    key = projected.new_empty(num_windows, num_heads, num_slots, head_dim)
    joined = projected.new_empty(num_windows, num_heads, 1 + num_slots, head_dim)
    return query, key, torch.empty_like(key), joined, torch.empty_like(joined)


register_on_meta(window_projection, _forward_on_meta)
register_on_meta(window_projection_backward, lambda projected, *_: torch.empty_like(projected))


def _setup_context(ctx, inputs, output):
    projected, bias, _, _, query_slots, token_slots, output_slot, rotations, act_qk, rotary = inputs
    ctx.save_for_backward(projected, bias, token_slots, output_slot, query_slots, rotations)
    ctx.act_qk, ctx.rotary = act_qk, rotary
    ctx.shapes = [tuple(out.shape) for out in output]


def _backward(ctx, *grads):
    projected, bias, *maps = ctx.saved_tensors
    # An output without a gradient reads zeros: one element, broadcast by strides of 0.
    grads = [projected.new_zeros(1).expand(shape) if grad is None else grad for grad, shape in zip(grads, ctx.shapes)]
    blocks = triton.cdiv(projected.shape[0], ROWS_PER_PROGRAM)
    parts = projected.new_empty(0) if bias is None else projected.new_empty(blocks, bias.numel(), dtype=torch.float)
    grad_projected = window_projection_backward(projected, bias, *maps, *grads, parts, ctx.act_qk, ctx.rotary)
    grad_bias = None if bias is None else parts.sum(0).to(bias.dtype)
    return (grad_projected, grad_bias) + (None,) * 8


window_projection.register_autograd(_backward, setup_context=_setup_context)


def triton_window_projection(projected, layout, rotations, act_qk: bool, bias: torch.Tensor | None = None):
    """The windows' queries (K, H, Q, d), keys and values (K, H, S, d) of the token projections `projected`
    (T, 3, H, d), activated, and queries and keys rotated by `rotations` (S, d / 2, 2) unless it is None; then the
    keys and values again as the window attention reads them, (K, H, 1 + S, d) with slot 0 for the read cell
    (`token_ops.ReadCellSlots`). `bias` (3 H d): the projection's bias where the projection left it out (added here, and its
    gradient summed here: one pass over the projection's gradient fewer)."""
    rotary = rotations is not None
    if rotations is None:
        rotations = projected.new_zeros(1, 1, 2)
    rotations = rotations.to(torch.float32).contiguous()
    return window_projection(
        projected.contiguous(), bias, layout.window_slots, layout.query_index, layout.query_slots,
        layout.token_slots(), layout.output_slot, rotations, act_qk, rotary,
    )  # fmt: skip
