"""An associative memory for the causal layer (`config.associative_memory`): a matrix per head into which every
finished window binds its tokens' keys to their values by the delta rule, and which every later token reads with
its query.

A cell is one vector per window: it can carry one salient thing, and memory review weighs whole cells, so "which
value went with this key" is lost once several bindings share a window (multi-query associative recall stays at
chance; docs/memory.md). This memory keeps bindings apart. Window w writes, token after token,

    S <- S - beta_t k_t (k_t^T S) + beta_t k_t v_t^T          (S: head_dim x head_dim per head)

with k_t the token's unit-length window-attention key (before rotary), v_t its value and beta_t in (0, 1) a learned
write strength (a token that carries nothing worth keeping writes little). A token of window w reads q^T S with
its unit-length query, S as after window w - 1: its own window it reads through the window attention. The state is
the same size at any length, so the cache stays flat, and a window's write depends only on its own tokens and the
state before it, so streaming equals one pass.

A window's tokens are written at once in the delta rule's chunked form (DeltaNet, Yang et al. 2024): with
A = strictly-lower(diag(beta) K K^T), U = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta) K,
S' = S + K^T (U - W S), which equals the token-by-token rule (`tests/test_associative_memory.py`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from .building_blocks import gather_rows
from .cache_ran import RANCacheLayer
from .configuration_ran import RANConfig
from .window_layout import RANWindowLayout


def delta_write(state: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, betas: torch.Tensor) -> torch.Tensor:
    """The state after writing one window: state (B, H, d, d); keys and values (B, H, Q, d) (keys of unit length);
    betas (B, H, Q), 0 for a slot that writes nothing."""
    scaled_keys, scaled_values = betas[..., None] * keys, betas[..., None] * values
    mixing = torch.tril(scaled_keys @ keys.transpose(-1, -2), diagonal=-1)  # (B, H, Q, Q)
    identity = torch.eye(mixing.shape[-1], dtype=mixing.dtype, device=mixing.device)
    solved = torch.linalg.solve_triangular(
        identity + mixing, torch.cat([scaled_keys, scaled_values], dim=-1), upper=False, unitriangular=True
    )
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

    def betas(self, normed_tokens: torch.Tensor) -> torch.Tensor:
        """(T, D) normalised token states -> (T, H) their write strengths, in (0, 1)."""
        return torch.sigmoid(self.write_strength(normed_tokens).float())

    def forward(self, query, key, value, betas, start_state, layout: RANWindowLayout, overlap: int):
        """query (K, H, Q, d), key and value (K, H, S, d) of every window slot, before rotary; betas (K, S, H);
        start_state (B, H, d, d). Returns what the windows' queries read (K, Q, H, d), the state after each scan
        step (N, B, H, d, d), and the one before each (the same, shifted)."""
        dtype = query.dtype
        keys = F.normalize(key.float(), dim=-1)
        writes = layout.own_slot_mask(overlap)[:, None, :] * betas.transpose(1, 2)  # (K, H, S): own tokens only
        # Scan step j writes the window each sequence reads there; a sequence without one reads the empty row.
        keys, values, writes = (
            F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, 1)) for tensor in (keys, value.float(), writes)
        )
        state, after = start_state.float(), []
        for windows in layout.step_windows:  # (B,) window index, or K for none
            state = delta_write(state, keys[windows], values[windows], writes[windows])
            after.append(state)
        after = torch.stack(after)  # (N, B, H, d, d)
        before = torch.cat([start_state.float()[None], after[:-1]])
        read_state = layout.per_sequence(before.flatten(2)).view(-1, self.num_heads, self.head_dim, self.head_dim)
        queries = F.normalize(query.float(), dim=-1)  # (K, H, Q, d)
        read = (queries @ read_state) * self.read_scale[:, None, None]  # (K, H, Q, d)
        return read.transpose(1, 2).to(dtype), after

    def recall(self, query, key, value, normed_tokens, layout: RANWindowLayout, cache: RANCacheLayer | None, overlap):
        """(T, H * d): what every token reads from the memory of the windows before its own, given the layer's
        queries (K, H, Q, d), keys and values (K, H, S, d) before rotary and its normalised tokens (T, D); the cache
        keeps the memory after the last finished window and the tail's write strengths."""
        if torch.compiler.is_exporting():
            raise NotImplementedError(
                "`associative_memory` writes window after window in a Python loop, which an exported graph cannot "
                "hold for any number of windows: export a model without it."
            )
        new_betas, tail_betas = self.betas(normed_tokens), None if cache is None else cache.tail_betas  # (T, H)
        betas = gather_rows(layout.sources(new_betas, tail_betas), layout.window_slots)  # (K, S, H)
        start = None if cache is None else cache.binding_state
        if start is None:
            start = query.new_zeros(layout.batch_size, self.num_heads, self.head_dim, self.head_dim, dtype=torch.float)
        read, states = self(query, key, value, betas, start, layout, overlap)
        if cache is not None:
            tail_betas = layout.sources(new_betas, tail_betas)[layout.next_tail]
            cache.update_binding(layout.after_last_finished(states, start), tail_betas)
        return layout.from_windows(read.flatten(-2))
