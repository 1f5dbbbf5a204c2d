"""An associative memory for the causal layer (`config.associative_memory`): a matrix per head into which every
token binds its key to its value by the delta rule, and which it then reads with its query.

A cell is one vector per window: it can carry one salient thing, and memory review weighs whole cells, so "which
value went with this key" is lost once several bindings share a window (multi-query associative recall stays at
chance; docs/memory.md). This memory keeps bindings apart. Token t writes

    S <- S - beta_t k_t (k_t^T S) + beta_t k_t v_t^T          (S: head_dim x head_dim per head)

with k_t the token's unit-length window-attention key (before rotary), v_t its value and beta_t in (0, 1) a learned
write strength (a token that carries nothing worth keeping writes little), and reads q_t^T S with its unit-length
query, S as after its own write: the memory holds every token before it, its own window's included. (Read only from
earlier windows, it left the binding of facts within a window to the window attention, which at small sizes does not
learn it: benchmarks/memory_tasks/README.md.) With `associative_key_conv` = c, k_t is first mixed with the c - 1 keys
before it in its window by a per-channel causal convolution (the short convolution of Mamba and Gated DeltaNet), so
that a token can bind a value to what came a few tokens before it ("name MOVE place": the place under its name). It
starts as the identity. With `associative_decay`, a token also decays the state before it writes (Gated DeltaNet's
gate, Yang et al. 2025):

    S <- a_t (S - beta_t k_t (k_t^T S)) + beta_t k_t v_t^T

with a_t = exp(-softplus(.)) in (0, 1) learned per token and head, so that the memory can forget what no later key
will overwrite; the heads start at decay rates from 1e-4 to 1e-2 per token, some keeping a fact over tens of
thousands of tokens, some over hundreds. The state is the same size at any length, so the cache stays flat, and a
token's write depends only on its window and the state before it, so streaming equals one pass.

A forward writes a window's new tokens in the delta rule's chunked form (DeltaNet, Yang et al. 2024), 64 at a time: with
A = strictly-lower(diag(beta) K K^T), U = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta) K, the state after
the window is S' = S + K^T (U - W S) and token i reads q_i^T S + sum over j <= i of (q_i . k_j) (U - W S)_j, which
equals the token-by-token rule (`tests/test_associative_memory.py`); a decoding step writes its token by that rule.
With decays, g the running sum of the window's log a_t and gamma = exp(g): A's entry (i, j) is scaled by
gamma_i / gamma_j, W = (I + A)^-1 diag(beta gamma) K, S' = gamma_Q S + (diag(gamma_Q / gamma) K)^T (U - W S), and
the read's terms by gamma_i and gamma_i / gamma_j. Under `torch.export` (ONNX), which has no triangular solve and no
loop over a variable number of windows, the inverse is built from matmuls (`unit_lower_inverse`) and the windows are
written by one `scan` operator.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .building_blocks import unit_vectors
from .cache_ran import RANCacheLayer
from .configuration_ran import RANConfig
from .decode_step import StepPositions
from .window_layout import RANWindowLayout


# The slots one triangular solve writes: a window of Q slots costs Q^2 in its solve and products, so a longer window
# is written in chunks of this many, each from the state the chunk before left (exact: the rule is the same).
WRITE_CHUNK = 64


def without_autocast(device: torch.device):
    """The memory's maths outside autocast: its triangular solve has no half-precision kernel, and its state sums
    a whole document's writes."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def wide(tensor: torch.Tensor) -> torch.Tensor:
    """The memory computes in float32, or float64 where the model runs in it."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


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


def delta_write(state, keys, values, betas, log_decays=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after writing one window, and the slots' corrected values U - W S (B, H, Q, d), from which
    `read_after_writes` reads the state after each slot: state (B, H, d, d); keys and values (B, H, Q, d) (keys of
    unit length); betas (B, H, Q), 0 for a slot that writes nothing; log_decays (B, H, Q), each slot's log a_t (0 for
    a slot that writes nothing), or None: no decay."""
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
    corrected = write - erase @ state
    if log_decays is None:
        return state + keys.transpose(-1, -2) @ corrected, corrected
    to_end = (running[..., -1:] - running).exp()[..., None]  # gamma_Q / gamma_i
    return running[..., -1, None, None].exp() * state + (keys * to_end).transpose(-1, -2) @ corrected, corrected


def read_after_writes(queries, state, keys, corrected, log_decays=None) -> torch.Tensor:
    """What each slot's query (B, H, Q, d) reads from the state after the window's writes up to its own slot,
    S_i = gamma_i S + sum over j <= i of (gamma_i / gamma_j) k_j (U - W S)_j^T, without forming S_i: `state` is the
    state before the window, `keys`, `corrected` and `log_decays` as `delta_write` took and returned them."""
    scores = queries @ keys.transpose(-1, -2)  # (B, H, Q, Q)
    from_state = queries @ state
    if log_decays is not None:
        running = log_decays.cumsum(-1)
        scores = scores * torch.tril(running[..., :, None] - running[..., None, :]).exp()
        from_state = from_state * running.exp()[..., None]
    return from_state + torch.tril(scores) @ corrected


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
        self.key_conv_width = config.associative_key_conv or None  # 0: no convolution
        if self.key_conv_width is not None:  # (c, H, 1, d): tap j weighs the key j slots before
            self.key_conv = nn.Parameter(torch.zeros(config.associative_key_conv, self.num_heads, 1, self.head_dim))

    def written_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """(..., H, S, d) a window's slot keys -> the unit-length keys the memory writes, after the key convolution
        (causal within the window: a slot mixes itself and the slots before it)."""
        keys = wide(keys)
        if self.key_conv_width is not None:
            slots = keys.shape[-2]
            keys = sum(tap * F.pad(keys, (0, 0, lag, 0))[..., :slots, :] for lag, tap in enumerate(self.key_conv))
        return unit_vectors(keys)

    def write_gates(self, normed_tokens: torch.Tensor) -> torch.Tensor:
        """(..., D) normalised token states -> (..., H, G) their write strengths, in (0, 1), and with
        `associative_decay` their log decays (G = 2), <= 0."""
        strengths = self.write_strength(normed_tokens)  # (the type promotions inline: a step calls this per token)
        betas = torch.sigmoid(strengths.to(torch.promote_types(strengths.dtype, torch.float32)))
        if not self.decays:
            return betas[..., None]
        log_decays = -F.softplus(wide(self.decay(normed_tokens) + self.decay_bias))
        return torch.stack([betas, log_decays], dim=-1)

    def write_and_read(self, state, queries, keys, values, gates) -> tuple[torch.Tensor, torch.Tensor]:
        """One window per row: its slots write into `state` (B, H, d, d), in chunks of `WRITE_CHUNK` slots, and each
        slot's query reads the state after its own write. queries (unit length), keys (unit length) and values
        (B, H, Q, d); gates (B, H, Q, G) of `write_gates`, 0 for a slot that writes nothing. Returns the state after
        the window and the reads (B, H, Q, d)."""
        betas, log_decays = gates[..., 0], gates[..., 1] if self.decays else None
        reads = []
        for first in range(0, keys.shape[-2], WRITE_CHUNK):
            part = slice(first, first + WRITE_CHUNK)
            chunk_keys, chunk_decays = keys[..., part, :], None if log_decays is None else log_decays[..., part]
            after, corrected = delta_write(state, chunk_keys, values[..., part, :], betas[..., part], chunk_decays)
            reads.append(read_after_writes(queries[..., part, :], state, chunk_keys, corrected, chunk_decays))
            state = after
        return state, reads[0] if len(reads) == 1 else torch.cat(reads, dim=-2)

    def forward(self, query, key, value, normed_tokens, layout: RANWindowLayout | StepPositions, cache):
        """What every new token recalls from the memory after its own write, (T, H * d), given the layer's queries
        (K, H, Q, d), keys and values (K, H, S, d) of every window slot before rotary and its normalised tokens
        (T, D); the cache (None without one) keeps the memory after the last token read.

        A decoding step (`layout` is its `StepPositions`) hands each row's query (B, H, d), its window's slot keys
        (B, S, H, d) with the new token's in, the token's value (B, H, d) and normalised state (B, D): returns what
        the query recalls (B, H * d) (`step`)."""
        if type(layout) is StepPositions:
            return self.step(query, key, value, normed_tokens, cache, layout)
        # The tokens that write are the windows' query slots: new tokens, not the enrichment or cached tail that
        # earlier windows or calls wrote. Their keys are convolved with the slots before them, whoever wrote those.
        slots = layout.query_slots[:, None, :, None].expand(-1, self.num_heads, -1, self.head_dim)  # (K, H, Q, d)
        keys, values = self.written_keys(key).gather(2, slots), wide(value).gather(2, slots)
        gates = layout.gather_sources(self.write_gates(normed_tokens), layout.query_index)  # (K, Q, H, G); 0: none
        start = None if cache is None else cache.binding_state
        if start is None:
            start = wide(query.new_zeros(layout.batch_size, self.num_heads, self.head_dim, self.head_dim))
        with without_autocast(query.device):
            read, state = self.write_windows(query, keys, values, gates.transpose(1, 2), start, layout)
        if cache is not None:  # the state after each row's last window here, finished or not
            cache.binding_state = state
        return layout.from_windows(read.flatten(-2))

    def write_windows(self, query, keys, values, gates, start_state, layout: RANWindowLayout):
        """query (K, H, Q, d) before rotary; keys (unit length) and values (K, H, Q, d) the windows' new tokens
        write, gates (K, H, Q, G) theirs; start_state (B, H, d, d). Returns what the windows' queries read after
        their own writes (K, Q, H, d) and each row's state after its last window (B, H, d, d)."""
        dtype = query.dtype
        # Scan step j writes the window each sequence reads there; a sequence without one writes the empty row, which
        # leaves its state exactly as it was (no write, no decay): the state after the last step is every row's last.
        windows = (unit_vectors(wide(query)), keys, values, gates)
        padded = [F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, 1)) for tensor in windows]
        if torch.compiler.is_exporting():  # one `scan` operator: a loop would be unrolled for the example's windows
            from torch._higher_order_ops.scan import scan as scan_operator

            def write_window(state, step_windows):
                return self.write_and_read(state, *(tensor[step_windows] for tensor in padded))

            state, reads = scan_operator(write_window, wide(start_state), [layout.step_windows])
        else:
            state, reads = wide(start_state), []
            for step_windows in layout.step_windows:  # (B,) window index, or K for none
                state, read = self.write_and_read(state, *(tensor[step_windows] for tensor in padded))
                reads.append(read)
            reads = torch.stack(reads)  # (N, B, H, Q, d)
        read = layout.per_sequence(reads.flatten(2)).view(keys.shape)  # (K, H, Q, d)
        return (read * self.read_scale[:, None, None]).transpose(1, 2).to(dtype), state

    def step(self, query, keys, value, normed, cache: RANCacheLayer, at: StepPositions):
        """`forward`'s step branch: the new token writes its key and value by the token-by-token rule, then its query
        reads the state. The cache keeps the state."""
        dtype, computed = query.dtype, torch.promote_types(query.dtype, torch.float32)
        if self.key_conv_width is None:
            key = keys[at.rows, at.slot]  # (B, H, d)
        else:  # as `written_keys` convolves a window's: the slots before the token's (the lags `at` holds), weighed
            earlier = keys[at.rows[:, None], at.key_lag_slots] * at.key_lag_in_window  # (B, c, H, d)
            key = (earlier.to(computed) * self.key_conv[:, :, 0]).sum(1)
        query, key = unit_vectors(torch.stack([query.to(computed), key.to(computed)])).unbind(0)  # (B, H, d) each
        value = value.to(computed)
        gates = self.write_gates(normed)  # (B, H, G)
        state = cache.binding_state
        if self.decays:
            state = gates[..., 1, None, None].exp() * state
        # (products and sums, not matmuls, which autocast would run in half precision)
        recalled = (key[..., :, None] * state).sum(-2)  # what the key reads now: the delta rule replaces it
        state = torch.addcmul(state, (gates[..., 0, None] * key)[..., :, None], (value - recalled)[..., None, :])
        cache.binding_state = state
        read = (query[..., :, None] * state).sum(-2) * self.read_scale[:, None]  # (B, H, d)
        return read.flatten(1).to(dtype)
