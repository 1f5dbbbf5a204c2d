"""An associative memory for the causal layer (`config.associative_memory`): a matrix per head into which every
finished window binds its tokens' keys to their values by the delta rule, and which every later token reads with
its query.

A cell is one vector per window: it can carry one salient thing, and memory review weighs whole cells, so "which
value went with this key" is lost once several bindings share a window (multi-query associative recall stays at
chance; docs/memory.md). This memory keeps bindings apart. Window w writes, token after token,

    S <- S - beta_t k_t (k_t^T S) + beta_t k_t v_t^T          (S: head_dim x head_dim per head)

with k_t the token's unit-length window-attention key (before rotary), v_t its value and beta_t in (0, 1) a learned
write strength (a token that carries nothing worth keeping writes little). With `associative_key_conv` = c, k_t is
first mixed with the c - 1 keys before it in its window by a per-channel causal convolution (the short convolution
of Mamba and Gated DeltaNet), so that a token can bind a value to what came a few tokens before it ("name MOVE
place": the place under its name). It starts as the identity. A token of window w reads q^T S with
its unit-length query, S as after window w - 1: its own window it reads through the window attention. The state is
the same size at any length, so the cache stays flat, and a window's write depends only on its own tokens and the
state before it, so streaming equals one pass.

A window's tokens are written at once in the delta rule's chunked form (DeltaNet, Yang et al. 2024): with
A = strictly-lower(diag(beta) K K^T), U = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta) K,
S' = S + K^T (U - W S), which equals the token-by-token rule (`tests/test_associative_memory.py`). Under
`torch.export` (ONNX), which has no triangular solve and no loop over a variable number of windows, the inverse is
built from matmuls (`unit_lower_inverse`) and the windows are written by one `scan` operator.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .building_blocks import gather_rows, unit_vectors
from .cache_ran import RANCacheLayer
from .configuration_ran import RANConfig
from .decode_step import StepPositions, next_tail
from .window_layout import RANWindowLayout


def unit_lower_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """The inverse of unit lower-triangular matrices (..., Q, Q) in matmuls alone: the inverse of the block diagonal
    of blocks of b, X, gives that of blocks of 2 b as X - X E X, where E holds the matrix's entries below the smaller
    blocks inside the larger ones (exact, since E X E = 0): block forward substitution, log2(Q) steps."""
    rows = torch.arange(matrix.shape[-1], device=matrix.device)
    inverse = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device).expand_as(matrix)
    block = 1
    while block < matrix.shape[-1]:
        joined = (rows[:, None] // (2 * block) == rows // (2 * block)) & (rows[:, None] // block != rows // block)
        inverse = inverse - inverse @ (matrix * joined) @ inverse
        block *= 2
    return inverse


def delta_write(state: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, betas: torch.Tensor) -> torch.Tensor:
    """The state after writing one window: state (B, H, d, d); keys and values (B, H, Q, d) (keys of unit length);
    betas (B, H, Q), 0 for a slot that writes nothing."""
    scaled_keys, scaled_values = betas[..., None] * keys, betas[..., None] * values
    mixing = torch.tril(scaled_keys @ keys.transpose(-1, -2), diagonal=-1)  # (B, H, Q, Q)
    unit_lower = torch.eye(mixing.shape[-1], dtype=mixing.dtype, device=mixing.device) + mixing
    scaled = torch.cat([scaled_keys, scaled_values], dim=-1)
    if torch.compiler.is_exporting():
        solved = unit_lower_inverse(unit_lower) @ scaled
    else:
        solved = torch.linalg.solve_triangular(unit_lower, scaled, upper=False, unitriangular=True)
    erase, write = solved.split([keys.shape[-1], values.shape[-1]], dim=-1)  # W and U
    return state + keys.transpose(-1, -2) @ (write - erase @ state)


class RANAssociativeMemory(nn.Module):
    """The write strengths and read scale of a causal layer's associative memory; the keys, values and queries are
    the window attention's own (before rotary), so a cached tail already holds what an unfinished window writes."""

    def __init__(self, config: RANConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.write_strength = nn.Linear(config.hidden_size, config.num_attention_heads)  # beta_t = sigmoid(.)
        # What the memory adds to the window attention's output, per head: it starts at 1 (a read that is there to
        # be learned from), and training scales it.
        self.read_scale = nn.Parameter(torch.ones(config.num_attention_heads))
        if config.associative_key_conv is not None:  # (c, H, 1, d): tap j weighs the key j slots before
            self.key_conv = nn.Parameter(torch.zeros(config.associative_key_conv, self.num_heads, 1, self.head_dim))

    def written_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """(..., H, S, d) a window's slot keys -> the unit-length keys the memory writes, after the key convolution
        (causal within the window: a slot mixes itself and the slots before it)."""
        keys = keys.float()
        if hasattr(self, "key_conv"):
            slots = keys.shape[-2]
            keys = sum(tap * F.pad(keys, (0, 0, lag, 0))[..., :slots, :] for lag, tap in enumerate(self.key_conv))
        return unit_vectors(keys)

    def betas(self, normed_tokens: torch.Tensor) -> torch.Tensor:
        """(T, D) normalised token states -> (T, H) their write strengths, in (0, 1)."""
        return torch.sigmoid(self.write_strength(normed_tokens).float())

    def forward(self, query, key, value, normed_tokens, layout: RANWindowLayout | StepPositions, cache, overlap: int):
        """What every token recalls from the memory of the windows before its own, (T, H * d), given the layer's
        queries (K, H, Q, d), keys and values (K, H, S, d) before rotary and its normalised tokens (T, D); the cache
        (None without one) keeps the memory after the last finished window and the tail's write strengths.

        A decoding step (`layout` is its `StepPositions`) hands each row's query (B, H, d), its window's slots
        (B, S, H, d) with the new token's in, and the token's normalised state (B, D): returns what the query
        recalls (B, H * d), the window's own tokens written where it ends (`step`)."""
        if type(layout) is StepPositions:
            return self.step(query, key, value, normed_tokens, cache, layout, overlap)
        new_betas, tail_betas = self.betas(normed_tokens), None if cache is None else cache.tail_betas  # (T, H)
        betas = gather_rows(layout.sources(new_betas, tail_betas), layout.window_slots)  # (K, S, H)
        start = None if cache is None else cache.binding_state
        if start is None:
            start = query.new_zeros(layout.batch_size, self.num_heads, self.head_dim, self.head_dim, dtype=torch.float)
        read, states = self.write_windows(query, key, value, betas, start, layout, overlap)
        if cache is not None:
            tail_betas = layout.sources(new_betas, tail_betas)[layout.next_tail]
            cache.binding_state, cache.tail_betas = layout.after_last_finished(states, start), tail_betas
        return layout.from_windows(read.flatten(-2))

    def write_windows(self, query, key, value, betas, start_state, layout: RANWindowLayout, overlap: int):
        """query (K, H, Q, d), key and value (K, H, S, d) of every window slot, before rotary; betas (K, S, H);
        start_state (B, H, d, d). Returns what the windows' queries read (K, Q, H, d) and the state after each scan
        step (N, B, H, d, d)."""
        dtype = query.dtype
        keys = self.written_keys(key)
        writes = layout.own_slot_mask(overlap)[:, None, :] * betas.transpose(1, 2)  # (K, H, S): own tokens only
        # Scan step j writes the window each sequence reads there; a sequence without one reads the empty row.
        keys, values, writes = (
            F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, 1)) for tensor in (keys, value.float(), writes)
        )
        if torch.compiler.is_exporting():  # one `scan` operator: a loop would be unrolled for the example's windows
            from torch._higher_order_ops.scan import scan as scan_operator

            def write(state, windows):
                written = delta_write(state, keys[windows], values[windows], writes[windows])
                return written, written.clone()  # (the outputs may not alias the carried state)

            after = scan_operator(write, start_state.float(), [layout.step_windows])[1]
        else:
            state, after = start_state.float(), []
            for windows in layout.step_windows:  # (B,) window index, or K for none
                state = delta_write(state, keys[windows], values[windows], writes[windows])
                after.append(state)
            after = torch.stack(after)  # (N, B, H, d, d)
        before = torch.cat([start_state.float()[None], after[:-1]])
        read_state = layout.per_sequence(before.flatten(2)).view(-1, self.num_heads, self.head_dim, self.head_dim)
        queries = unit_vectors(query.float())  # (K, H, Q, d)
        read = (queries @ read_state) * self.read_scale[:, None, None]  # (K, H, Q, d)
        return read.transpose(1, 2).to(dtype), after

    def step(self, query, keys, values, normed, cache: RANCacheLayer, at: StepPositions, overlap: int):
        """`forward`'s step branch: the query reads the state after the windows before its own; where a row's window
        ends, its own tokens (not the `overlap` enrichment tokens a later window starts with) are written. The cache
        keeps the state and the tail's write strengths."""
        tail_betas, state = cache.tail_betas, cache.binding_state
        if tail_betas.shape[1] < keys.shape[1]:  # a forward's tail, as wide as its longest row: the step's slots
            tail_betas = F.pad(tail_betas, (0, 0, 0, keys.shape[1] - tail_betas.shape[1]))
        betas = tail_betas.index_put((at.rows, at.slot), self.betas(normed))  # (B, S, H)
        read = (unit_vectors(query.float())[:, :, None] @ state)[:, :, 0] * self.read_scale[:, None]  # (B, H, d)
        if at.scan_runs:
            first_own = torch.where(at.window > 0, overlap, 0)[:, None]  # (B, 1)
            own = at.visible & (torch.arange(at.visible.shape[1], device=state.device) >= first_own)  # (B, S)
            writes = (betas * own[..., None]).transpose(1, 2)  # (B, H, S)
            written = delta_write(
                state, self.written_keys(keys.transpose(1, 2)), values.float().transpose(1, 2), writes
            )
            state = torch.where(at.ends_window[:, None, None, None], written, state)
            betas = next_tail(betas[..., None], at)[..., 0]
        cache.binding_state, cache.tail_betas = state, betas
        return read.flatten(1).to(query.dtype)
