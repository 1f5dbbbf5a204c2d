"""The RAN layer (Li et al., ACL 2023), computed in three phases over all windows of a batch.

A layer reads a sequence in windows. Each window attends over itself and a global perception cell; the cell written
by window i is read by window i + 1, and at the end every token reviews the cells of all windows. `RANLayer.forward`
reads as its phases: per-token projections for all windows at once, the cell scan (cell_scan.py), one batched
attention call for every window's tokens, then the memory review (memory_review.py; causal bookkeeping:
causal_memory.py). A decoding step is the same phases for one token (`decode_token`).

Shapes: B batch, L padded length, T real tokens in the batch, K windows in the batch, N windows of the longest
sequence, S slots of a window (enrichment tokens + the longest window), H heads, d head size, D hidden size.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .associative_memory import RANAssociativeMemory
from .building_blocks import (
    NormAfter,
    RANCenteredRMSNorm,
    RANGatedLinearUnit,
    activation_function,
    apply_dropout,
    apply_interleaved_rotary,
    project_heads,
    rotate_pairs_complex,
)
from .cache_ran import RANCacheLayer
from .causal_memory import update_cache
from .cell_scan import CellScanWeights, RANCellScan
from .configuration_ran import RANConfig
from .decode_step import StepPositions, next_tail, remember_cell
from .kernel_hub import use_kernel_function
from .memory_review import RANMemoryReview
from .window_layout import RANWindowLayout


class WindowProjections(NamedTuple):
    """What `RANLayer.project_windows` gives the scan and the window attention."""

    query: torch.Tensor  # (K, H, Q, d) the queries of the slots whose output is needed, rotated
    key: torch.Tensor  # (K, H, S, d) the keys of every window slot, rotated
    value: torch.Tensor  # (K, H, S, d)
    new_kv: torch.Tensor | None  # (T, 2, H, d) the new tokens' un-rotated keys and values, with a cache; else None
    recalled: torch.Tensor | None  # (T, H * d) with `config.associative_memory`: what each token recalls; else None
    joined: object | None  # from a kernel: keys and values again with slot 0 for the read cell (`.join`); else None


class LayerOutputs(NamedTuple):
    """What `RANLayer.forward` returns."""

    hidden_states: torch.Tensor  # (B, L, D) the token states, zeros at padding: recorded as `hidden_states`
    raw_cells: torch.Tensor  # (N, B, D) the raw cells of this pass's windows
    last_cell: torch.Tensor  # (B, D) each sequence's last cell (the starting one for a row of padding only)
    attention_weights: torch.Tensor | None  # (B, H, L, 1 + S) with `output_attentions` where attention gives them
    review_weights: torch.Tensor | None  # (B, L, C) with `output_attentions` and memory review


def eager_window_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """Softmax attention in plain matmuls, the one implementation that can return its weights.

    query (K, H, Q, d), key and value (K, H, X, d), attention_mask additive (K, 1, Q or 1, X). Returns the output as
    (K, Q, H, d), like every attention function of Transformers, and the weights (K, H, Q, X).
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    attended = torch.matmul(F.dropout(weights, p=dropout, training=module.training), value)
    return attended.transpose(1, 2).contiguous(), weights


def in_row_chunks(function, chunk_rows: int | None, *tensors: torch.Tensor, out: torch.Tensor | None = None):
    """`function(*tensors)` for a `function` of (R, ...) tensors that works row by row, computed `chunk_rows` rows at a
    time into one (R, ...) output (`out` where given, which may be an input: a chunk is written once it is read):
    its intermediates then exist for one chunk at a time, not for all R rows. None: all rows at once."""
    num_rows = tensors[0].shape[0]
    if chunk_rows is None or num_rows <= chunk_rows:
        return function(*tensors)
    for start in range(0, num_rows, chunk_rows):
        part = function(*(tensor[start : start + chunk_rows] for tensor in tensors))
        if out is None:
            out = part.new_empty(num_rows, *part.shape[1:])
        out[start : start + chunk_rows] = part
        del part  # not alive while the next chunk is computed
    return out


def rows_per_chunk(rows: torch.Tensor, features: int | None) -> int | None:
    """How many rows of `rows` (R, ...) make a chunk of at most `features` features (None: all rows at once)."""
    return None if features is None else max(1, features // max(1, rows[0].numel()))


class RANWindowAttention(nn.Module):
    """The window attention of a RAN layer: its tokens read their window's cell and slots through one of
    Transformers' attention functions. Holds no weights (the projections are the layer's); its weights, where the
    implementation gives them, are what `output_attentions=True` records as `attentions`."""

    def __init__(self, config: RANConfig):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_probs_dropout_prob
        self.is_causal = False  # read by attention functions: causality is in the window mask, not their flag
        self.causal_windows = config.is_causal  # what the window mask says (an architecture field: fixed once built)

    def forward(self, query, key, value, cell_key, cell_value, layout: RANWindowLayout, output_attentions: bool,
                joined=None, chunk: int | None = None):  # fmt: skip
        """Token attention of all windows in one call: window k's keys are its read cell followed by its slots
        (`joined`: the Triton projection's keys and values with room for the cell, written into it in place).

        Packed windows are a batch of K sequences, so any of Transformers' attention functions runs them
        (`config._attn_implementation`). Returns the attended values (T, H * d) and, with `output_attentions` and
        an implementation that gives them (eager), every token's weights (B, H, L, 1 + S), else None; the attended
        values stay in the windows' query slots, (K, Q, H * d). With `chunk`, `chunk` windows at a time.

        A decoding step (`layout` is its `StepPositions`) hands one query per row (B, H, 1, d) and its window's keys
        and values (B, H, 1 + S, d), the read cell's in slot 0 already: returns (B, H * d) and None.
        """
        if type(layout) is StepPositions:  # (the config's implementation, read once after each edit of it)
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(
                layout.settings.attn_implementation, eager_window_attention
            )
            attended, _ = attention(
                self, query, key, value, layout.attention_bias, dropout=0.0, scaling=self.head_dim**-0.5
            )  # (B, 1, H, d)
            return attended.flatten(1), None
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_window_attention)
        attention_mask = layout.window_attention_mask(self.causal_windows, query.dtype)

        def join(key, value, cell_key, cell_value):
            if joined:
                return joined.join(cell_key, cell_value)  # (K, H, 1 + S, d)
            key = torch.cat([cell_key[:, :, None], key], dim=2)  # (K, H, 1 + S, d)
            return key, torch.cat([cell_value[:, :, None], value], dim=2)  # (K, H, 1 + S, d)

        def attend(query, key, value, attention_mask):
            dropout = self.attention_dropout if self.training else 0.0
            return attention(self, query, key, value, attention_mask, dropout=dropout, scaling=self.head_dim**-0.5)

        if chunk is None:
            key, value = join(key, value, cell_key, cell_value)
            attended, weights = attend(query, key, value, attention_mask)  # (K, Q, H, d)
        else:  # inference: a chunk of windows at a time, the keys and values with their read cell for it alone

            def attend_chunk(query, key, value, cell_key, cell_value, attention_mask):
                return attend(query, *join(key, value, cell_key, cell_value), attention_mask)[0]

            inputs = (query, key, value, cell_key, cell_value, attention_mask)  # every one (K, ...)
            attended, weights = in_row_chunks(attend_chunk, chunk, *inputs), None
        if weights is not None and output_attentions:
            # The returned weights stay in the graph, as returned hidden states do: the output is recomputed from
            # them, so that gradients with respect to the attention weights exist.
            weights = layout.weights_per_token(weights)  # (B, H, L, 1 + S)
            dropped = F.dropout(layout.weights_per_window(weights), self.attention_dropout, self.training)
            attended = torch.matmul(dropped, value).transpose(1, 2)
        return attended.flatten(-2), weights  # (K, Q, H * d)


class RANLayer(GradientCheckpointingLayer):
    """One RAN layer over all windows of a batch (bidirectional, or causal when `config.is_causal`)."""

    # Inference on the PyTorch path runs the rotary embedding, the window attention and the per-token tail (output
    # projection, GLU, norms) over chunks of windows or tokens of at most this many features: 8 MiB in float32,
    # 16,384 tokens at D = 128. Done for all tokens at once, their intermediates are alive together (the tail's
    # half a dozen (T, D) ones, at 1M tokens and D = 128 0.5 GiB each), and they made the peak of a forward pass.
    # A class constant: it never changes the outputs (beyond float rounding), so checkpoints need not carry it.
    inference_chunk_features = 2**21

    def __init__(self, config: RANConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.residual_stream = config.residual_stream
        self.cell_input_residual = config.cell_input_residual
        hidden_size, inner_size, eps = config.hidden_size, self.num_heads * self.head_dim, config.layer_norm_eps

        # A starting cell where one is read: the encoder's first layer (later layers continue from the cell of the
        # layer below), and every layer of a causal model (the cell below has read the future). No parameter
        # exists that gets no gradient, so distributed training needs no unused-parameter search for it.
        if config.is_causal or layer_idx == 0:
            self.initial_cell = nn.Parameter(torch.zeros(hidden_size))
        self.input_norm = RANCenteredRMSNorm(hidden_size, eps)
        self.qkv_proj = nn.Linear(hidden_size, 3 * inner_size)
        self.o_proj = nn.Linear(inner_size, hidden_size)
        self.attention_glu = RANGatedLinearUnit(hidden_size)
        if not self.residual_stream or self.cell_input_residual:
            self.attention_norm = RANCenteredRMSNorm(hidden_size, eps)
        # The scan owns what only the cell uses (its GLU and norm with `use_cell_residual`). Built at this point, they
        # keep the parameter order, and so the initial weights a seed gives, they had as the layer's.
        self.cell_scan = RANCellScan(config)
        # Architecture fields, fixed once built: read here once rather than from the config at every call.
        self.hidden_act, self.uses_associative_memory = config.hidden_act, config.associative_memory
        if self.uses_associative_memory:
            self.associative_memory = RANAssociativeMemory(config)
        self.reviews_memory = config.memory_review  # an architecture field: fixed once built
        if config.memory_review:
            self.memory_review = RANMemoryReview(config)
        elif not self.residual_stream:
            self.output_norm = RANCenteredRMSNorm(hidden_size, eps)

        self.act = activation_function(config.hidden_act)
        self.qk_activation = config.attention_qk_activation
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.attention_dropout = config.attention_probs_dropout_prob  # the scan's window attention reads it too
        self.window_attention = RANWindowAttention(config)

    def chunk_features(self) -> int | None:
        """How many features inference computes at a time (`inference_chunk_features`; `rows_per_chunk`); None in
        training, with gradients and when compiled: all at once. Asked once per call of the layer."""
        if self.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        return self.inference_chunk_features

    # ---- shared per-position maths -------------------------------------------------------------------------------

    def normalize_input(self, states: torch.Tensor) -> torch.Tensor:
        """Concat-LayerNorm of tokens and cells alike; the result feeds both the projections and the residual GLU."""
        return self.input_norm(states, self.dropout)

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., 3, H, d) queries, keys and values; the values activated, and the queries and keys with
        `config.attention_qk_activation`."""
        return project_heads(self.qkv_proj(normed), self.num_heads, self.head_dim, self.act, self.qk_activation)

    def attention_output(self, attended: torch.Tensor, normed: torch.Tensor, rows=None) -> torch.Tensor:
        """Output projection plus the gated residual of the attention's normalised input: (..., H * d) -> (..., D).
        With `rows`, `attended` is in another order (the windows' query slots) and token t reads row `rows[t]`."""
        # dropout(act(o_proj(attended))) + GLU(normed): on CUDA the branch's activation, dropout and sum run inside
        # the GLU's kernel, which reads the branch through `rows`.
        return self.attention_glu(normed, self.o_proj(attended), self.act, self.dropout, rows)

    def finish_attention(self, attended: torch.Tensor, normed: torch.Tensor, rows=None) -> torch.Tensor:
        """The official post-norm ending: attention output, then the two normalisations -> standardised (..., D)."""
        # On CUDA one kernel from the GLU's projection to the dropped, twice-normalised states.
        then = NormAfter(self.attention_norm, self.dropout, True)
        return self.attention_glu(normed, self.o_proj(attended), self.act, self.dropout, rows, then)

    def cell_scan_weights(self) -> CellScanWeights:
        """The layer's modules that the cell scan shares with the tokens, read now (an adapter may have replaced one
        since). The cell's own modules are the scan's."""
        cell_input_residual = self.cell_input_residual
        return CellScanWeights(
            input_norm=self.input_norm,
            qkv_proj=self.qkv_proj,
            o_proj=self.o_proj,
            attention_glu=self.attention_glu if cell_input_residual else None,
            attention_norm=self.attention_norm if cell_input_residual else None,
        )

    # ---- phase 1 ---------------------------------------------------------------------------------------------------

    @use_kernel_function("project_windows")
    def project_windows(
        self, normed_tokens: torch.Tensor, layout: RANWindowLayout, cache: RANCacheLayer | None, chunk_features=None
    ) -> WindowProjections:
        """Queries, keys and values of every token in every window slot, rotary applied (slot s is position s + 1).

        Slots holding cached tokens take their keys and values from the cache. Queries exist only for slots whose
        output is needed (new, non-enrichment tokens): (K, H, Q, d). Also returns the un-rotated keys and values of
        the new tokens, from which the cache keeps its tail, with `config.associative_memory` what each token
        recalls from it (T, H * d): the memory is read with the same queries and written with the same keys, and
        from the Triton kernel the keys and values again with a slot 0 for the read cell (`attend_windows`). The
        PyTorch path computes `chunk_features` features at a time (`chunk_features()`; None: all at once).
        """
        config = self.config
        rotations = (
            layout.rotary(self.head_dim, config.rope_parameters["rope_theta"], normed_tokens.device)
            if config.use_rotary
            else None
        )
        return self.project_windows_reference(normed_tokens, layout, cache, rotations, chunk_features)

    def project_windows_reference(
        self,
        normed_tokens: torch.Tensor,
        layout: RANWindowLayout,
        cache: RANCacheLayer | None,
        rotations: torch.Tensor | None,
        chunk_features: int | None = None,
    ) -> WindowProjections:
        """`project_windows` without its kernel, wherever that does not run; `rotations` (S, d / 2, 2) are the window
        slots' (None without the rotary embedding). The rotary embedding stays its own op (`apply_interleaved_rotary`),
        with its own choice of kernel."""
        qkv = in_row_chunks(self.project, rows_per_chunk(normed_tokens, chunk_features), normed_tokens)  # (T, 3, H, d)
        # (T, 1, H, d), (T, 2, H, d): views, gathered without a copy
        new_query, new_kv = qkv.split_with_sizes([1, 2], dim=1)
        tail = None if cache is None else cache.tail  # (B, P, 2, H, d)
        key, value = layout.gather_sources(new_kv, layout.window_slots, tail).permute(2, 0, 3, 1, 4)
        query = layout.gather_sources(new_query[:, 0], layout.query_index).transpose(1, 2)  # (K, H, Q, d)
        # A view of every token's q, k and v: returned without a cache, it would keep them alive through the layer.
        new_kv = new_kv if cache is not None else None
        del qkv, new_query
        recalled = None
        if self.uses_associative_memory:
            recalled = self.associative_memory(query, key, value, normed_tokens, layout, cache)
        if rotations is not None:  # (S, d / 2, 2): slot s is position s + 1
            # In inference, rotated a chunk of windows at a time in place: the gathered slots are this pass's own.
            query_rotations = rotations[layout.query_slots][:, None]  # (K, 1, Q, d / 2, 2)
            chunk = rows_per_chunk(query, chunk_features)
            out = None if chunk is None else query
            query = in_row_chunks(apply_interleaved_rotary, chunk, query, query_rotations, out=out)
            chunk = rows_per_chunk(key, chunk_features)
            out = None if chunk is None else key
            key = in_row_chunks(lambda key: apply_interleaved_rotary(key, rotations), chunk, key, out=out)
        return WindowProjections(query, key, value, new_kv, recalled, None)

    # ---- phase 3 ---------------------------------------------------------------------------------------------------

    def attend_windows(self, query, key, value, cell_key, cell_value, layout: RANWindowLayout, output_attentions,
                       joined=None, chunk_features=None):  # fmt: skip
        """Token attention of all windows in one call (`RANWindowAttention`); in inference on the PyTorch path a
        chunk of windows at a time (`chunk_features`). Returns the attended values in the windows' query slots,
        (K, Q, H * d), and the weights (B, H, L, 1 + S) or None."""
        chunk = None if joined or output_attentions else rows_per_chunk(key, chunk_features)
        return self.window_attention(query, key, value, cell_key, cell_value, layout, output_attentions, joined, chunk)

    def token_tail(self, token_states, attended, normed_tokens, rows=None) -> torch.Tensor:
        """The attention's output and the layer's ending before memory review: the residual sum, or the official
        norms (and, without memory review, the output norm) -> (..., D). With `rows`, `attended` is in another order
        (the windows' query slots) and token t reads row `rows[t]`."""
        if self.residual_stream:
            return token_states + self.attention_output(attended, normed_tokens, rows)
        token_states = self.finish_attention(attended, normed_tokens, rows)
        return token_states if self.reviews_memory else self.output_norm(token_states)

    def per_token_tail(self, token_states, attended, normed_tokens, rows=None, chunk_features=None) -> torch.Tensor:
        """`token_tail` for all tokens (T, D); in inference on the PyTorch path (`rows` is None: the attended values
        are per token already) a chunk of tokens at a time (`chunk_features`)."""
        if rows is not None or chunk_features is None:
            return self.token_tail(token_states, attended, normed_tokens, rows)
        chunk = rows_per_chunk(token_states, chunk_features)
        return in_row_chunks(self.token_tail, chunk, token_states, attended, normed_tokens)

    # ---- the layer -------------------------------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        cell: torch.Tensor | None,
        layout: RANWindowLayout,
        cache: RANCacheLayer | None = None,
        output_attentions: bool = False,
    ) -> LayerOutputs:
        """hidden_states (B, L, D) the new tokens' states, whose real tokens the layer reads packed, (T, D) (a view
        where there is no padding); cell (B, D) the cell each sequence's first window reads, or None for the layer's
        own learned starting cell (read here, inside the layer, so that a sharded parameter is gathered).

        With a `cache` (causal continuation) the scan starts from the cached cell and the cache is updated in place.
        Returns token states (B, L, D), zeros at padding (what Transformers' output capture records as
        `hidden_states`), raw cells (N, B, D) of this pass's windows, each sequence's last cell (B, D)
        (the starting one for a row of padding only) and, with `output_attentions`, every token's window attention
        weights (B, H, L, 1 + S) (None unless the attention implementation gives them) and memory-review weights
        (B, L, C).

        A decoding step hands its `StepPositions` as the `layout`, one token per row as (B, D) `hidden_states`, and
        the layer's `cache` (`decode_token`).
        """
        if type(layout) is StepPositions:
            return self.decode_token(hidden_states, cache, layout)
        initial_cell = None
        if hasattr(self, "initial_cell"):
            initial_cell = apply_dropout(self.dropout, self.initial_cell[None].expand(layout.batch_size, -1))
        start_cell = initial_cell if cell is None else cell
        start_previous = torch.zeros_like(start_cell)
        if cache is not None and cache.cell is not None:
            start_cell, start_previous = cache.cell, cache.previous_raw_cell
        if layout.num_steps == 0:  # padding only: nothing to read, nothing to write
            return LayerOutputs(hidden_states, hidden_states.new_zeros(0, *start_cell.shape), start_cell, None, None)
        token_states = layout.from_padded(hidden_states)  # (T, D)
        normed_tokens = self.normalize_input(token_states)  # (T, D)

        # 1. Everything that does not depend on the cell, for all windows at once.
        chunk_features = self.chunk_features()
        query, key, value, new_kv, recalled, joined = self.project_windows(
            normed_tokens, layout, cache, chunk_features
        )

        # 2. The cell scan: the only sequential step.
        read_keys, read_values, raw_cells, cells = self.cell_scan(
            self.cell_scan_weights(), start_cell, start_previous, key, value, layout.for_cell_scan()
        )

        # 3. Token attention of all windows in one batched call, then the per-token tail.
        read_key, read_value = layout.per_sequence(read_keys), layout.per_sequence(read_values)
        attended, attention_weights = self.attend_windows(
            query, key, value, read_key, read_value, layout, output_attentions, joined, chunk_features
        )  # (K, Q, H * d)
        # Back to tokens (T, H * d); on the Triton path the output projection runs on the query slots and the GLU
        # kernel reads its rows by token, so that no gather and no zero-filled scatter move them.
        rows = layout.output_slot if joined else None
        del query, key, value, joined  # read by the attention only: not kept alive through the rest of the layer
        attended = attended.flatten(0, 1) if rows is not None else layout.from_windows(attended)
        if recalled is not None:  # the associative memory, read with the same queries
            attended = attended + recalled
        token_states = self.per_token_tail(token_states, attended, normed_tokens, rows, chunk_features)  # (T, D)
        del attended, normed_tokens
        review_weights = None
        if self.reviews_memory:
            token_states, review_weights = self.memory_review(
                token_states, raw_cells, initial_cell, layout, cache, output_attentions
            )
        if cache is not None:
            update_cache(self.config, cache, layout, (start_cell, start_previous), raw_cells, cells, new_kv)
        last_cell = layout.last_cells(cells, start_cell)
        hidden_states = layout.to_padded(token_states)  # (B, L, D)
        return LayerOutputs(hidden_states, raw_cells, last_cell, attention_weights, review_weights)

    # ---- a decoding step -------------------------------------------------------------------------------------------

    def decode_token(self, states: torch.Tensor, cache: RANCacheLayer, at: StepPositions) -> LayerOutputs:
        """One new token per row against the cache (decode_step.py): `forward`'s phases for that token, through the
        same modules. states (B, D) -> the token states after the layer (B, D); the cache's state updated."""
        # 1. The new token's query, key and value (rotated together: they share a position), and its window. What
        # the last eager step kept (`step_window`, `step_review`) holds while the cache holds the state it came from.
        cell, previous_raw, cell_states = cache.cell, cache.previous_raw_cell, cache.cell_states
        kept = cache.memo_of
        if (
            at.compiled
            or kept is None
            or not (kept[0] is cache.tail_keys and kept[1] is cell and kept[2] is cell_states)
        ):
            cache.step_window = cache.step_review = None
        normed = self.normalize_input(states)  # (B, D)
        qkv = self.project(normed)  # (B, 3, H, d)
        query, key, value = qkv.unbind(1)  # (B, H, d) each
        rotated_key = key
        if at.token_rotations is not None:
            query, rotated_key = rotate_pairs_complex(qkv[:, :2], at.token_rotations).unbind(1)
        keys = cache.tail_keys.index_put((at.rows, at.slot), key)  # (B, S, H, d), un-rotated: what the cache keeps
        values = cache.tail_values.index_put((at.rows, at.slot), value)  # (B, S, H, d)
        window_keys, window_values = self.step_window(cache, keys, values, rotated_key, value, at)  # (B, H, 1 + S, d)

        # 2. Token attention over the read cell (slot 0, not rotated) and the window's visible slots.
        attended, _ = self.window_attention(query[:, :, None], window_keys, window_values, None, None, at, False)
        if self.uses_associative_memory:  # the memory after the token's own write, read with the un-rotated query
            attended = attended + self.associative_memory(qkv[:, 0], keys, value, normed, at, cache)
        token = self.token_tail(states, attended, normed)  # (B, D)

        # 3. Where a row's token ends its window, the cell scan's step for that window. Before memory review, which
        # does not read the window's own cell: a compiled step writes it into the room first, in place, and reviews the
        # room it wrote (a graph that read the room before writing it in place would copy all of it).
        tail_keys, tail_values = keys, values
        if at.scan_runs:
            _, _, raw, new_cell = self.cell_scan(
                self.cell_scan_weights(), cell, previous_raw, window_keys[:, :, 1:], window_values[:, :, 1:], at
            )
            ends = at.ends_window[:, None]
            cell, previous_raw = torch.where(ends, new_cell, cell), torch.where(ends, raw, previous_raw)
            if self.reviews_memory:
                cell_states = remember_cell(self.memory_review.project_cells(raw), cell_states, at)
            tail_keys, tail_values = next_tail(keys, at), next_tail(values, at)

        # 4. Memory review of the cached cells (the layer's starting cell first, where it reads it).
        if self.reviews_memory:
            token = self.memory_review(token, None, self.initial_cell[None], at, cache)[0]

        # 5. The layer's state after the step; what stays until a window ends stays cached between eager steps.
        if at.scan_runs:
            cache.cell, cache.previous_raw_cell = cell, previous_raw
            if cell_states is not None:  # (None: a compiled step wrote the cached room in place)
                cache.cell_states = cell_states
        cache.update_tail(tail_keys, tail_values)
        if not (at.scan_runs or at.compiled):
            cache.step_window, cache.memo_of = (window_keys, window_values), (cache.tail_keys, cell, cell_states)
        return LayerOutputs(token, None, None, None, None)

    def step_window(self, cache: RANCacheLayer, keys, values, rotated_key, value, at: StepPositions):
        """The keys and values (B, H, 1 + S, d) window attention reads in a step: the read cell's (slot 0, not
        rotated), then the window's slots, rotated, the new token's written in. Kept in the cache between eager steps
        (`step_window`), where a step writes only its token's; built from the cached tail and cell where the cache has
        none (after a window ended, or any other update of the state) and in every compiled step, which cannot ask."""
        if cache.step_window is not None and not at.compiled:
            window_keys, window_values = cache.step_window
            # In place, into the slot after each row's tail: no step reads it before the one that writes it, so a step
            # that fails and is run again leaves nothing behind.
            window_keys[at.rows, :, at.key_slot] = rotated_key
            window_values[at.rows, :, at.key_slot] = value
            return window_keys, window_values
        _, cell_key, cell_value = self.project(self.normalize_input(cache.cell)).unbind(1)  # (B, H, d) each
        if at.key_rotations is not None:
            keys = rotate_pairs_complex(keys, at.key_rotations)
        # (Joined heads-first: joined slot-first and then transposed, inductor wrote wrong values into the cached tail.)
        window_keys = torch.cat([cell_key[:, :, None], keys.transpose(1, 2)], dim=2)  # (B, H, 1 + S, d)
        window_values = torch.cat([cell_value[:, :, None], values.transpose(1, 2)], dim=2)
        return window_keys, window_values
