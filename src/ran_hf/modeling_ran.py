"""PyTorch Recurrent Attention Network (RAN), Li et al., ACL 2023.

A RAN layer reads a sequence in windows. Each window attends over itself and a global perception cell; the cell
written by window i is read by window i + 1, and at the end every token reviews the cells of all windows. The layer
is computed in three phases (see `RANLayer.forward`): per-token projections for all windows at once, a small
sequential scan over the cells, and one batched attention call for the tokens of every window.

Shapes: B batch, L padded length, T real tokens in the batch, K windows in the batch, N windows of the longest
sequence, S slots of a window (enrichment tokens + the longest window), H heads, d head size, D hidden size.
"""

import dataclasses
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import ModelOutput, TransformersKwargs, auto_docstring, logging
from transformers.utils.generic import can_return_tuple

from .cache_ran import RANCache, RANCacheLayer, check_cache
from .cell_scan import ALL_SCAN_FUNCTIONS
from .building_blocks import (
    RANGatedLinearUnit,
    RANLayerNorm,
    apply_interleaved_rotary,
    gather_rows,
    rotary_rotations,
    standard_normalize,
    unit_vectors,
)
from .adaptive_softmax import RANAdaptiveEmbedding, RANAdaptiveSoftmax, RANOutputMapping, adaptive_lm_loss
from .configuration_ran import RANConfig
from .scan_dropout import drop

logger = logging.get_logger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------------------------


def count_windows(lengths: torch.Tensor, window: int, min_window: int) -> torch.Tensor:
    """Windows of sequences of `lengths` tokens: the full ones, plus the tail if it has at least `min_window` tokens
    or is all there is; a shorter tail joins the window before it."""
    full, tail = lengths // window, lengths % window
    return full + ((tail > 0) & ((tail >= min_window) | (full == 0))).long()


def group_starts(counts: torch.Tensor) -> torch.Tensor:
    """Where each group starts in a packed tensor that holds `counts[i]` entries of group i, one group after another."""
    return F.pad(torch.cumsum(counts, 0), (1, 0))[:-1]


def true_positions(flags: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` of the indices of the 1-D `flags`' True entries, in order, followed by those of its False
    entries: `flags.nonzero()` without the host synchronisation that finding the number of True entries costs."""
    true_rank = torch.cumsum(flags, 0) - 1
    false_rank = torch.cumsum(~flags, 0) - 1 + flags.sum()
    positions = torch.empty(flags.numel(), dtype=torch.long, device=flags.device)
    positions.scatter_(0, torch.where(flags, true_rank, false_rank), torch.arange(flags.numel(), device=flags.device))
    return positions[:count]


def prefix_slots(token_type_ids, token_index, window_slots, slot_mask, window_sequence, batch_size: int):
    """A prefix LM's windows: (K, S) which slots hold a source token (type 0), and (B,) how many of each sequence's
    windows hold one (its first windows: the source comes first)."""
    is_source = token_type_ids.flatten()[token_index] == 0  # (T,)
    slot_is_source = F.pad(is_source, (0, 1))[window_slots] & slot_mask  # the empty row is no source
    holds_source = slot_is_source.any(-1).long()  # (K,)
    source_windows = holds_source.new_zeros(batch_size).index_add_(0, window_sequence, holds_source)
    return slot_is_source, source_windows


@dataclass
class RANWindowLayout:
    """Where every real token sits in the windows of its sequence.

    The layout depends on each sequence's true length only, never on the padded length, so padding (left or right)
    cannot change what a sequence computes. Windows of W tokens start at the sequence's first real token; in the
    bidirectional encoder a final window shorter than `min_window_size` joins the one before it (a causal model
    cannot know where the text will end, so it never merges). With `window_overlap` m > 0 every window after the
    first is preceded by the last m tokens of the window before it (read, but not output).

    New real tokens live in a flat (T, ...) tensor, in batch order; windows are packed, K of them for the whole
    batch. When a causal model continues cached sequences (`past_lengths`), windows may also read cached tokens:
    the "tail" of each row (the tokens of its unfinished window, plus its enrichment tokens), P of them in all.
    Window slots index the concatenation [new tokens (T); cached tail tokens (P); an empty row].

    Example (`RANWindowLayout.from_attention_mask`): two right-padded sequences of 5 and 11 tokens, window 4,
    minimum window 2, no overlap. Sequence 0's tail of one token joins its first window; sequence 1 keeps its tail
    of three. Tokens are numbered in the flat (T = 16) order, the empty row is 16:

        num_windows    [1, 3]             window_sequence [0, 1, 1, 1]    window_number [0, 0, 1, 2]
        window_slots   [[ 0,  1,  2,  3,  4],      slot_mask  [[1, 1, 1, 1, 1],
                        [ 5,  6,  7,  8, 16],                  [1, 1, 1, 1, 0],
                        [ 9, 10, 11, 12, 16],                  [1, 1, 1, 1, 0],
                        [13, 14, 15, 16, 16]]                  [1, 1, 1, 0, 0]]
        query_index    the same as window_slots (every own token is new, and slot s holds query s)
        query_slots    [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 3, 0], [0, 1, 2, 0, 0]]   (Q = 5; 0 where none)
        output_slot    [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 15, 16, 17]   (token t's query, k * Q + q)
        step_windows   [[0, 1], [4, 2], [4, 3]]   (scan step j: the window each sequence reads; 4 = none)
        token_window   [[0, 0, 0, 0, 0, 0, ...], [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]
    """

    lengths: torch.Tensor  # (B,) new real tokens per sequence
    num_windows: torch.Tensor  # (B,) windows holding new tokens, 0 for an all-padding row
    first_window: torch.Tensor  # (B,) number of the first such window in the whole sequence (> 0 when continuing)
    token_index: torch.Tensor  # (T,) position of each new token in the flattened (B * L) padded input
    window_slots: torch.Tensor  # (K, S) index of each slot's token in [new; cached tail; empty]
    slot_mask: torch.Tensor  # (K, S) the slot holds a token
    query_slots: torch.Tensor  # (K, Q) slots whose tokens need an output (new, not enrichment), left-aligned
    query_index: torch.Tensor  # (K, Q) index of those tokens in [new; empty]
    output_slot: torch.Tensor  # (T,) query (k * Q + q) whose output is the token's state
    window_sequence: torch.Tensor  # (K,) sequence of each window
    window_number: torch.Tensor  # (K,) index of each window among its sequence's windows in this pass
    step_windows: torch.Tensor  # (N, B) window index k read at scan step j by sequence b; K when it has none
    token_window: torch.Tensor  # (B, L) number of each new token's window in the whole sequence (0 for padding)
    finished_windows: torch.Tensor  # (B,) windows of the whole sequence complete after this pass (causal)
    real_tokens: torch.Tensor | None  # (T, 1) 0 for the padding entries of an exported layout; None: all are real
    cached_tail: torch.Tensor | None  # (P,) entries of the (B * P_max) cached tail read again; None without a cache
    next_tail: torch.Tensor | None  # (B, P_max') index in [new; cached tail; empty] of the tail to cache next
    continued_rows: int  # sequences whose first window here continues a cached one (its cell has a residual)
    cached_tail_width: int  # P_max: the longest cached tail
    cell_capacity: int  # windows of the longest sequence after this pass: the cells memory review may read
    most_finished_windows: int  # the most windows any sequence has finished after this pass
    batch_size: int
    padded_length: int
    _rotary: torch.Tensor | None = None
    slot_is_source: torch.Tensor | None = None  # (K, S) prefix LM (token_type_ids): the slot holds a source token
    source_windows: torch.Tensor | None = None  # (B,) prefix LM: windows that hold a source token, the first ones

    @property
    def num_steps(self) -> int:
        return self.step_windows.shape[0]

    @property
    def num_slots(self) -> int:
        return self.window_slots.shape[1]

    @classmethod
    def from_attention_mask(
        cls,
        attention_mask: torch.Tensor,
        config: RANConfig,
        past_lengths: torch.Tensor | None = None,
        input_checks: "InputChecks | None" = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> "RANWindowLayout":
        """Build the layout in five steps: count windows, pack them, place slots, pick queries, keep the cache tail.

        Every size that shapes a tensor is read to the host in one synchronisation (step 1); nothing else waits on
        the device.
        """
        window, overlap = config.window_size, config.window_overlap
        # A prefix LM (`token_type_ids`) never merges a short tail either: whether it would depends on the target's
        # length, which a target token may not read.
        min_window = 1 if config.is_causal or token_type_ids is not None else config.min_window_size
        own_slots = window + min_window - 1  # the longest window: a full one plus a tail too short to stand alone
        batch_size, padded_length = attention_mask.shape
        device = attention_mask.device
        real = attention_mask.bool()
        lengths = real.sum(-1)  # (B,)
        past = torch.zeros_like(lengths) if past_lengths is None else past_lengths.to(device)

        # 1. Count windows per sequence, and the cached tokens a continuation reads again.
        total = past + lengths  # (B,) sequence length after this pass
        total_windows = count_windows(total, window, min_window)
        first_window = past // window  # windows finished before this pass
        num_windows = torch.where(lengths > 0, total_windows - first_window, 0)  # (B,)
        tail_lengths = torch.minimum(past, past % window + overlap)  # (B,) cached tokens read again
        next_tail_lengths = torch.minimum(total, total % window + overlap)  # (B,) tokens to cache for the next pass
        finished_windows = total // window
        bounded = torch.compiler.is_exporting()
        if bounded:
            # Sizes from the input's shape alone, so that they stay symbolic: every position is a token (padding
            # ones after the real ones, and zeroed on the way out) and every sequence has room for the most windows,
            # plus one that stays empty: a symbolic number of steps that may be 1 would be specialised on. (No
            # negative floor division: ONNX's integer division truncates.)
            num_steps = (padded_length - 1) // window + 2
            num_tokens, num_tail, num_packed, longest = batch_size * padded_length, 0, batch_size * num_steps, None
            longest_tail = longest_next_tail = continued_rows = 0
            cell_capacity = most_finished_windows = num_steps
        else:
            sizes = [lengths.sum(), tail_lengths.sum(), num_windows.sum(), num_windows.max(), lengths.max()]
            sizes += [tail_lengths.max(), next_tail_lengths.max(), (first_window > 0).sum()]
            sizes += [(first_window + num_windows).max(), finished_windows.max()]
            if input_checks is not None:  # the forward's input checks, read in the same synchronisation
                sizes += input_checks.values.to(device).unbind()
            found = torch.stack(sizes).tolist()
            (num_tokens, num_tail, num_packed, num_steps, longest, longest_tail, longest_next_tail, continued_rows,
             cell_capacity, most_finished_windows) = found[:10]  # fmt: skip
            if input_checks is not None:
                input_checks.judge(found[10:])
        token_index = true_positions(real.flatten(), num_tokens)  # (T,)
        empty = num_tokens + num_tail
        new_start, tail_start = group_starts(lengths), num_tokens + group_starts(tail_lengths)  # (B,) each

        def source_index(rows, position):
            """Index in [new; cached tail] of the token at sequence `position` of row `rows`."""
            from_new = new_start[rows] + position - past[rows]
            from_tail = tail_start[rows] + position - (past[rows] - tail_lengths[rows])
            return torch.where(position >= past[rows], from_new, from_tail)

        # 2. Pack the windows of all sequences, in batch order; the scan reads them step-major.
        packed = torch.arange(num_packed, device=device)
        if bounded:  # room for `num_steps` windows per sequence; the ones it does not have stay empty
            grid = torch.zeros(batch_size, num_steps, dtype=torch.long, device=device)
            window_sequence = (grid + torch.arange(batch_size, device=device)[:, None]).flatten()  # (K,)
            window_number = (grid + torch.arange(num_steps, device=device)).flatten()  # (K,)
            has_window = window_number < num_windows[window_sequence]
            steps = torch.arange(num_steps, device=device)[:, None]  # (N, 1)
            step_windows = torch.where(  # built step-major, not transposed: its strides would depend on N
                steps < num_windows, torch.arange(batch_size, device=device) * num_steps + steps, num_packed
            )  # (N, B)
        else:
            window_sequence = torch.repeat_interleave(
                torch.arange(batch_size, device=device), num_windows, output_size=num_packed
            )  # (K,)
            window_number = packed - group_starts(num_windows)[window_sequence]  # (K,)
            step_windows = torch.full((num_steps, batch_size), num_packed, dtype=torch.long, device=device)
            step_windows[window_number, window_sequence] = packed

        # 3. Place every window's tokens in its slots: enrichment first, then its own tokens.
        absolute_window = first_window[window_sequence] + window_number  # (K,)
        start = absolute_window * window  # (K,) first own token in the sequence
        is_last = window_number == num_windows[window_sequence] - 1
        end = torch.where(is_last, total[window_sequence], start + window)  # (K,)
        first_slot = start - torch.where(absolute_window > 0, overlap, 0)  # (K,) sequence position of slot 0
        position = first_slot[:, None] + torch.arange(overlap + own_slots, device=device)  # (K, S)
        slot_mask = position < end[:, None]
        if bounded:
            end = torch.where(has_window, end, start)  # an empty window has no queries ...
            slot_mask = slot_mask & has_window[:, None]  # ... and no slots
        rows = window_sequence[:, None].expand_as(position)
        window_slots = torch.where(slot_mask, source_index(rows, position), empty)

        # 4. Pick the queries: only new own tokens need an output (a decoding step asks one per window, not S).
        # New tokens come in the same order as the windows' queries, so query q of window k is simply the next one.
        first_query = torch.maximum(start, past[window_sequence])  # (K,) sequence position of the first query
        offset = torch.arange(own_slots if bounded else min(longest, own_slots), device=device)  # (Q,)
        is_query = offset < (end - first_query)[:, None]  # (K, Q)
        query_slots = torch.where(is_query, (first_query - first_slot)[:, None] + offset, 0)
        query_index = torch.where(is_query, torch.cumsum(is_query.flatten(), 0).view_as(is_query) - 1, num_tokens)
        output_slot = true_positions(is_query.flatten(), num_tokens)  # (T,)
        token_position = past[:, None] + torch.cumsum(real, -1) - 1  # (B, L) sequence position of each new token
        token_window = torch.minimum(token_position // window, (total_windows - 1)[:, None]) * real

        # 5. Keep the cache tail: which cached tokens this pass reads, and which tokens the next pass reads.
        cached_tail = next_tail = None
        if past_lengths is not None:
            is_read = torch.arange(longest_tail, device=device) < tail_lengths[:, None]  # (B, P_max)
            cached_tail = true_positions(is_read.flatten(), num_tail)  # (P,)
            offset = torch.arange(longest_next_tail, device=device)  # (P',)
            next_position = (total - next_tail_lengths)[:, None] + offset  # (B, P')
            rows = torch.arange(batch_size, device=device)[:, None].expand_as(next_position)
            next_tail = torch.where(offset < next_tail_lengths[:, None], source_index(rows, next_position), empty)
        slot_is_source = source_windows = None
        if token_type_ids is not None:  # without a cache: every slot indexes a new token or the empty row
            slot_is_source, source_windows = prefix_slots(
                token_type_ids, token_index, window_slots, slot_mask, window_sequence, batch_size
            )

        return cls(
            lengths=lengths,
            num_windows=num_windows,
            first_window=first_window,
            token_index=token_index,
            window_slots=window_slots,
            slot_mask=slot_mask,
            query_slots=query_slots,
            query_index=query_index,
            output_slot=output_slot,
            window_sequence=window_sequence,
            window_number=window_number,
            step_windows=step_windows,
            token_window=token_window,
            finished_windows=finished_windows,
            real_tokens=(torch.arange(num_tokens, device=device) < lengths.sum())[:, None] if bounded else None,
            cached_tail=cached_tail,
            next_tail=next_tail,
            continued_rows=continued_rows,
            cached_tail_width=longest_tail,
            cell_capacity=cell_capacity,
            most_finished_windows=most_finished_windows,
            batch_size=batch_size,
            padded_length=padded_length,
            slot_is_source=slot_is_source,
            source_windows=source_windows,
        )

    def for_cell_scan(self) -> "RANWindowLayout":
        """The layout the cell scan reads. A prefix LM's cell sits in the source, so it reads the source slots only:
        given as the slot mask, which every scan implementation takes."""
        if self.slot_is_source is None:
            return self
        return dataclasses.replace(self, slot_mask=self.slot_is_source)

    def sources(self, token_states: torch.Tensor, tail_states: torch.Tensor | None = None) -> torch.Tensor:
        """[new tokens; cached tail; an empty row]: what window slots and the next tail index into."""
        parts = [token_states]
        if tail_states is not None:
            # A cache whose rows were reselected (beam search) may be wider than its longest tail now.
            parts.append(tail_states[:, : self.cached_tail_width].flatten(0, 1)[self.cached_tail])
        parts.append(token_states.new_zeros(1, *token_states.shape[1:]))
        return torch.cat(parts)

    def rotary(self, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
        """Rotations (S, d / 2, 2) of window slots (slot s is position s + 1; the cell sits at 0), built once a pass."""
        if self._rotary is None:
            self._rotary = rotary_rotations(self.num_slots + 1, head_dim, theta, device)[1:]
        return self._rotary

    def from_windows(self, query_states: torch.Tensor) -> torch.Tensor:
        """(K, Q, F) outputs of the query slots -> (T, F): each new token's state."""
        return gather_rows(query_states.flatten(0, 1), self.output_slot)

    def to_padded(self, token_states: torch.Tensor) -> torch.Tensor:
        """(T, F) flat token features -> (B, L, F), zeros at padding."""
        if self.real_tokens is not None:
            token_states = token_states * self.real_tokens
        padded = token_states.new_zeros(self.batch_size * self.padded_length, token_states.shape[-1])
        padded[self.token_index] = token_states
        return padded.view(self.batch_size, self.padded_length, -1)

    def from_padded(self, padded_states: torch.Tensor) -> torch.Tensor:
        """(B, L, F) -> (T, F): the real tokens only."""
        return gather_rows(padded_states.flatten(0, 1), self.token_index)

    def to_windows(self, token_states: torch.Tensor) -> torch.Tensor:
        """(T, F) -> (K, Q, F): the inverse of `from_windows`, zeros at unused query slots."""
        num_windows, num_queries = self.query_slots.shape
        windows = token_states.new_zeros(num_windows * num_queries, token_states.shape[-1])
        windows[self.output_slot] = token_states
        return windows.view(num_windows, num_queries, -1)

    def weights_per_token(self, weights: torch.Tensor) -> torch.Tensor:
        """(K, H, Q, X) attention weights of the windows' queries -> (B, H, L, X) those of each token, zeros at padding."""
        num_heads, num_keys = weights.shape[1], weights.shape[-1]
        per_token = self.from_windows(weights.transpose(1, 2).flatten(-2))  # (T, H * X)
        return self.to_padded(per_token).unflatten(-1, (num_heads, num_keys)).transpose(1, 2)

    def weights_per_window(self, token_weights: torch.Tensor) -> torch.Tensor:
        """(B, H, L, X) -> (K, H, Q, X): the inverse of `weights_per_token`."""
        num_heads, num_keys = token_weights.shape[1], token_weights.shape[-1]
        per_token = self.from_padded(token_weights.transpose(1, 2).flatten(-2))  # (T, H * X)
        return self.to_windows(per_token).unflatten(-1, (num_heads, num_keys)).transpose(1, 2)

    def per_sequence(self, step_states: torch.Tensor) -> torch.Tensor:
        """(N, B, F) per-step states -> (K, F) the state of every packed window."""
        return gather_rows(step_states.flatten(0, 1), self.window_number * self.batch_size + self.window_sequence)


# --------------------------------------------------------------------------------------------------------------------
# The RAN layer
# --------------------------------------------------------------------------------------------------------------------


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


def salient_cells(salience, windows, reading_windows, recent: int, kept: int) -> torch.Tensor:
    """Which cells each reading window keeps beyond its recent ones (`memory_salient_cells`): (B, R, C) booleans.

    salience (B, C) the cells' learned prior; windows (B, C) the window each cell was written by (-1: an empty slot);
    reading_windows (B, R). Window w keeps, among the cells of windows before `w - recent`, the `kept` most salient.
    Ties go to the older window: a total order, so that a cache holding only the past's salient cells keeps exactly
    what one forward pass over the whole text does.
    """
    by_window = windows.argsort(dim=-1, stable=True)
    order = by_window.gather(-1, salience.gather(-1, by_window).argsort(dim=-1, descending=True, stable=True))
    ordered_windows = windows.gather(-1, order)[:, None, :]  # (B, 1, C), most salient first
    older = (ordered_windows >= 0) & (ordered_windows < reading_windows[..., None] - recent)  # (B, R, C)
    keep = older & (older.cumsum(-1) <= kept)
    return torch.zeros_like(keep).scatter(-1, order[:, None, :].expand_as(keep), keep)


class RANMemoryReview(nn.Module):
    """Single-head attention of every token over the cells of its sequence's windows, with a gated residual.

    Official layer: LayerNorm(review + GLU(query)). With `config.residual_stream`, the norm comes first and the
    token states pass through: states + review + GLU(query), queries read from LayerNorm(states). With
    `config.review_qk_norm`, a cell's score is the scaled cosine of the un-activated query and key projections;
    without `config.memory_value_activation`, values and output projection are not activated.

    Tokens are reviewed in chunks: their scores over the cells form a (tokens x windows) matrix, which for a whole
    long document would grow with the square of its length.
    """

    # The most scores one chunk holds (batch x tokens x cells): 2^18, 1 MiB in float32. A chunk's working set then
    # stays the same however many cells a document or a carried stream has accumulated: 1,024 tokens of one
    # sequence against 256 cells, 67 against the 3,907 cells of a million-token document (windows of 256). With
    # 2^20, stream training's peak grew by 6% until the stream held 256 cells (benchmark_memory.py). A class
    # constant, not a config field: it trades speed for memory and never changes the outputs (beyond float
    # rounding), so checkpoints need not carry it.
    max_chunk_scores = 2**18
    # On CUDA: a chunk's float32 scores take at most 1/64 of the device's memory (1.25 GB, 312M scores on an 80 GB
    # card: 2 x 32K tokens against their 128 cells are one chunk); the softmax keeps a few such tensors at once.
    device_memory_share = 64

    def __init__(self, config: RANConfig):
        super().__init__()
        hidden_size = config.hidden_size
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.kv_proj = nn.Linear(hidden_size, 2 * hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        self.glu = RANGatedLinearUnit(hidden_size)
        self.norm = RANLayerNorm(hidden_size, config.layer_norm_eps)
        self.act = ACT2FN[config.hidden_act]
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.attention_dropout = config.attention_probs_dropout_prob
        self.residual_stream = config.uses_residual_stream
        self.qk_norm = config.uses_review_qk_norm
        self.value_act = self.act if config.uses_memory_value_activation else nn.Identity()
        self.reads_initial_cell = config.uses_review_initial_cell  # cell 0 is the starting cell, always in reach
        if config.uses_review_salience:  # a learned prior of every cell, `salience . key`; zero at initialisation
            self.salience = nn.Parameter(torch.zeros(hidden_size))
        # Cosine scores times sqrt(D) have the spread of ordinary attention scores at initialisation.
        self.scale = math.sqrt(hidden_size) if self.qk_norm else 1 / math.sqrt(hidden_size)

    def chunk_length(self, batch_size: int, num_cells: int, device: torch.device | None = None) -> int:
        """Tokens per chunk, so that a chunk holds at most `max_chunk_scores` scores; on a CUDA device at most
        1/`device_memory_share` of its memory in float32 scores (one chunk for every document that fits: each chunk
        is a few dozen kernel launches, and a GPU's memory is there to be used)."""
        budget = self.max_chunk_scores
        if device is not None and device.type == "cuda":
            memory = torch.cuda.get_device_properties(device).total_memory  # cached: no synchronisation
            budget = max(budget, memory // (4 * self.device_memory_share))
        return max(1, budget // max(1, batch_size * num_cells))

    def project_cells(self, cells: torch.Tensor) -> torch.Tensor:
        """(..., D) cells -> (..., 2 D) their keys and values; a cache keeps these, not the cells."""
        key, value = self.kv_proj(cells).chunk(2, dim=-1)
        key = unit_vectors(key) if self.qk_norm else self.act(key)
        return torch.cat([key, self.value_act(value)], dim=-1)

    def cell_salience(self, cell_states: torch.Tensor) -> torch.Tensor:
        """(..., 2 D) cell keys and values from `project_cells` -> (...) their learned prior, what every token's score
        of the cell includes (`config.review_salience`). In float32 even under autocast: its gradient sums over every
        token and cell, and cancels; in bfloat16 it was 1.9% off (the rest of the model: at most 1.2%)."""
        key = cell_states[..., : cell_states.shape[-1] // 2]
        with nullcontext() if key.is_meta else torch.autocast(key.device.type, enabled=False):
            return key.float() @ self.salience.float()

    def forward(
        self,
        token_states: torch.Tensor,
        cell_states: torch.Tensor,
        readable_cells: torch.Tensor,
        output_attentions: bool = False,
        first_readable: torch.Tensor | None = None,
        salient: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # token_states (B, L, D); cell_states (B, C, 2 D) from `project_cells`; readable_cells (B, L): each token
        # reads cells [0, readable_cells), or [first_readable, readable_cells) with a bounded memory
        # (`memory_review_cells`; the starting cell stays in reach). `salient`, with `memory_salient_cells`: a
        # (B, R, C) table of the further cells each of R reading windows may read, and (B, L) each token's row of
        # it. Returns the reviewed states (B, L, D) and, with `output_attentions`, the review weights (B, L, C),
        # which then exist whole.
        batch_size, length = token_states.shape[:2]
        # Compiled: one chunk, so that a new length or number of cells needs no new graph (memory O(tokens x cells)).
        num_cells = cell_states.shape[1]
        chunk_size = (
            length
            if torch.compiler.is_compiling()
            else self.chunk_length(batch_size, num_cells, token_states.device)
        )
        salient_table, salient_rows = (None, None) if salient is None else salient
        if length <= chunk_size:
            reviewed, weights = self.review_chunk(
                token_states, cell_states, readable_cells, first_readable, salient_table, salient_rows
            )
            return reviewed, weights if output_attentions else None
        # With several chunks, each one's backward recomputes it (same dropout mask: checkpoint restores the RNG
        # state) so that training keeps (chunk x windows) probabilities for one chunk at a time, not for them all.
        # The tokens are split, not sliced: the backward of a split is one concatenation, where each slice's would
        # write a full-size zero gradient.
        recompute = torch.is_grad_enabled()
        num_chunks = -(-length // chunk_size)

        def split(tensor):
            return [None] * num_chunks if tensor is None else tensor.split(chunk_size, dim=1)

        reviewed, weights = [], []
        per_chunk = zip(*(split(tensor) for tensor in (token_states, readable_cells, first_readable, salient_rows)))
        for tokens, readable, first, rows in per_chunk:
            inputs = (tokens, cell_states, readable, first, salient_table, rows)
            if recompute:
                states, probs = checkpoint(self.review_chunk, *inputs, use_reentrant=False)
            else:
                states, probs = self.review_chunk(*inputs)
            reviewed.append(states)
            if output_attentions:  # kept only when asked for: all chunks' weights together are (tokens x cells)
                weights.append(probs)
        weights = torch.cat(weights, dim=1) if output_attentions else None
        return torch.cat(reviewed, dim=1), weights

    def review_chunk(self, token_states, cell_states, *readable) -> torch.Tensor:
        if self.residual_stream:
            review, probs = self.review(self.norm(token_states), cell_states, *readable)
            return token_states + review, probs
        review, probs = self.review(token_states, cell_states, *readable)
        return self.norm(review), probs

    def review(
        self, token_states, cell_states, readable_cells, first_readable=None, salient_table=None, salient_rows=None
    ):
        projected = self.q_proj(token_states)  # (B, l, D)
        query = self.act(projected)
        key, value = cell_states.chunk(2, dim=-1)  # (B, C, D) each
        # Few keys (one per window) and many queries: plain matmuls beat fused attention kernels here, whose
        # CPU backward is tuned for long key sequences.
        scoring_query = unit_vectors(projected) if self.qk_norm else query
        scores = (scoring_query @ key.transpose(1, 2)) * self.scale  # (B, l, C)
        if hasattr(self, "salience"):
            scores = scores + self.cell_salience(cell_states)[:, None, :]  # float32 from here on
        # A token that may read no cell (a causal first window, an all-padding row) gets no review; its row is
        # unmasked only to keep the softmax finite, then zeroed.
        readable = readable_cells[..., None] > 0  # (B, l, 1)
        limit = torch.where(readable, readable_cells[..., None], key.shape[1])  # (B, l, 1)
        cell_index = torch.arange(key.shape[1], device=key.device)
        hidden = cell_index >= limit  # (B, l, C): cells the token may not read
        if first_readable is not None:  # a bounded memory: older cells are out of reach
            hidden = hidden | ((cell_index < first_readable[..., None]) & (cell_index >= int(self.reads_initial_cell)))
        if salient_table is not None:  # ... but the salient ones among them are kept
            index = salient_rows[..., None].expand(-1, -1, salient_table.shape[-1])
            hidden = hidden & ~salient_table.gather(1, index)
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) * readable
        review = F.dropout(probs, self.attention_dropout, self.training).to(value.dtype) @ value  # (B, l, D)
        review = self.dropout(self.value_act(self.o_proj(review)))
        return review + self.glu(query), probs


def scan_function(name: str):
    """The cell scan registered under `name` in `ALL_SCAN_FUNCTIONS`."""
    if name not in ALL_SCAN_FUNCTIONS:
        raise ValueError(
            f"`config.scan_implementation` is {name!r}, which is not a registered cell scan; registered: "
            f"{sorted(ALL_SCAN_FUNCTIONS)}. Add one with `ran_hf.cell_scan.RANScanInterface.register(name, function)`."
        )
    return ALL_SCAN_FUNCTIONS[name]


class RANLayer(GradientCheckpointingLayer):
    """One RAN layer over all windows of a batch (bidirectional, or causal when `config.is_causal`)."""

    def __init__(self, config: RANConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.residual_stream, self.cell_input_residual = config.uses_residual_stream, config.uses_cell_input_residual
        hidden_size, inner_size, eps = (
            config.hidden_size,
            config.num_attention_heads * config.head_dim,
            config.layer_norm_eps,
        )

        # A starting cell where one is read: the encoder's first layer (later layers continue from the cell of the
        # layer below), and every layer of a causal model (the cell below has read the future). No parameter
        # exists that gets no gradient, so distributed training needs no unused-parameter search for it.
        if config.is_causal or layer_idx == 0:
            self.initial_cell = nn.Parameter(torch.zeros(hidden_size))
        self.input_norm = RANLayerNorm(hidden_size, eps)
        self.qkv_proj = nn.Linear(hidden_size, 3 * inner_size)
        self.o_proj = nn.Linear(inner_size, hidden_size)
        self.attention_glu = RANGatedLinearUnit(hidden_size)
        if not self.residual_stream or self.cell_input_residual:
            self.attention_norm = RANLayerNorm(hidden_size, eps)
        if config.use_cell_residual:
            self.cell_glu = RANGatedLinearUnit(hidden_size)
            self.cell_norm = RANLayerNorm(hidden_size, eps)
        if config.memory_review:
            self.memory_review = RANMemoryReview(config)
        elif not self.residual_stream:
            self.output_norm = RANLayerNorm(hidden_size, eps)

        self.act = ACT2FN[config.hidden_act]
        self.qk_activation = config.uses_attention_qk_activation
        self.written_act = self.act if config.uses_memory_value_activation else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.attention_dropout = config.attention_probs_dropout_prob
        self.is_causal = False  # read by attention functions: causality is in the window mask, not their flag

    # ---- shared per-position maths -------------------------------------------------------------------------------

    def normalize_input(self, states: torch.Tensor) -> torch.Tensor:
        """Concat-LayerNorm of tokens and cells alike; the result feeds both the projections and the residual GLU."""
        return self.dropout(self.input_norm(states))

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., 3, H, d) queries, keys and values; the values activated, and the queries and keys with
        `config.attention_qk_activation`."""
        qkv = self.qkv_proj(normed).unflatten(-1, (3, self.num_heads, self.head_dim))
        if self.qk_activation:
            return self.act(qkv)
        query_key, value = qkv.split([2, 1], dim=-3)
        return torch.cat([query_key, self.act(value)], dim=-3)

    def attention_output(self, attended: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """Output projection plus the gated residual of the attention's normalised input: (..., H * d) -> (..., D)."""
        return self.dropout(self.act(self.o_proj(attended))) + self.attention_glu(normed)

    def finish_attention(self, attended: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The official post-norm ending: attention output, then the two normalisations -> standardised (..., D)."""
        output = self.attention_norm(self.attention_output(attended, normed))
        return self.dropout(standard_normalize(output, self.config.layer_norm_eps))

    def write_cell(self, attended: torch.Tensor, normed_cell: torch.Tensor, output_mask=None, written_mask=None):
        """The raw cell ĉ of a window, (B, H * d) -> standardised (B, D); the masks are the scan's dropout
        (scan_dropout.py), None where nothing is dropped.

        Without `cell_input_residual` the cell is what its attention read from the window: the gated residual of
        the cell's own input would add a term that is the same for every text in the first window and drowns it.
        With it (and the official activation of what the cell writes), this is `finish_attention` for the cell.
        """
        written = drop(self.written_act(self.o_proj(attended)), output_mask)
        if self.cell_input_residual:
            written = self.attention_norm(written + self.attention_glu(normed_cell))
        return drop(standard_normalize(written, self.config.layer_norm_eps), written_mask)

    # ---- phase 1 ---------------------------------------------------------------------------------------------------

    def project_windows(self, normed_tokens: torch.Tensor, layout: RANWindowLayout, cache: RANCacheLayer | None):
        """Queries, keys and values of every token in every window slot, rotary applied (slot s is position s + 1).

        Slots holding cached tokens take their keys and values from the cache. Queries exist only for slots whose
        output is needed (new, non-enrichment tokens): (K, H, Q, d). Also returns the un-rotated keys and values of
        the new tokens, from which the cache keeps its tail.
        """
        qkv = self.project(normed_tokens)  # (T, 3, H, d)
        new_kv = qkv[:, 1:]  # (T, 2, H, d)
        tail = None
        if cache is not None and cache.tail_keys is not None:
            tail = torch.stack([cache.tail_keys, cache.tail_values], 2)  # (B, P, 2, H, d)
        key, value = gather_rows(layout.sources(new_kv, tail), layout.window_slots).permute(2, 0, 3, 1, 4)
        query = gather_rows(layout.sources(qkv[:, 0]), layout.query_index).transpose(1, 2)  # (K, H, Q, d)
        if self.config.use_rotary:
            rotations = layout.rotary(self.head_dim, self.config.rope_theta, qkv.device)  # (S, d / 2, 2)
            query = apply_interleaved_rotary(query, rotations[layout.query_slots][:, None])
            key = apply_interleaved_rotary(key, rotations)
        # A view of every token's q, k and v: returned without a cache, it would keep them alive through the layer.
        return query, key, value, new_kv if cache is not None else None

    # ---- phase 3 ---------------------------------------------------------------------------------------------------

    def attend_windows(self, query, key, value, cell_key, cell_value, layout: RANWindowLayout, output_attentions):
        """Token attention of all windows in one call: window k's keys are its read cell followed by its slots.

        Packed windows are a batch of K sequences, so any of Transformers' attention functions runs them
        (`config._attn_implementation`). Returns the attended values (T, H * d) and, with `output_attentions` and
        an implementation that gives them (eager), every token's weights (B, H, L, 1 + S), else None.
        """
        key = torch.cat([cell_key[:, :, None], key], dim=2)  # (K, H, 1 + S, d)
        value = torch.cat([cell_value[:, :, None], value], dim=2)  # (K, H, 1 + S, d)
        visible = F.pad(layout.slot_mask, (1, 0), value=True)[:, None, None, :]  # (K, 1, 1, 1 + S)
        if self.config.is_causal or layout.slot_is_source is not None:
            key_slot = torch.arange(-1, layout.num_slots, device=key.device)  # the cell is "slot -1"
            earlier = key_slot <= layout.query_slots[:, :, None]  # (K, Q, 1 + S)
            if layout.slot_is_source is not None:  # prefix LM (UniLM): every token reads the source, and its past
                earlier = earlier | F.pad(layout.slot_is_source, (1, 0))[:, None, :]
            visible = visible & earlier[:, None]  # (K, 1, Q, 1 + S)
        # One additive mask suits every implementation; the cell is always visible, so no row is fully masked.
        attention_mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
        attention_mask = attention_mask.masked_fill(~visible, torch.finfo(query.dtype).min)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_window_attention)
        attended, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.head_dim**-0.5,
        )  # (K, Q, H, d)
        if weights is not None and output_attentions:
            # The returned weights stay in the graph, as returned hidden states do: the output is recomputed from
            # them, so that gradients with respect to the attention weights exist.
            weights = layout.weights_per_token(weights)  # (B, H, L, 1 + S)
            dropped = F.dropout(layout.weights_per_window(weights), self.attention_dropout, self.training)
            attended = torch.matmul(dropped, value).transpose(1, 2)
        return layout.from_windows(attended.flatten(-2)), weights  # (T, H * d)

    def cell_states(self, raw_cells, layout: RANWindowLayout, cache: RANCacheLayer | None):
        """(B, C, 2 D) memory-review keys and values of every sequence's cells, cached ones first, and (B,) the window
        number of each row's cell 0: cell c of row b is that of window `first_cell[b] + c`.

        Only this pass's cells are projected: with a cache, a decoding step costs the same at any context length.
        A cache holds every finished window's cell, or with `memory_review_cells=M` the last M at most
        (right-aligned: the last cached cell of every row is that of its last finished window).
        """
        cells = self.memory_review.project_cells(raw_cells.transpose(0, 1))  # (B, N, 2 D)
        first_cell = torch.zeros_like(layout.first_window)
        if cache is None or cache.cell_states is None:
            return cells, first_cell
        cached = cache.cell_states
        bounded = self.config.memory_review_cells is not None
        if bounded:
            first_cell = layout.first_window - cached.shape[1]
            room = layout.num_steps
        else:
            room = max(0, layout.cell_capacity - cached.shape[1])
        # The packed windows are exactly this pass's cells: window k is cell `window_number[k]` of its sequence.
        sequence, number = layout.window_sequence, layout.window_number
        slots = (sequence, layout.first_window[sequence] - first_cell[sequence] + number)
        # Out of place: inductor (torch 2.13, CPU) miscompiled the in-place writes into a zeros buffer when decoding
        # with two or more layers, giving a layer the cells of the next one.
        room = cells.new_zeros(layout.batch_size, room, cells.shape[-1])
        return torch.cat([cached, room], dim=1).index_put(slots, cells[sequence, number]), first_cell

    def salient_pool(self, cells, first_cell, cache: RANCacheLayer | None):
        """With `memory_salient_cells`: the cells a salient one is chosen from, as (B, S, 2 D) cached salient cells
        (none without a cache) to append to `cells`, and (B, C + S) the window of each of `cells` and of them."""
        windows = first_cell[:, None] + torch.arange(cells.shape[1], device=cells.device)  # (B, C)
        if cache is None or cache.salient_cell_states is None:
            return cells[:, :0], windows
        return cache.salient_cell_states, torch.cat([windows, cache.salient_windows], dim=1)

    def review_memory(
        self, token_states, cells, first_cell, initial_cell, layout: RANWindowLayout, output_attentions=False,
        salient_pool=None,
    ):  # fmt: skip
        """Every token reads the cells of its sequence (causal: the cells of earlier windows, or of the last
        `memory_review_cells` of them, and then the `memory_salient_cells` most salient older ones). Returns the
        reviewed token states (T, D) and, with `output_attentions`, the review weights (B, L, C), zeros at padding.

        `cells` (B, C, 2 D) and `first_cell` (B,) come from `cell_states`, `salient_pool` from `salient_pool`. Which
        cells a token reads is a range per token, (B, L), not a (B, L, C) mask (salient cells: a mask per window):
        the memory review builds the mask one chunk of tokens at a time.
        """
        padded_states = layout.to_padded(token_states)  # (B, L, D)
        first_readable, salient = None, None
        if self.config.is_causal:
            # (B, L): a token in window w reads the cells of windows 0 .. w - 1 (w - M .. w - 1 with a bound M)
            readable_cells = layout.token_window - first_cell[:, None]
            if self.config.memory_review_cells is not None:
                oldest = (layout.token_window - self.config.memory_review_cells).clamp(min=0)
                first_readable = oldest - first_cell[:, None]
            if salient_pool is not None:  # cached salient cells go last, out of every token's range
                cells = torch.cat([cells, salient_pool[0]], dim=1)
                salient = self.salient_readable(cells, salient_pool[1], layout)
            if self.config.uses_review_initial_cell:
                initial = self.memory_review.project_cells(initial_cell[:, None])  # (B, 1, 2 D)
                cells = torch.cat([initial, cells], dim=1)  # (B, 1 + C, 2 D)
                readable_cells = readable_cells + 1  # ... and the initial cell before them
                first_readable = None if first_readable is None else first_readable + 1
                salient = None if salient is None else (F.pad(salient[0], (1, 0)), salient[1])
        elif layout.source_windows is not None:
            # Prefix LM: the cells of the source's windows and of the token's own window and those before it; a cell
            # reads the source only, but how many windows follow is the target's length.
            readable_cells = torch.maximum(layout.token_window + 1, layout.source_windows[:, None])
        else:
            readable_cells = layout.num_windows[:, None].expand_as(layout.token_window)  # (B, L): all of them
        reviewed, weights = self.memory_review(
            padded_states, cells, readable_cells, output_attentions, first_readable, salient
        )
        if weights is not None:
            weights = weights * layout.to_padded(weights.new_ones(layout.token_index.numel(), 1))  # none at padding
        return layout.from_padded(reviewed), weights

    def salient_readable(self, all_cells, windows, layout: RANWindowLayout):
        """(B, R, C + S) the salient cells each of this pass's R windows may read beyond its range, and (B, L) each
        token's row of that table; `all_cells` are the cells with the cached salient ones appended, `windows` theirs."""
        reading = layout.first_window[:, None] + torch.arange(layout.num_steps, device=all_cells.device)  # (B, R)
        table = self.chosen_salient(all_cells, windows, reading)
        rows = (layout.token_window - layout.first_window[:, None]).clamp(0, layout.num_steps - 1)
        return table, rows

    def chosen_salient(self, all_cells, windows, reading_windows):
        config = self.config
        salience = self.memory_review.cell_salience(all_cells)
        return salient_cells(
            salience, windows, reading_windows, config.memory_review_cells, config.memory_salient_cells
        )

    def keep_salient(self, cache: RANCacheLayer, layout: RANWindowLayout, cell_states, salient_pool):
        """Cache the `memory_salient_cells` cells that the next window reads beyond its range, oldest first; slots
        not yet filled hold zeros and window -1."""
        all_cells, windows = torch.cat([cell_states, salient_pool[0]], dim=1), salient_pool[1]
        kept = self.config.memory_salient_cells
        if all_cells.shape[1] < kept:
            all_cells = F.pad(all_cells, (0, 0, 0, kept - all_cells.shape[1]))
            windows = F.pad(windows, (0, kept - windows.shape[1]), value=-1)
        keep = self.chosen_salient(all_cells, windows, layout.finished_windows[:, None])[:, 0]  # (B, C + S)
        order = torch.where(keep, windows, torch.iinfo(windows.dtype).max).argsort(dim=-1, stable=True)[:, :kept]
        valid = keep.gather(1, order)
        chosen = all_cells.gather(1, order[..., None].expand(-1, -1, all_cells.shape[-1]))
        cache.salient_cell_states = chosen * valid[..., None]
        cache.salient_windows = torch.where(valid, windows.gather(1, order), -1)

    def update_cache(
        self, cache: RANCacheLayer, layout: RANWindowLayout, start, raw_cells, cells, cell_states, first_cell, kv,
        salient_pool=None,
    ):  # fmt: skip
        """Keep what the next pass needs: the cell after the last finished window, the cells memory review may read
        again, and the unfinished tail."""
        finished_here = layout.finished_windows - layout.first_window  # (B,) windows finished in this pass
        last = (finished_here - 1).clamp(min=0)
        rows = torch.arange(layout.batch_size, device=last.device)
        has_finished = (finished_here > 0)[:, None]
        cache.cell = torch.where(has_finished, cells[last, rows], start[0]) if cells.numel() else start[0]
        cache.previous_raw_cell = (
            torch.where(has_finished, raw_cells[last, rows], start[1]) if raw_cells.numel() else start[1]
        )
        if self.config.memory_review_cells is not None:  # the last M finished cells, right-aligned
            bound = min(self.config.memory_review_cells, layout.most_finished_windows)
            window = layout.finished_windows[:, None] - bound + torch.arange(bound, device=last.device)  # (B, M)
            index = (window - first_cell[:, None]).clamp(min=0)[..., None].expand(-1, -1, cell_states.shape[-1])
            cache.cell_states = cell_states.gather(1, index) * (window >= 0)[..., None]
            if salient_pool is not None:
                self.keep_salient(cache, layout, cell_states, salient_pool)
        elif self.config.memory_review:
            kept = layout.most_finished_windows
            finished = torch.arange(kept, device=last.device)[None, :] < layout.finished_windows[:, None]
            cache.cell_states = cell_states[:, :kept] * finished[..., None]
        tail = None if cache.tail_keys is None else torch.stack([cache.tail_keys, cache.tail_values], 2)
        cache.tail_keys, cache.tail_values = layout.sources(kv, tail)[layout.next_tail].unbind(2)

    # ---- the layer -------------------------------------------------------------------------------------------------

    def forward(
        self,
        token_states: torch.Tensor,
        cell: torch.Tensor | None,
        layout: RANWindowLayout,
        cache: RANCacheLayer | None = None,
        output_attentions: bool = False,
    ):
        """token_states (T, D) new real tokens; cell (B, D) the cell each sequence's first window reads, or None for
        the layer's own learned starting cell (read here, inside the layer, so that a sharded parameter is gathered).

        With a `cache` (causal continuation) the scan starts from the cached cell and the cache is updated in place.
        Returns token states (T, D), raw cells (N, B, D) of this pass's windows, each sequence's last cell (B, D)
        (the starting one for a row of padding only) and, with `output_attentions`, every token's window attention
        weights (B, H, L, 1 + S) (None unless the attention implementation gives them) and memory-review weights
        (B, L, C).
        """
        initial_cell = None
        if hasattr(self, "initial_cell"):
            initial_cell = self.dropout(self.initial_cell[None].expand(layout.batch_size, -1))
        start_cell = initial_cell if cell is None else cell
        start_previous = torch.zeros_like(start_cell)
        if cache is not None and cache.is_initialized:
            start_cell, start_previous = cache.cell, cache.previous_raw_cell
        if layout.num_steps == 0:  # padding only: nothing to read, nothing to write
            return token_states, token_states.new_zeros(0, *start_cell.shape), start_cell, None, None
        normed_tokens = self.normalize_input(token_states)  # (T, D)

        # 1. Everything that does not depend on the cell, for all windows at once.
        query, key, value, new_kv = self.project_windows(normed_tokens, layout, cache)  # (K, H, S, d) each

        # 2. The cell scan: the only sequential step.
        scan = scan_function(self.config.scan_implementation)
        read_keys, read_values, raw_cells, cells = scan(
            self, start_cell, start_previous, key, value, layout.for_cell_scan()
        )

        # 3. Token attention of all windows in one batched call, then the per-token tail.
        read_key, read_value = layout.per_sequence(read_keys), layout.per_sequence(read_values)
        attended, attention_weights = self.attend_windows(
            query, key, value, read_key, read_value, layout, output_attentions
        )  # (T, H * d)
        if self.residual_stream:
            token_states = token_states + self.attention_output(attended, normed_tokens)  # (T, D)
        else:
            token_states = self.finish_attention(attended, normed_tokens)  # (T, D)

        cell_states, first_cell, review_weights, salient_pool = None, None, None, None
        if self.config.memory_review:
            cell_states, first_cell = self.cell_states(raw_cells, layout, cache)
            if self.config.memory_salient_cells is not None:
                salient_pool = self.salient_pool(cell_states, first_cell, cache)
            token_states, review_weights = self.review_memory(
                token_states, cell_states, first_cell, initial_cell, layout, output_attentions, salient_pool
            )
        elif not self.residual_stream:
            token_states = self.output_norm(token_states)
        if cache is not None:
            self.update_cache(
                cache, layout, (start_cell, start_previous), raw_cells, cells, cell_states, first_cell, new_kv,
                salient_pool,
            )  # fmt: skip
        # A sequence's last cell starts the next layer; a row of padding only keeps the cell it came with. A prefix
        # LM's is the cell after its source: the windows after it are as many as the target is long.
        cell_windows = layout.num_windows if layout.source_windows is None else layout.source_windows
        last_step = (cell_windows - 1).clamp(min=0)
        rows = torch.arange(layout.batch_size, device=last_step.device)
        last_cell = torch.where((cell_windows > 0)[:, None], cells[last_step, rows], start_cell)
        return token_states, raw_cells, last_cell, attention_weights, review_weights


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------


class RANTokenShift(nn.Linear):
    """The projection of a token's predecessor that `config.token_shift` adds to it; zero at initialisation, so that
    a model starts as one without it."""


class RANEmbeddings(nn.Module):
    """Token embedding, LayerNorm and dropout. RAN has no position embedding: positions enter as rotary, per window."""

    def __init__(self, config: RANConfig):
        super().__init__()
        if config.cutoffs is not None:  # adaptive input embeddings, shared with the adaptive softmax
            self.word_embeddings = RANAdaptiveEmbedding(
                config.vocab_size, config.hidden_size, config.cutoffs, config.div_val
            )
        else:
            self.word_embeddings = nn.Embedding(
                config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
            )
        self.norm = RANLayerNorm(config.hidden_size, config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        if config.uses_token_shift:
            self.token_shift = RANTokenShift(config.hidden_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None):
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        return self.dropout(self.norm(inputs_embeds))

    def shift_tokens(self, token_states: torch.Tensor, layout: RANWindowLayout, cache: RANCacheLayer | None):
        """(T, D) new tokens' embeddings -> each plus the projection of its predecessor's (`config.token_shift`).

        A row's first new token reads the last token of the cached text, or nothing (zeros) at the start; the cache
        then keeps each row's last token for the next pass.
        """
        rows = layout.token_index // layout.padded_length  # (T,) each token's sequence
        first = torch.ones_like(rows, dtype=torch.bool)
        first[1:] = rows[1:] != rows[:-1]
        previous = F.pad(token_states[:-1], (0, 0, 1, 0))  # (T, D): the token before, in the flat order
        carried = None if cache is None else cache.last_token
        start = token_states.new_zeros(layout.batch_size, token_states.shape[-1]) if carried is None else carried
        previous = torch.where(first[:, None], start[rows], previous)
        if cache is not None:
            last = torch.ones_like(first)
            last[:-1] = first[1:]
            kept = start.index_put((rows[last],), token_states[last])  # rows without new tokens keep theirs
            cache.last_token = kept
        return token_states + self.token_shift(previous)


class RANPooler(nn.Module):
    """The official "cell transform" (paper eq. 10-11): GLU(swish(Dense(pooled cell))) + Dense(pooled tokens).

    Tokens are max-pooled as in the paper, or mean-pooled with `config.token_pooling="mean"`.
    """

    def __init__(self, config: RANConfig):
        super().__init__()
        self.pool_tokens = masked_max if config.token_pooling == "max" else masked_mean
        self.cell_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.cell_glu = RANGatedLinearUnit(config.hidden_size)
        self.token_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, pooled_cell: torch.Tensor, token_states: torch.Tensor, attention_mask: torch.Tensor):
        cell = self.cell_glu(self.dropout(self.act(self.cell_dense(pooled_cell))))  # (B, D)
        return cell + self.token_dense(self.pool_tokens(token_states, attention_mask.bool()))  # (B, D)


def masked_max(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over axis 1 of (B, X, D) where mask (B, X) is True; 0 for rows with nothing to pool."""
    filled = states.masked_fill(~mask[..., None], torch.finfo(states.dtype).min)
    return torch.where(mask.any(1)[:, None], filled.amax(1), torch.zeros_like(filled[:, 0]))


def masked_mean(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over axis 1 of (B, X, D) where mask (B, X) is True; 0 for rows with nothing to pool."""
    total = (states * mask[..., None]).sum(1)
    return total / mask.sum(1, keepdim=True).clamp(min=1)


@auto_docstring
class RANPreTrainedModel(PreTrainedModel):
    config: RANConfig
    config_class = RANConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RANLayer"]
    # Window attention runs through Transformers' attention functions: eager (returns weights) and SDPA (default).
    # Flex attention is not claimed: on CPU it has no backward and its compiled forward crashed here. The memory
    # review and the cell scan keep their own small matmuls: one key per window, or one query per step.
    _supports_sdpa = True
    # The cell scan runs window after window through the whole sequence: it cannot be split across ranks by length.
    _supports_context_parallel = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        super()._init_weights(module)
        if isinstance(module, RANLayer) and hasattr(module, "initial_cell"):
            # Not zero (what the official initialiser amounts to): the cell is standardised on reading, and a zero
            # vector's standardisation has gradient 1 / sqrt(eps) ~ 3e3 (its memory-review key, a unit vector of
            # zero, far more). At initialisation that gradient was 100-1e8 times all the others together, so
            # clipping by the global norm left every other weight almost no update. Converted checkpoints load theirs.
            init.normal_(module.initial_cell, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, RANMemoryReview) and hasattr(module, "salience"):
            init.zeros_(module.salience)  # no cell is preferred before training says which are worth reading
        elif isinstance(module, RANTokenShift):
            init.zeros_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, RANLanguageModelBase) and getattr(module.decoder, "bias", None) is not None:
            init.zeros_(module.decoder.bias)


@dataclass
class RANModelOutput(ModelOutput):
    """
    Outputs of [`RANModel`].

    Args:
        last_hidden_state (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size)`):
            Token states of the last layer; zeros at padding positions.
        pooler_output (`torch.FloatTensor` of shape `(batch_size, hidden_size)`, *optional*):
            Document representation: the cell transform of the pooled cell plus the max-pooled token states
            (`None` when the model was built with `add_pooling_layer=False`).
        pooled_cell (`torch.FloatTensor` of shape `(batch_size, hidden_size)`):
            The last layer's cells pooled as `config.cell_pooling` says.
        last_cell (`torch.FloatTensor` of shape `(batch_size, hidden_size)`):
            The cell after the last window of the last layer.
        cells (`torch.FloatTensor` of shape `(batch_size, num_windows, hidden_size)`):
            The raw cell written by every window of the last layer; zeros past a sequence's own windows.
        cells_mask (`torch.BoolTensor` of shape `(batch_size, num_windows)`):
            Which entries of `cells` belong to a real window.
        hidden_states (`tuple(torch.FloatTensor)`, *optional*, returned when `output_hidden_states=True`):
            The embedding output and the token states after every layer, each `(batch_size, sequence_length,
            hidden_size)`.
        attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
            Every layer's window attention weights, each `(batch_size, num_heads, sequence_length, 1 + window_slots)`:
            what each token read in its window, the cell it reads first (index 0), then the window's slots (the
            enrichment tokens, then its own tokens; zeros where a slot is empty, masked or in the future). Eager
            attention only.
        memory_attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
            Every layer's memory-review weights, each `(batch_size, sequence_length, num_cells)`: how much each token
            read of each window's cell. Causal models with `review_initial_cell` put the layer's starting cell at
            index 0 (window w's cell at w + 1); a token reads only earlier windows' cells, and a token that may read
            none (or padding) has all zeros. Any attention implementation.
        past_key_values (`RANCache`, *optional*, returned when `use_cache=True`):
            Causal models: the recurrent state after these tokens, to continue the text with.
    """

    last_hidden_state: torch.FloatTensor | None = None
    pooler_output: torch.FloatTensor | None = None
    pooled_cell: torch.FloatTensor | None = None
    last_cell: torch.FloatTensor | None = None
    cells: torch.FloatTensor | None = None
    cells_mask: torch.BoolTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    memory_attentions: tuple[torch.FloatTensor, ...] | None = None
    past_key_values: RANCache | None = None


@dataclass
class RANMaskedLMOutput(MaskedLMOutput):
    """
    [`MaskedLMOutput`] with the memory-review weights.

    Args:
        memory_attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
            Every layer's memory-review weights, `(batch_size, sequence_length, num_cells)`; see [`RANModelOutput`].
    """

    memory_attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class RANSequenceClassifierOutput(SequenceClassifierOutput):
    """
    [`SequenceClassifierOutput`] with the memory-review weights.

    Args:
        memory_attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
            Every layer's memory-review weights, `(batch_size, sequence_length, num_cells)`; see [`RANModelOutput`].
    """

    memory_attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class RANTokenClassifierOutput(TokenClassifierOutput):
    """
    [`TokenClassifierOutput`] with the memory-review weights.

    Args:
        memory_attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
            Every layer's memory-review weights, `(batch_size, sequence_length, num_cells)`; see [`RANModelOutput`].
    """

    memory_attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class RANCausalLMOutputWithPast(CausalLMOutputWithPast):
    """
    [`CausalLMOutputWithPast`] with the memory-review weights.

    Args:
        memory_attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
            Every layer's memory-review weights, `(batch_size, sequence_length, num_cells)`; see [`RANModelOutput`].
    """

    memory_attentions: tuple[torch.FloatTensor, ...] | None = None


def input_batch_shape(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, hidden_size: int) -> tuple:
    """(batch_size, sequence_length) of the inputs, checking only what needs no look at their values."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(
                f"`input_ids` must have shape (batch_size, sequence_length), got {tuple(input_ids.shape)}."
            )
        if input_ids.dtype not in (torch.long, torch.int):
            # The embedding takes int64 / int32 only: name the dtype instead of failing inside it.
            raise ValueError(f"`input_ids` must hold integer token ids (int64 or int32), got dtype {input_ids.dtype}.")
        shape = tuple(input_ids.shape)
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
            raise ValueError(
                f"`inputs_embeds` must have shape (batch_size, sequence_length, {hidden_size}), "
                f"got {tuple(inputs_embeds.shape)}."
            )
        shape = tuple(inputs_embeds.shape[:2])
    if shape[0] == 0:
        raise ValueError("Got a batch of 0 sequences: RAN needs at least one sequence.")
    if shape[1] == 0:
        raise ValueError("Got sequences of length 0: RAN needs at least one token per batch.")
    return shape


def check_exportable(past_key_values, use_cache) -> None:
    """Refuse, naming the fix, the exports that cannot give a correct graph, before any tracing fails deep inside.

    `torch.export` and ONNX's dynamo exporter trace a window layout whose sizes follow from the input's shape and
    a cell scan that is one `scan` operator (ONNX `Scan`), so the graph takes any batch size and length.
    """
    if torch.onnx.is_in_onnx_export() and not torch.compiler.is_exporting():
        raise NotImplementedError(
            "The TorchScript-based ONNX exporter would record one fixed number of windows. Export a RAN with "
            "`torch.onnx.export(..., dynamo=True)`, or `ran_hf.export_onnx(model, path)`."
        )
    if not torch.compiler.is_exporting():
        return
    if past_key_values is not None or use_cache:
        raise NotImplementedError(
            "An exported RAN reads whole texts: export a causal model with `use_cache=False` (a graph that carries the "
            "recurrent cache from call to call is not supported)."
        )
    if torch.is_grad_enabled():
        raise RuntimeError(
            "Export a RAN under `torch.no_grad()` (`ran_hf.export_onnx` does): with gradients enabled, ONNX's exporter "
            "runs the cell scan's `scan` operator in its autograd form, which it cannot convert."
        )


class InputChecks(NamedTuple):
    """The values of a forward's inputs (and a head's labels) to check, still on the device: the window layout
    reads them with its sizes, in the forward's one host synchronisation, and `judge` then raises on a bad one."""

    values: torch.Tensor  # (k,) long
    judge: Callable[[list], None]


def check_token_type_ids(token_type_ids, batch_shape: tuple, attention_mask, config: RANConfig, label_checks=None):
    """A prefix LM's segments: shape and dtype now; whether every real token's type is 0 (source) or 1 (target),
    the source first, is returned as `InputChecks` (joined with a head's `label_checks`) to be read with the
    inputs' checks."""
    if config.is_causal:
        raise ValueError(
            "`token_type_ids` mark the source (0) and target (1) of a prefix LM, whose source reads itself both ways; "
            "a causal model (`is_causal=True`) reads every token causally: pass no `token_type_ids`."
        )
    if not torch.is_tensor(token_type_ids) or tuple(token_type_ids.shape) != batch_shape:
        shape = tuple(token_type_ids.shape) if torch.is_tensor(token_type_ids) else type(token_type_ids)
        raise ValueError(f"`token_type_ids` must have the inputs' shape {batch_shape}, got {shape}.")
    if token_type_ids.is_floating_point() or token_type_ids.is_complex():
        raise ValueError(f"`token_type_ids` must hold integers (0 source, 1 target), got dtype {token_type_ids.dtype}.")
    types = token_type_ids.long()
    real = torch.ones_like(types, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    real = real.to(types.device)
    is_target = (types == 1) & real
    unknown = (~is_target & (types != 0) & real).any()
    source_after_target = (torch.cummax(is_target.long(), dim=-1).values.bool() & (types == 0) & real).any()

    def judge(found: list) -> None:
        if found[0]:
            raise ValueError("`token_type_ids` holds a value other than 0 (source) and 1 (target) at a real token.")
        if found[1]:
            raise ValueError(
                "`token_type_ids` puts a source token (0) after a target token (1): a prefix LM's text is its source, "
                "then its target."
            )
        if label_checks is not None:
            label_checks.judge(found[2:])

    values = torch.stack([unknown, source_after_target]).long()
    if label_checks is not None:
        values = torch.cat([values, label_checks.values.to(values.device)])
    return InputChecks(values, judge)


def validate_ran_inputs(
    config: RANConfig, input_ids, attention_mask, inputs_embeds, past_positions: int = 0, label_checks=None
) -> tuple[tuple[int, int], InputChecks | None]:
    """Fail fast, naming the problem, on inputs that would otherwise crash deep inside or silently turn into NaN.

    Shapes are checked now. The values (token ids in the vocabulary, finite embeddings, a 0/1 mask, a head's label
    range) are returned as `InputChecks`, which the window layout reads with its sizes before any other work on the
    device; none under `torch.compile` / `torch.export`. Returns (batch_size, sequence_length) and the checks.
    """
    shape = input_batch_shape(input_ids, inputs_embeds, config.hidden_size)
    if torch.compiler.is_compiling():
        config._validate_salient_cells()  # what compiled code checks; an eager forward checks every field
    else:
        config.validate_if_changed()  # fields set on a built model (`model.config.window_size = 0`) checked again
    if attention_mask is not None and tuple(attention_mask.shape) not in (
        shape,
        (shape[0], past_positions + shape[1]),
    ):
        raise ValueError(
            f"`attention_mask` must have the shape of the inputs {shape}"
            + (f" or of the whole text so far {(shape[0], past_positions + shape[1])}" if past_positions else "")
            + f", got {tuple(attention_mask.shape)}."
        )

    if torch.compiler.is_compiling():
        # Compiled or exported: a value check would read the device inside the graph (a break, or an export that
        # fails on a data-dependent branch); the eager call of the same model checks them.
        return shape, None
    if input_ids is not None:
        checks = [input_ids.min(), input_ids.max()]
    else:
        # One NaN spreads through the window attention and the cells to every later token of its sequence.
        checks = [(~torch.isfinite(inputs_embeds)).any()]
    not_binary = None
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        # Anything but 0/1 is read as "real token" where nonzero: an additive mask (0 / -10000) would be inverted.
        not_binary = (attention_mask != 0) & (attention_mask != 1)
        checks.append(not_binary.any().to(checks[0].device))
    if label_checks is not None:  # a head's labels, read in the same synchronisation
        checks.extend(label_checks.values.to(checks[0].device).unbind())

    def judge(found: list) -> None:
        if label_checks is not None:
            own = len(found) - len(label_checks.values)
            label_checks.judge(found[own:])
            found = found[:own]
        if input_ids is not None:
            low, high = found[:2]
            if low < 0 or high >= config.vocab_size:
                raise ValueError(
                    f"`input_ids` holds token id {low if low < 0 else high}, outside the vocabulary "
                    f"[0, {config.vocab_size - 1}]."
                )
        elif found[0]:
            raise ValueError("`inputs_embeds` holds NaN or infinite values.")
        if not_binary is not None and found[-1]:
            value = attention_mask[not_binary][0].item()
            raise ValueError(
                f"`attention_mask` must hold 1 for real tokens and 0 for padding, got {value}. An additive mask "
                "(0 for tokens, a large negative number for padding) must be turned into 0/1 first: `(mask == 0)`."
            )

    return shape, InputChecks(torch.stack([check.long() for check in checks]), judge)


def check_initial_cell(initial_cell, batch_shape: tuple, hidden_size: int, past_positions: int) -> InputChecks | None:
    """A starting cell's shape and dtype now, before any work; whether it is finite is returned as `InputChecks`,
    read with the inputs' checks (none under `torch.compile` / `torch.export`)."""
    if not torch.is_tensor(initial_cell):
        raise ValueError(
            f"`initial_cell` must be a tensor of shape (batch_size, hidden_size), got {type(initial_cell)}."
        )
    expected = (batch_shape[0], hidden_size)
    if tuple(initial_cell.shape) != expected:
        raise ValueError(
            f"`initial_cell` must have shape (batch_size, hidden_size) = {expected}, one cell per sequence, got "
            f"{tuple(initial_cell.shape)}."
        )
    if not initial_cell.is_floating_point():
        raise ValueError(
            f"`initial_cell` must hold floating-point values (a cell such as an earlier call's `last_cell`), got dtype "
            f"{initial_cell.dtype}."
        )
    if past_positions:
        raise ValueError(
            f"`initial_cell` starts a text, but `past_key_values` already holds {past_positions} token(s) whose cells "
            "continue it: pass `initial_cell` with the first call only."
        )
    if torch.compiler.is_compiling():
        return None

    def judge(found: list) -> None:
        if found[0]:
            raise ValueError("`initial_cell` holds NaN or infinite values.")

    return InputChecks((~torch.isfinite(initial_cell)).any().long()[None], judge)


def joined_checks(*checks: InputChecks | None) -> InputChecks | None:
    """Several `InputChecks` read in one synchronisation; each judge sees its own values."""
    checks = [check for check in checks if check is not None]
    if len(checks) <= 1:
        return checks[0] if checks else None
    sizes = [len(check.values) for check in checks]

    def judge(found: list) -> None:
        start = 0
        for check, size in zip(checks, sizes):
            check.judge(found[start : start + size])
            start += size

    device = checks[0].values.device
    return InputChecks(torch.cat([check.values.to(device) for check in checks]), judge)


@contextmanager
def checkpointing_off(layer: RANLayer, when: bool):
    """Run `layer` without gradient checkpointing when it reads or updates a cache: recomputed in the backward pass,
    it would read the cache it had already updated. Training through a cache in chunks then costs full activations."""
    if not (when and layer.gradient_checkpointing):
        yield
        return
    logger.warning_once("RAN layers that read or update a cache run without gradient checkpointing.")
    layer.gradient_checkpointing = False
    try:
        yield
    finally:
        layer.gradient_checkpointing = True


@auto_docstring(
    custom_intro="The bare RAN encoder (or causal decoder when `config.is_causal`): embeddings, RAN layers, optional "
    "pooler (the official cell transform)."
)
class RANModel(RANPreTrainedModel):
    def __init__(self, config: RANConfig, add_pooling_layer: bool = True):
        r"""
        add_pooling_layer (`bool`, *optional*, defaults to `True`):
            Whether to build the pooler (the official cell transform) that gives `pooler_output`.
        """
        super().__init__(config)
        self.embeddings = RANEmbeddings(config)
        self.layers = nn.ModuleList([RANLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)])
        # A residual stream is normalised once, after the last layer; official layers end in their own norm.
        self.norm = RANLayerNorm(config.hidden_size, config.layer_norm_eps) if config.uses_residual_stream else None
        self.pooler = RANPooler(config) if add_pooling_layer else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        past_key_values: RANCache | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        initial_cell: torch.FloatTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANModelOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`):
            Token ids. Padding may sit on either side; it never changes what a sequence computes.
        attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*):
            1 for real tokens, 0 for padding. Defaults to all ones.
        inputs_embeds (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size)`, *optional*):
            Token embeddings to use instead of `input_ids`.
        past_key_values (`RANCache`, *optional*):
            Causal models only: the recurrent state after the tokens read so far; the inputs continue them.
        use_cache (`bool`, *optional*):
            Causal models only: return the recurrent state (a new `RANCache` when none was passed).
        output_attentions (`bool`, *optional*):
            Also return every layer's memory-review weights and, with `attn_implementation="eager"`, its window
            attention weights.
        output_hidden_states (`bool`, *optional*):
            Also return the embedding output and every layer's token states.
        token_type_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Prefix LM (`rannet`'s seq2seq mask, UniLM): 0 for the source, 1 for the target that follows it. In every
            window, source tokens read each other both ways and target tokens read the source and earlier targets;
            cells read the source only. See docs/seq2seq.md. None: no prefix mask.
        initial_cell (`torch.FloatTensor` of shape `(batch_size, hidden_size)`, *optional*):
            The cell each sequence's first window reads in the first layer, instead of the layer's learned starting
            cell (`rannet`'s `with_cell=True`): e.g. the `last_cell` of the text before, to continue a document. As in
            `rannet`, only the first layer reads it; later encoder layers start from the cell of the layer below, and
            later causal layers from their own learned cell. Used as given (no dropout); `rannet` replaces a batch of
            all-zero cells with its learned one, here pass None for that. Causal models: with the first call only
            (a cache carries the cells after it); memory review's starting cell stays the learned one.
        """
        check_exportable(past_key_values, use_cache)
        if (past_key_values is not None or use_cache) and not self.config.is_causal:
            raise ValueError("`past_key_values`/`use_cache` need a causal model (`is_causal=True`).")
        check_cache(past_key_values, self.config)
        if self.gradient_checkpointing and self.training and use_cache and past_key_values is None:
            # A checkpointed layer runs twice; the second run would update a fresh cache again.
            logger.warning_once("`use_cache=True` does not work with gradient checkpointing in training: no cache.")
            use_cache = False
        past_positions = past_key_values.get_seq_length() if past_key_values is not None else 0
        # A head's labels (`check_token_labels`, ...) are read with the inputs: one host synchronisation for all.
        label_checks = kwargs.pop("label_checks", None)
        if initial_cell is not None:  # read with the inputs' checks too
            batch_shape = input_batch_shape(input_ids, inputs_embeds, self.config.hidden_size)
            cell_checks = check_initial_cell(initial_cell, batch_shape, self.config.hidden_size, past_positions)
            label_checks = joined_checks(label_checks, cell_checks)
        if token_type_ids is not None:  # read with the inputs' checks too
            batch_shape = input_batch_shape(input_ids, inputs_embeds, self.config.hidden_size)
            label_checks = check_token_type_ids(token_type_ids, batch_shape, attention_mask, self.config, label_checks)
        (batch_size, padded_length), input_checks = validate_ran_inputs(
            self.config, input_ids, attention_mask, inputs_embeds, past_positions, label_checks
        )
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        if output_attentions and self.config._attn_implementation != "eager":
            logger.warning_once(
                f"`output_attentions=True` returns window attention weights only with the eager attention; this model "
                f"runs {self.config._attn_implementation!r}, so `attentions` is None (`memory_attentions` are "
                'returned). Load it with `attn_implementation="eager"` to get both.'
            )
        device = (input_ids if input_ids is not None else inputs_embeds).device
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, padded_length, dtype=torch.bool, device=device)
        attention_mask = attention_mask[:, -padded_length:]  # generate() passes the mask of the whole text so far
        if use_cache and past_key_values is None:
            past_key_values = RANCache(self.config)
        past_lengths = None if past_key_values is None else past_key_values.past_lengths(batch_size, device)
        # The layout's sizes and the inputs' checks in one host synchronisation, before any token is embedded.
        layout = RANWindowLayout.from_attention_mask(
            attention_mask, self.config, past_lengths, input_checks, token_type_ids=token_type_ids
        )
        embeddings = self.embeddings(input_ids=input_ids, inputs_embeds=inputs_embeds)  # (B, L, D)

        token_states = layout.from_padded(embeddings)  # (T, D)
        if self.config.uses_token_shift:
            first_cache = past_key_values.layers[0] if past_key_values is not None else None
            token_states = self.embeddings.shift_tokens(token_states, layout, first_cache)
        if initial_cell is not None:
            initial_cell = initial_cell.to(device=embeddings.device, dtype=embeddings.dtype)
        cell = initial_cell  # None: the first layer starts from its own learned cell
        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        all_memory_attentions = () if output_attentions and self.config.memory_review else None
        for layer in self.layers:
            if output_hidden_states:
                # The returned states stay in the graph: the layer reads its tokens back from them.
                all_hidden_states += (layout.to_padded(token_states),)
                token_states = layout.from_padded(all_hidden_states[-1])
            if self.config.is_causal and layer.layer_idx > 0:
                cell = None  # every later causal layer starts from its own learned cell: the cell below has read ahead
            layer_cache = past_key_values.layers[layer.layer_idx] if past_key_values is not None else None
            with checkpointing_off(layer, when=layer_cache is not None and self.training):
                token_states, raw_cells, cell, attention_weights, review_weights = layer(
                    token_states, cell, layout=layout, cache=layer_cache, output_attentions=output_attentions
                )
            if output_attentions:
                all_attentions = None if attention_weights is None else all_attentions + (attention_weights,)
                if self.config.memory_review:
                    all_memory_attentions += (review_weights,)

        if past_key_values is not None:
            past_key_values.advance(layout.lengths, padded_length)
        if self.norm is not None:
            token_states = self.norm(token_states)
        last_hidden_state = layout.to_padded(token_states)
        if output_hidden_states:
            all_hidden_states += (last_hidden_state,)
        cells = raw_cells.transpose(0, 1)  # (B, N, D)
        cells_mask = torch.arange(cells.shape[1], device=cells.device)[None, :] < layout.num_windows[:, None]
        cells = cells * cells_mask[..., None]
        if self.config.cell_pooling == "last":
            pooled_cell = cell
        elif self.config.cell_pooling == "mean":
            pooled_cell = masked_mean(cells, cells_mask)
        else:
            pooled_cell = masked_max(cells, cells_mask)
        pooler_output = self.pooler(pooled_cell, last_hidden_state, attention_mask) if self.pooler else None

        return RANModelOutput(
            last_hidden_state=last_hidden_state,
            pooler_output=pooler_output,
            pooled_cell=pooled_cell,
            last_cell=cell,
            cells=cells,
            cells_mask=cells_mask,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            memory_attentions=all_memory_attentions,
            past_key_values=past_key_values,
        )


# --------------------------------------------------------------------------------------------------------------------
# Heads
# --------------------------------------------------------------------------------------------------------------------


def ignore_padding(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Token labels at padding positions never count, whatever the caller put there."""
    if attention_mask is None:
        return labels
    return labels.masked_fill(~attention_mask.bool().to(labels.device), -100)


def loss_of_nothing(logits: torch.Tensor) -> torch.Tensor:
    """The loss of a batch with no label to score (all -100, or only padding): 0 instead of the NaN a mean over no
    element gives, still attached to the graph so that `backward()` runs."""
    return logits.new_zeros(()) + logits.sum() * 0.0  # + 0.0: never a negative zero


def scored_token_loss(loss_function, logits, labels, scored, **kwargs) -> torch.Tensor:
    """A token head's loss without reading the device to find a batch with nothing to score: unless the caller
    (Trainer) counts the items itself, `num_items_in_batch` is the number of scored labels, at least 1, so the loss
    is the mean over scored tokens, and 0 with zero gradients where there are none (not the NaN of an empty mean)."""
    if kwargs.get("num_items_in_batch") is None:
        kwargs["num_items_in_batch"] = (scored != -100).sum().clamp(min=1)
    return loss_function(logits, labels, **kwargs)


def check_token_labels(labels: torch.Tensor, batch_shape: tuple, num_classes: int, name: str) -> InputChecks:
    """Shape and dtype now; the values' range is returned, to be read with the base model's input checks."""
    if tuple(labels.shape) != batch_shape:
        raise ValueError(f"`labels` must have shape {batch_shape} (one {name} per token), got {tuple(labels.shape)}.")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"`labels` must hold integer {name}s, got dtype {labels.dtype}.")
    scored = labels.masked_fill(labels == -100, 0)

    def judge(found: list) -> None:
        low, high = found
        if low < 0 or high >= num_classes:
            raise ValueError(
                f"`labels` holds a {name} outside [0, {num_classes - 1}] (use -100 to ignore a position)."
            )

    return InputChecks(torch.stack([scored.min(), scored.max()]).long(), judge)


class RANPredictionHead(nn.Module):
    """MLM transform of the official model: dropout -> swish(Dense) -> LayerNorm."""

    def __init__(self, config: RANConfig):
        super().__init__()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.norm = RANLayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(self.dropout(hidden_states))))


class RANLanguageModelBase(RANPreTrainedModel):
    """What both language models share: the encoder and the official LM head, tied to the token embedding when the
    config says so (`tie_word_embeddings`: the encoder's default, not the causal model's)."""

    _tied_weights_keys = {"decoder.weight": "model.embeddings.word_embeddings.weight"}

    def __init__(self, config: RANConfig):
        super().__init__(config)
        self.model = RANModel(config, add_pooling_layer=False)
        if config.cutoffs is not None:
            # The official adaptive LM: dropout, a swish output mapping, and the adaptive softmax, which reads the
            # adaptive embedding's clusters itself (always shared, whatever `tie_word_embeddings` says).
            self._tied_weights_keys = {}
            self.head = RANOutputMapping(config.hidden_size, config.hidden_dropout_prob)
            self.decoder = RANAdaptiveSoftmax(config.vocab_size, config.hidden_size, config.cutoffs, config.div_val)
        else:
            self.head = RANPredictionHead(config)
            self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_output_embeddings(self):
        return None if self.config.cutoffs is not None else self.decoder  # an adaptive softmax has no one matrix

    def set_output_embeddings(self, new_embeddings: nn.Linear):
        self.decoder = new_embeddings


@auto_docstring(custom_intro="RAN with the official masked-language-modelling head, tied to the token embedding.")
class RANForMaskedLM(RANLanguageModelBase):
    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANMaskedLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Token ids to predict at masked positions; -100 (and every padding position) is ignored.
        initial_cell (`torch.FloatTensor` of shape `(batch_size, hidden_size)`, *optional*):
            The cell the first layer starts from instead of its learned one (`rannet`'s `with_cell=True`), e.g. an
            earlier call's `last_cell`; see [`RANModel.forward`].
        """
        label_checks = None  # read with the inputs' checks, in one synchronisation
        if labels is not None:
            batch_shape = input_batch_shape(input_ids, inputs_embeds, self.config.hidden_size)
            label_checks = check_token_labels(labels, batch_shape, self.config.vocab_size, "token id")
        # The head reads fields by name, whatever `return_dict` the caller or the config asks for.
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            initial_cell=initial_cell,
            return_dict=True,
            label_checks=label_checks,
            **kwargs,
        )
        logits = self.decoder(self.head(outputs.last_hidden_state))

        loss = None
        if labels is not None:
            labels = ignore_padding(labels, attention_mask)
            loss = scored_token_loss(
                self.loss_function, logits, labels, labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return RANMaskedLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            memory_attentions=outputs.memory_attentions,
        )


@auto_docstring(
    custom_intro="RAN with a linear classifier (or regressor) on the document representation, `pooler_output`."
)
class RANForSequenceClassification(RANPreTrainedModel):
    def __init__(self, config: RANConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = RANModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def check_labels(self, labels: torch.Tensor, batch_size: int, attention_mask, found: dict):
        """Validate labels for the configured (or inferred, as Transformers does) problem type: shapes and dtypes
        now; their values returned as `InputChecks`, read with the inputs' (one host synchronisation), whose judge
        raises on a bad one and fills `found`: whether every row has a token, whether every label is ignored."""
        num_labels = self.num_labels
        problem_type = self.config.problem_type
        if problem_type is None:
            if num_labels == 1:
                problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                problem_type = "single_label_classification"
            else:
                problem_type = "multi_label_classification"
        if labels.dim() == 0 or labels.shape[0] != batch_size:
            raise ValueError(
                f"`labels` must have one row per example ({batch_size}), got shape {tuple(labels.shape)}."
            )
        if problem_type == "single_label_classification":
            if labels.is_floating_point() or labels.dim() != 1:
                raise ValueError(
                    f"Single-label classification needs integer labels of shape ({batch_size},), got "
                    f"{labels.dtype} of shape {tuple(labels.shape)}."
                )
            scored = labels.masked_fill(labels == -100, 0)
            ignored = labels == -100
            if attention_mask is not None:  # rows of padding alone are left out of the loss as well
                ignored = ignored | ~attention_mask.bool().any(-1).to(labels.device)
            values = [scored.min(), scored.max(), ignored.all()]
        elif problem_type == "multi_label_classification":
            if tuple(labels.shape) != (batch_size, num_labels):
                raise ValueError(
                    f"Multi-label classification needs labels of shape ({batch_size}, {num_labels}), "
                    f"got {tuple(labels.shape)}."
                )
            labels = labels.float()
            outside = ~((labels >= 0) & (labels <= 1))  # NaN fails too
            values = [outside.any()]
        else:
            if labels.numel() != batch_size * num_labels:
                raise ValueError(
                    f"Regression needs {num_labels} target(s) per example, got labels of shape {tuple(labels.shape)}."
                )
            labels = labels.float()
            values = [(~torch.isfinite(labels)).any()]
        device = values[0].device
        every_row = torch.ones((), dtype=torch.bool, device=device)
        if attention_mask is not None:
            every_row = attention_mask.bool().any(-1).all()
        values.append(every_row)

        def judge(read: list) -> None:
            *checked, every_row_has_tokens = read
            found.update(every_row_has_tokens=bool(every_row_has_tokens), nothing_scored=False)
            if problem_type == "single_label_classification":
                low, high, nothing_scored = checked
                found["nothing_scored"] = bool(nothing_scored)
                if low < 0 or high >= num_labels:
                    raise ValueError(f"`labels` holds a class outside [0, {num_labels - 1}].")
            elif problem_type == "multi_label_classification" and checked[0]:
                shown = labels[outside][0].item()  # read only on the way to the error
                raise ValueError(
                    f"Multi-label classification needs targets in [0, 1] (1: the class applies), got {shown}."
                )
            elif problem_type == "regression" and checked[0]:
                raise ValueError("Regression targets hold NaN or infinite values.")

        return labels, InputChecks(torch.stack([value.long().to(device) for value in values]), judge)

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.Tensor | None = None,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANSequenceClassifierOutput:
        r"""
        labels (`torch.Tensor`, *optional*):
            `(batch_size,)` class ids for single-label classification, `(batch_size, num_labels)` 0/1 targets for
            multi-label classification, or float targets for regression (`num_labels == 1`); the problem type follows
            `config.problem_type` and is inferred as in Transformers when unset.
        initial_cell (`torch.FloatTensor` of shape `(batch_size, hidden_size)`, *optional*):
            The cell the first layer starts from instead of its learned one (`rannet`'s `with_cell=True`), e.g. an
            earlier call's `last_cell`; see [`RANModel.forward`].
        """
        label_checks, found = None, {}  # read with the inputs' checks, in one synchronisation
        if labels is not None:
            batch_size = input_batch_shape(input_ids, inputs_embeds, self.config.hidden_size)[0]
            labels, label_checks = self.check_labels(labels, batch_size, attention_mask, found)
        # The head reads fields by name, whatever `return_dict` the caller or the config asks for.
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            initial_cell=initial_cell,
            return_dict=True,
            label_checks=label_checks,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.pooler_output))

        loss = None
        if labels is not None:
            if not found:  # not read with the inputs (compiled; the meta device)
                found = {"every_row_has_tokens": True, "nothing_scored": False}
            loss_logits = logits
            if not found["every_row_has_tokens"]:
                # Rows that hold only padding carry no document: leave them out of the loss.
                has_tokens = attention_mask.bool().any(-1).to(logits.device)
                loss_logits, labels = logits[has_tokens], labels.to(logits.device)[has_tokens]
            if loss_logits.shape[0] == 0 or found["nothing_scored"]:
                loss = loss_of_nothing(logits)
            else:
                loss = self.loss_function(labels=labels, pooled_logits=loss_logits, config=self.config, **kwargs)
        return RANSequenceClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            memory_attentions=outputs.memory_attentions,
        )


@auto_docstring(custom_intro="RAN with a linear classifier on every token state (e.g. named-entity recognition).")
class RANForTokenClassification(RANPreTrainedModel):
    def __init__(self, config: RANConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = RANModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANTokenClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Class id of every token; -100 (and every padding position) is ignored.
        initial_cell (`torch.FloatTensor` of shape `(batch_size, hidden_size)`, *optional*):
            The cell the first layer starts from instead of its learned one (`rannet`'s `with_cell=True`), e.g. an
            earlier call's `last_cell`; see [`RANModel.forward`].
        """
        label_checks = None  # read with the inputs' checks, in one synchronisation
        if labels is not None:
            batch_shape = input_batch_shape(input_ids, inputs_embeds, self.config.hidden_size)
            label_checks = check_token_labels(labels, batch_shape, self.num_labels, "class id")
        # The head reads fields by name, whatever `return_dict` the caller or the config asks for.
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            initial_cell=initial_cell,
            return_dict=True,
            label_checks=label_checks,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))

        loss = None
        if labels is not None:
            labels = ignore_padding(labels, attention_mask)
            loss = scored_token_loss(self.loss_function, logits, labels, labels, config=self.config, **kwargs)
        return RANTokenClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            memory_attentions=outputs.memory_attentions,
        )


@auto_docstring(
    custom_intro="""
    Causal language model: a strictly causal, recurrent RAN with the official LM head (its decoder is untied from
    the embedding unless the config says `tie_word_embeddings=True`).
    Generation carries a `RANCache`: constant-size state per layer plus a key and a value per finished window.
    """
)
class RANForCausalLM(RANLanguageModelBase, GenerationMixin):
    # A recurrent state cannot be rolled back to an earlier token: assisted generation is refused up front.
    _is_stateful = True

    def __init__(self, config: RANConfig):
        if not config.is_causal:
            logger.warning(
                "RANForCausalLM is a causal model: setting `config.is_causal=True` (its other fields stay as they "
                f"are, `tie_word_embeddings={config.tie_word_embeddings}` included)."
            )
            config.is_causal = True
        super().__init__(config)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # RAN keeps a recurrent state, not per-token keys and values: forward() creates its own `RANCache`.
        return False

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, inputs_embeds=None, **kwargs):
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, past_key_values=past_key_values, inputs_embeds=inputs_embeds, **kwargs
        )
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            model_inputs.pop("initial_cell", None)  # read by the prompt's pass; the cache carries the cells since
        return model_inputs

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        past_key_values: RANCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANCausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Usually `input_ids`: the loss predicts token t + 1 from tokens up to t; -100 and padding are ignored.
        logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0):
            Compute logits only for the last `logits_to_keep` positions (0: all), or for the given positions.
        initial_cell (`torch.FloatTensor` of shape `(batch_size, hidden_size)`, *optional*):
            The cell the first layer starts from instead of its learned one (`rannet`'s `with_cell=True`), e.g. an
            earlier call's `last_cell`; see [`RANModel.forward`].
        """
        label_checks = None  # read with the inputs' checks, in one synchronisation
        if labels is not None:
            batch_shape = input_batch_shape(input_ids, inputs_embeds, self.config.hidden_size)
            label_checks = check_token_labels(labels, batch_shape, self.config.vocab_size, "token id")
            if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
                raise ValueError(
                    "`labels` are scored at every position, but `logits_to_keep` keeps only some logits: pass "
                    "`logits_to_keep=0` (the default) with `labels`."
                )
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            initial_cell=initial_cell,
            past_key_values=past_key_values,
            use_cache=use_cache,
            return_dict=True,
            label_checks=label_checks,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        if self.config.cutoffs is None:
            logits = self.decoder(self.head(hidden_states[:, keep]))
        elif labels is None:  # float32 log-probabilities of every id
            logits = self.decoder(self.head(hidden_states[:, keep]), self.model.embeddings.word_embeddings)
        else:
            logits = None  # the adaptive softmax scores each label without building the whole distribution

        loss = None
        if labels is not None and self.config.cutoffs is not None:
            loss = adaptive_lm_loss(
                self.decoder,
                self.model.embeddings.word_embeddings,
                self.head(hidden_states),
                ignore_padding(labels, attention_mask),
                **kwargs,
            )
        elif labels is not None:
            labels = ignore_padding(labels, attention_mask)
            # Position t predicts token t + 1, so the first label is never scored.
            scored = kwargs["shift_labels"] if kwargs.get("shift_labels") is not None else labels[:, 1:]
            loss = scored_token_loss(
                self.loss_function, logits, labels, scored, vocab_size=self.config.vocab_size, **kwargs
            )
        return RANCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            memory_attentions=outputs.memory_attentions,
        )


@dataclass
class RANQuestionAnsweringModelOutput(QuestionAnsweringModelOutput):
    """
    [`QuestionAnsweringModelOutput`] with the memory-review weights; `start_logits` and `end_logits` are the lowest
    float at padding positions.

    Args:
        memory_attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
            Every layer's memory-review weights, `(batch_size, sequence_length, num_cells)`; see [`RANModelOutput`].
    """

    memory_attentions: tuple[torch.FloatTensor, ...] | None = None


def answer_positions_on_text(positions: torch.Tensor, attention_mask, batch_size: int, length: int, name: str):
    """Answer positions as Transformers' span loss reads them, with those on padding moved to `length`: like one past
    the end of the input, an answer on padding is ignored (the loss clamps positions to [0, length], ignores length)."""
    if positions.is_floating_point() or positions.dtype == torch.bool or positions.numel() != batch_size:
        raise ValueError(
            f"`{name}` must hold one integer token index per example ({batch_size}), got {positions.dtype} of "
            f"shape {tuple(positions.shape)}."
        )
    positions = positions.reshape(batch_size).clamp(0, length)
    if attention_mask is None:
        return positions
    on_text = F.pad(attention_mask.bool(), (0, 1)).to(positions.device).gather(1, positions[:, None]).squeeze(1)
    return positions.masked_fill(~on_text, length)


@auto_docstring(
    custom_intro="""
    RAN with a span head for extractive question answering: a linear layer on every token state gives the start and
    end logits of the answer over the whole input (question and document as one pair) in a single pass, however long
    the document.
    """
)
class RANForQuestionAnswering(RANPreTrainedModel):
    def __init__(self, config: RANConfig):
        super().__init__(config)
        self.model = RANModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)  # start and end logit of every token
        self.post_init()

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANQuestionAnsweringModelOutput:
        r"""
        start_positions (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Index of the answer's first token. A position past the input or on padding is ignored by the loss.
        end_positions (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Index of the answer's last token, ignored in the same way.
        initial_cell (`torch.FloatTensor` of shape `(batch_size, hidden_size)`, *optional*):
            The cell the first layer starts from instead of its learned one (`rannet`'s `with_cell=True`), e.g. an
            earlier call's `last_cell`; see [`RANModel.forward`].
        """
        if (start_positions is None) != (end_positions is None):
            raise ValueError("Give both `start_positions` and `end_positions` for a loss, or neither.")
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            initial_cell=initial_cell,
            return_dict=True,
            **kwargs,
        )
        logits = self.qa_outputs(self.dropout(outputs.last_hidden_state))
        if attention_mask is not None:
            # Padding is never an answer: without it in the softmax over positions, the loss and the span
            # probabilities do not depend on how a sequence is padded.
            padding = ~attention_mask.bool()[:, -logits.shape[1] :, None].to(logits.device)
            logits = logits.masked_fill(padding, torch.finfo(logits.dtype).min)
        start_logits, end_logits = (side.squeeze(-1).contiguous() for side in logits.split(1, dim=-1))

        loss = None
        if start_positions is not None:
            batch_size, length = start_logits.shape
            start_positions, end_positions = (
                answer_positions_on_text(positions, attention_mask, batch_size, length, name)
                for positions, name in ((start_positions, "start_positions"), (end_positions, "end_positions"))
            )
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions, **kwargs)
        return RANQuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            memory_attentions=outputs.memory_attentions,
        )


__all__ = [
    "RANForCausalLM",
    "RANForMaskedLM",
    "RANForQuestionAnswering",
    "RANForSequenceClassification",
    "RANForTokenClassification",
    "RANModel",
    "RANPreTrainedModel",
]
