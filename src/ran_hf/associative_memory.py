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
place": the place under its name). It starts as the identity. With `associative_decay`, a token also decays the
state before it writes (Gated DeltaNet's gate, Yang et al. 2025):

    S <- a_t (S - beta_t k_t (k_t^T S)) + beta_t k_t v_t^T

with a_t = exp(-softplus(.)) in (0, 1) learned per token and head, so that the memory can forget what no later key
will overwrite; the heads start at decay rates from 1e-4 to 1e-2 per token, some keeping a fact over tens of
thousands of tokens, some over hundreds. A token of window w reads q^T S with
its unit-length query, S as after window w - 1: its own window it reads through the window attention. The state is
the same size at any length, so the cache stays flat, and a window's write depends only on its own tokens and the
state before it, so streaming equals one pass.

A window's tokens are written at once in the delta rule's chunked form (DeltaNet, Yang et al. 2024): with
A = strictly-lower(diag(beta) K K^T), U = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta) K,
S' = S + K^T (U - W S), which equals the token-by-token rule (`tests/test_associative_memory.py`). With decays, g the
running sum of the window's log a_t and gamma = exp(g): A's entry (i, j) is scaled by gamma_i / gamma_j,
W = (I + A)^-1 diag(beta gamma) K, and S' = gamma_Q S + (diag(gamma_Q / gamma) K)^T (U - W S). Under
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


def delta_write(state, keys, values, betas, log_decays=None) -> torch.Tensor:
    """The state after writing one window: state (B, H, d, d); keys and values (B, H, Q, d) (keys of unit length);
    betas (B, H, Q), 0 for a slot that writes nothing; log_decays (B, H, Q), each slot's log a_t (0 for a slot that
    writes nothing), or None: no decay."""
    scaled_keys, scaled_values = betas[..., None] * keys, betas[..., None] * values
    mixing = scaled_keys @ keys.transpose(-1, -2)  # (B, H, Q, Q)
    if log_decays is not None:
        running = log_decays.cumsum(-1)  # g; below the diagonal g_i - g_j <= 0 (above it, 0: masked next)
        mixing = mixing * torch.tril(running[..., :, None] - running[..., None, :]).exp()
        scaled_keys = scaled_keys * running.exp()[..., None]
    mixing = torch.tril(mixing, diagonal=-1)
    unit_lower = torch.eye(mixing.shape[-1], dtype=mixing.dtype, device=mixing.device) + mixing
    scaled = torch.cat([scaled_keys, scaled_values], dim=-1)
    if torch.compiler.is_exporting():
        solved = unit_lower_inverse(unit_lower) @ scaled
    else:
        solved = torch.linalg.solve_triangular(unit_lower, scaled, upper=False, unitriangular=True)
    erase, write = solved.split([keys.shape[-1], values.shape[-1]], dim=-1)  # W and U
    if log_decays is None:
        return state + keys.transpose(-1, -2) @ (write - erase @ state)
    to_end = (running[..., -1:] - running).exp()[..., None]  # gamma_Q / gamma_i
    return running[..., -1, None, None].exp() * state + (keys * to_end).transpose(-1, -2) @ (write - erase @ state)


class RANAssociativeMemory(nn.Module):
    """The write strengths and read scale of a causal layer's associative memory; the keys, values and queries are
    the window attention's own (before rotary), so a cached tail already holds what an unfinished window writes."""

    def __init__(self, config: RANConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.write_strength = nn.Linear(config.hidden_size, config.num_attention_heads)  # beta_t = sigmoid(.)
        self.decays = config.associative_decay
        if self.decays:
            # log a_t = -softplus(decay(x) + decay_bias); the bias, the memory's own parameter, sets each head's rate
            # (`_init_weights`)
            self.decay = nn.Linear(config.hidden_size, config.num_attention_heads, bias=False)
            self.decay_bias = nn.Parameter(torch.zeros(config.num_attention_heads))
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

    def write_gates(self, normed_tokens: torch.Tensor) -> torch.Tensor:
        """(..., D) normalised token states -> (..., H, G) their write strengths, in (0, 1), and with
        `associative_decay` their log decays (G = 2), <= 0."""
        betas = torch.sigmoid(self.write_strength(normed_tokens).float())
        if not self.decays:
            return betas[..., None]
        log_decays = -F.softplus((self.decay(normed_tokens) + self.decay_bias).float())
        return torch.stack([betas, log_decays], dim=-1)

    def write(self, state, keys, values, gates) -> torch.Tensor:
        """`delta_write` with the write gates (B, H, Q, G) of `write_gates`, 0 for a slot that writes nothing."""
        return delta_write(state, keys, values, gates[..., 0], gates[..., 1] if self.decays else None)

    def forward(self, query, key, value, normed_tokens, layout: RANWindowLayout | StepPositions, cache, overlap: int):
        """What every token recalls from the memory of the windows before its own, (T, H * d), given the layer's
        queries (K, H, Q, d), keys and values (K, H, S, d) before rotary and its normalised tokens (T, D); the cache
        (None without one) keeps the memory after the last finished window and the tail's write strengths.

        A decoding step (`layout` is its `StepPositions`) hands each row's query (B, H, d), its window's slots
        (B, S, H, d) with the new token's in, and the token's normalised state (B, D): returns what the query
        recalls (B, H * d), the window's own tokens written where it ends (`step`)."""
        if type(layout) is StepPositions:
            return self.step(query, key, value, normed_tokens, cache, layout, overlap)
        new_gates, tail_gates = self.write_gates(normed_tokens), None if cache is None else cache.tail_gates
        gates = gather_rows(layout.sources(new_gates, tail_gates), layout.window_slots)  # (K, S, H, G)
        start = None if cache is None else cache.binding_state
        if start is None:
            start = query.new_zeros(layout.batch_size, self.num_heads, self.head_dim, self.head_dim, dtype=torch.float)
        read, states = self.write_windows(query, key, value, gates, start, layout, overlap)
        if cache is not None:
            tail_gates = layout.sources(new_gates, tail_gates)[layout.next_tail]
            cache.binding_state, cache.tail_gates = layout.after_last_finished(states, start), tail_gates
        return layout.from_windows(read.flatten(-2))

    def write_windows(self, query, key, value, gates, start_state, layout: RANWindowLayout, overlap: int):
        """query (K, H, Q, d), key and value (K, H, S, d) of every window slot, before rotary; gates (K, S, H, G);
        start_state (B, H, d, d). Returns what the windows' queries read (K, Q, H, d) and the state after each scan
        step (N, B, H, d, d)."""
        dtype = query.dtype
        keys = self.written_keys(key)
        # (K, H, S, G): own tokens only (the overlap's were written by the window before; a log decay of 0 keeps all)
        writes = layout.own_slot_mask(overlap)[:, None, :, None] * gates.transpose(1, 2)
        # Scan step j writes the window each sequence reads there; a sequence without one reads the empty row.
        keys, values, writes = (
            F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, 1)) for tensor in (keys, value.float(), writes)
        )
        if torch.compiler.is_exporting():  # one `scan` operator: a loop would be unrolled for the example's windows
            from torch._higher_order_ops.scan import scan as scan_operator

            def write_window(state, windows):
                written = self.write(state, keys[windows], values[windows], writes[windows])
                return written, written.clone()  # (the outputs may not alias the carried state)

            after = scan_operator(write_window, start_state.float(), [layout.step_windows])[1]
        else:
            state, after = start_state.float(), []
            for windows in layout.step_windows:  # (B,) window index, or K for none
                state = self.write(state, keys[windows], values[windows], writes[windows])
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
        keeps the state and the tail's write gates."""
        tail_gates, state = cache.tail_gates, cache.binding_state
        if tail_gates.shape[1] < keys.shape[1]:  # a forward's tail, as wide as its longest row: the step's slots
            tail_gates = F.pad(tail_gates, (0, 0, 0, 0, 0, keys.shape[1] - tail_gates.shape[1]))
        gates = tail_gates.index_put((at.rows, at.slot), self.write_gates(normed))  # (B, S, H, G)
        read = (unit_vectors(query.float())[:, :, None] @ state)[:, :, 0] * self.read_scale[:, None]  # (B, H, d)
        if at.scan_runs:
            first_own = torch.where(at.window > 0, overlap, 0)[:, None]  # (B, 1)
            own = at.visible & (torch.arange(at.visible.shape[1], device=state.device) >= first_own)  # (B, S)
            writes = (gates * own[..., None, None]).transpose(1, 2)  # (B, H, S, G)
            written = self.write(
                state, self.written_keys(keys.transpose(1, 2)), values.float().transpose(1, 2), writes
            )
            state = torch.where(at.ends_window[:, None, None, None], written, state)
            gates = next_tail(gates, at)
        cache.binding_state, cache.tail_gates = state, gates
        return read.flatten(1).to(query.dtype)
