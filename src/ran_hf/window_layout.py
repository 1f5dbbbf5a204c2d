"""Where every real token of a batch sits in the windows of its sequence: `RANWindowLayout`.

The layout is built once per forward pass (its sizes are read to the host in one synchronisation, with the
inputs' value checks) and every layer reads it: the projections gather window slots from it, the cell scan reads
its windows step by step, and the window attention's outputs go back to the tokens through it.
"""

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .building_blocks import gather_rows, rotary_rotations
from .configuration_ran import RANConfig


def count_windows(lengths: torch.Tensor, window: int, min_window: int) -> torch.Tensor:
    """Windows of sequences of `lengths` tokens: the full ones, plus the tail if it has at least `min_window` tokens
    or is all there is; a shorter tail joins the window before it."""
    full, tail = lengths // window, lengths % window
    return full + ((tail > 0) & ((tail >= min_window) | (full == 0))).long()


def group_starts(counts: torch.Tensor) -> torch.Tensor:
    """Where each group starts in a packed tensor that holds `counts[i]` entries of group i, one group after
    another."""
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
    _token_slots: torch.Tensor | None = None
    slot_is_source: torch.Tensor | None = None  # (K, S) prefix LM (token_type_ids): the slot holds a source token
    source_windows: torch.Tensor | None = None  # (B,) prefix LM: windows that hold a source token, the first ones
    read_values: list | None = None  # `read_with_sizes` as read to the host with the sizes; None in an export
    total_lengths: list | None = None  # continuing a cache: each row's length after this pass, read with the sizes

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
        read_with_sizes: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        window_size: int | None = None,
    ) -> "RANWindowLayout":
        """Build the layout in five steps: count windows, pack them, place slots, pick queries, keep the cache tail.

        Every size that shapes a tensor is read to the host in one synchronisation (step 1); nothing else waits on
        the device. `read_with_sizes` (k,): values that the caller needs on the host (the inputs' value checks),
        read in the same synchronisation and kept as `read_values` (None when nothing is read: an export).
        `window_size`: this pass's, where it is not the config's (`config.training_window_sizes`).
        """
        window, overlap = window_size or config.window_size, config.window_overlap
        total_lengths = None
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
        read_values = None
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
            read = [torch.stack(sizes)]
            if past_lengths is not None:  # a cache's rows' lengths after this pass, for its decoding steps
                read.append(total)
            if read_with_sizes is not None:  # the caller's values, read in the same synchronisation
                read.append(read_with_sizes.to(device))
            found = torch.cat(read).tolist()
            (num_tokens, num_tail, num_packed, num_steps, longest, longest_tail, longest_next_tail, continued_rows,
             cell_capacity, most_finished_windows) = found[:10]  # fmt: skip
            if past_lengths is not None:
                total_lengths, found = found[10 : 10 + batch_size], found[:10] + found[10 + batch_size :]
            read_values = found[10:]
        token_index = true_positions(real.flatten(), num_tokens)  # (T,)
        empty = num_tokens + num_tail
        new_start, tail_start = group_starts(lengths), num_tokens + group_starts(tail_lengths)  # (B,) each

        def source_index(rows, position):
            """Index in [new; cached tail] of the token at sequence `position` of row `rows`."""
            from_new = new_start[rows] + position - past[rows]
            from_tail = tail_start[rows] + position - (past[rows] - tail_lengths[rows])
            return torch.where(position >= past[rows], from_new, from_tail)

        # 2. Pack the windows of all sequences step-major: every sequence's first window, then every second one, ...
        # (in batch order within a step). When all sequences have the same number of windows, the scan's
        # step-major view of the windows is then the packed tensor itself: no copy either way.
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
            has_window = torch.arange(num_steps, device=device)[:, None] < num_windows  # (N, B)
            grid_position = true_positions(has_window.flatten(), num_packed)  # (K,) step * B + sequence
            window_sequence, window_number = grid_position % batch_size, grid_position // batch_size
            step_windows = torch.where(
                has_window, torch.cumsum(has_window.flatten(), 0).view_as(has_window) - 1, num_packed
            )

        # 3. Place every window's tokens in its slots: enrichment first, then its own tokens.
        absolute_window = first_window[window_sequence] + window_number  # (K,)
        start = absolute_window * window  # (K,) first own token in the sequence
        is_last = window_number == num_windows[window_sequence] - 1
        end = torch.where(is_last, total[window_sequence], start + window)  # (K,)
        first_slot = start - torch.where(absolute_window > 0, overlap, 0)  # (K,) sequence position of slot 0
        # Slots no window can fill are not made: a window holds at most the tokens this pass gives it (with those it
        # reads again from the cache), however large `window_size` is.
        num_slots = overlap + own_slots if bounded else min(overlap + own_slots, max(longest_tail, overlap) + longest)
        position = first_slot[:, None] + torch.arange(num_slots, device=device)  # (K, S)
        slot_mask = position < end[:, None]
        if bounded:
            end = torch.where(has_window, end, start)  # an empty window has no queries ...
            slot_mask = slot_mask & has_window[:, None]  # ... and no slots
        rows = window_sequence[:, None].expand_as(position)
        window_slots = torch.where(slot_mask, source_index(rows, position), empty)

        # 4. Pick the queries: only new own tokens need an output (a decoding step asks one per window, not S).
        first_query = torch.maximum(start, past[window_sequence])  # (K,) sequence position of the first query
        offset = torch.arange(own_slots if bounded else min(longest, own_slots), device=device)  # (Q,)
        is_query = offset < (end - first_query)[:, None]  # (K, Q)
        query_slots = torch.where(is_query, (first_query - first_slot)[:, None] + offset, 0)
        if bounded:
            # Windows in batch order hold the new tokens in their order: query q of window k is simply the next one
            # (and the padding "tokens" after the real ones take the slots no query uses, zeroed on the way out).
            query_index = torch.where(is_query, torch.cumsum(is_query.flatten(), 0).view_as(is_query) - 1, num_tokens)
            output_slot = true_positions(is_query.flatten(), num_tokens)  # (T,)
        else:
            first_new = new_start[window_sequence] + first_query - past[window_sequence]  # (K,) index of query 0
            query_index = torch.where(is_query, first_new[:, None] + offset, num_tokens)  # (K, Q)
            # Every new token is the query of exactly one window: the inverse map, (T,) token -> k * Q + q.
            slots = torch.arange(is_query.numel(), device=device)
            output_slot = slots.new_empty(num_tokens + 1).scatter_(0, query_index.flatten(), slots)[:num_tokens]
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
            read_values=read_values,
            total_lengths=total_lengths,
        )

    def for_cell_scan(self) -> "RANWindowLayout":
        """The layout the cell scan reads. A prefix LM's cell sits in the source, so it reads the source slots only:
        given as the slot mask, which every scan implementation takes."""
        if self.slot_is_source is None:
            return self
        return dataclasses.replace(self, slot_mask=self.slot_is_source)

    def step_major(self, keys: torch.Tensor, values: torch.Tensor):
        """The window slots each cell-scan step reads: (K, H, S, d) window keys and values -> (N, B, H, S, d) and
        their (N, B, S) mask.

        A sequence that has run out of windows reads its first one with every slot masked (its results are never
        used). One sequence needs no gather at all.
        """
        if self.full_grid:  # every sequence has every step's window, packed step-major: a view
            steps = (self.num_steps, self.batch_size)  # (`view`, not the Python `unflatten`: a per-call path)
            return (
                keys.view(*steps, *keys.shape[1:]),
                values.view(*steps, *values.shape[1:]),
                self.slot_mask.view(*steps, -1),
            )
        has_window = self.step_windows < keys.shape[0]  # (N, B)
        windows = torch.where(has_window, self.step_windows, 0)
        step_mask = self.slot_mask[windows] & has_window[..., None]  # (N, B, S)
        return gather_rows(keys, windows), gather_rows(values, windows), step_mask

    def sources(self, token_states: torch.Tensor, tail_states: torch.Tensor | None = None) -> torch.Tensor:
        """[new tokens; cached tail; an empty row]: what window slots and the next tail index into."""
        parts = [token_states]
        if tail_states is not None:
            # A cache whose rows were reselected (beam search) may be wider than its longest tail now.
            parts.append(tail_states[:, : self.cached_tail_width].flatten(0, 1)[self.cached_tail])
        parts.append(token_states.new_zeros(1, *token_states.shape[1:]))
        return torch.cat(parts)

    def gather_sources(self, token_states: torch.Tensor, index: torch.Tensor, tail_states=None) -> torch.Tensor:
        """`sources(token_states, tail_states)` at `index` (window slots or query slots). Without a tail, gathered
        from the tokens themselves and the empty row's slots filled with zeros: no copy of every token's states is
        made only to append the empty row to them."""
        num_tokens = token_states.shape[0]
        if tail_states is not None or num_tokens == 0:
            return gather_rows(self.sources(token_states, tail_states), index)
        empty = (index == num_tokens).view(*index.shape, *(1,) * (token_states.dim() - 1))
        return gather_rows(token_states, index.clamp(max=num_tokens - 1)).masked_fill_(empty, 0)

    def rotary(self, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
        """Rotations (S, d / 2, 2) of window slots (slot s is position s + 1; the cell sits at 0), built once a
        pass."""
        if self._rotary is None:
            self._rotary = rotary_rotations(self.num_slots + 1, head_dim, theta, device)[1:]
        return self._rotary

    def token_slots(self) -> torch.Tensor:
        """(T, 2) the slots k * S + s each new token fills, built once a pass: its own window's, and with
        `window_overlap` an enrichment slot of the next window (-1: none). The inverse of `window_slots`, as
        `output_slot` is of `query_index`; a token fills at most two slots, the overlap being shorter than a window."""
        if self._token_slots is None:
            num_tokens, slots = self.output_slot.shape[0], self.window_slots.flatten()
            target = torch.where(self.slot_mask.flatten() & (slots < num_tokens), slots, num_tokens)
            ids = torch.arange(slots.shape[0], device=slots.device)
            first = ids.new_full((num_tokens + 1,), slots.shape[0]).scatter_reduce(0, target, ids, "amin")
            last = ids.new_full((num_tokens + 1,), -1).scatter_reduce(0, target, ids, "amax")
            second = torch.where(last != first, last, -1)
            self._token_slots = torch.stack([first, second], dim=-1)[:num_tokens]
        return self._token_slots

    def from_windows(self, query_states: torch.Tensor) -> torch.Tensor:
        """(K, Q, F) outputs of the query slots -> (T, F): each new token's state."""
        return gather_rows(query_states.flatten(0, 1), self.output_slot)

    def to_padded(self, token_states: torch.Tensor) -> torch.Tensor:
        """(T, F) flat token features -> (B, L, F), zeros at padding; a view where there is no padding."""
        if self.unpadded:
            return token_states.view(self.batch_size, self.padded_length, -1)
        if self.real_tokens is not None:
            token_states = token_states * self.real_tokens
        padded = token_states.new_zeros(self.batch_size * self.padded_length, token_states.shape[-1])
        padded[self.token_index] = token_states
        return padded.view(self.batch_size, self.padded_length, -1)

    def from_padded(self, padded_states: torch.Tensor) -> torch.Tensor:
        """(B, L, F) -> (T, F): the real tokens only; a view where there is no padding."""
        if self.unpadded:
            return padded_states.flatten(0, 1)
        return gather_rows(padded_states.flatten(0, 1), self.token_index)

    def to_windows(self, token_states: torch.Tensor) -> torch.Tensor:
        """(T, F) -> (K, Q, F): the inverse of `from_windows`, zeros at unused query slots."""
        num_windows, num_queries = self.query_slots.shape
        windows = token_states.new_zeros(num_windows * num_queries, token_states.shape[-1])
        windows[self.output_slot] = token_states
        return windows.view(num_windows, num_queries, -1)

    def weights_per_token(self, weights: torch.Tensor) -> torch.Tensor:
        """(K, H, Q, X) attention weights of the windows' queries -> (B, H, L, X) those of each token, zeros at
        padding."""
        num_heads, num_keys = weights.shape[1], weights.shape[-1]
        per_token = self.from_windows(weights.transpose(1, 2).flatten(-2))  # (T, H * X)
        return self.to_padded(per_token).unflatten(-1, (num_heads, num_keys)).transpose(1, 2)

    def weights_per_window(self, token_weights: torch.Tensor) -> torch.Tensor:
        """(B, H, L, X) -> (K, H, Q, X): the inverse of `weights_per_token`."""
        num_heads, num_keys = token_weights.shape[1], token_weights.shape[-1]
        per_token = self.from_padded(token_weights.transpose(1, 2).flatten(-2))  # (T, H * X)
        return self.to_windows(per_token).unflatten(-1, (num_heads, num_keys)).transpose(1, 2)

    def window_attention_mask(self, causal: bool, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (K, 1, 1 or Q, 1 + S) of the window attention, whose keys are the read cell, then the slots:
        empty slots hidden; causal, a query sees the slots up to its own; a prefix LM's (UniLM) query sees the whole
        source and its own past. The cell is always visible, so no row is fully masked: one mask suits every
        attention implementation."""
        visible = F.pad(self.slot_mask, (1, 0), value=True)[:, None, None, :]  # (K, 1, 1, 1 + S)
        if causal or self.slot_is_source is not None:
            key_slot = torch.arange(-1, self.num_slots, device=visible.device)  # the cell is "slot -1"
            earlier = key_slot <= self.query_slots[:, :, None]  # (K, Q, 1 + S)
            if self.slot_is_source is not None:
                earlier = earlier | F.pad(self.slot_is_source, (1, 0))[:, None, :]
            visible = visible & earlier[:, None]  # (K, 1, Q, 1 + S)
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        return mask.masked_fill(~visible, torch.finfo(dtype).min)

    def last_cells(self, cells: torch.Tensor, start_cell: torch.Tensor) -> torch.Tensor:
        """(N, B, D) cells of the scan steps -> (B, D) each sequence's last one, which starts the next layer; a row of
        padding only keeps the cell it started from. A prefix LM's is the cell after its source: the windows after
        it are as many as the target is long."""
        cell_windows = self.num_windows if self.source_windows is None else self.source_windows
        last_step = (cell_windows - 1).clamp(min=0)
        rows = torch.arange(self.batch_size, device=last_step.device)
        return torch.where((cell_windows > 0)[:, None], cells[last_step, rows], start_cell)

    @property
    def unpadded(self) -> bool:
        """Whether every position of the (B, L) input is a real token (packed pretraining batches): the flat (T, ...)
        tokens are then the padded (B, L, ...) ones, and moving between the two is a reshape, not a scatter."""
        return self.real_tokens is None and self.token_index.shape[0] == self.batch_size * self.padded_length

    @property
    def full_grid(self) -> bool:
        """Whether the packed windows are exactly (scan step, sequence) in step-major order, every sequence having
        the same number of windows: the scan's (N, B, ...) view of them is then a reshape, not a gather."""
        return self.real_tokens is None and self.window_sequence.shape[0] == self.num_steps * self.batch_size

    def after_last_finished(self, steps: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """(N, B, ...) per scan step -> (B, ...) each row's entry after the last window it finished in this pass, or
        `start` for a row that finished none: what a cache keeps of a causal pass."""
        if not steps.numel():
            return start
        finished_here = self.finished_windows - self.first_window
        last = (finished_here - 1).clamp(min=0)
        rows = torch.arange(last.shape[0], device=last.device)
        has_finished = (finished_here > 0).view(-1, *[1] * (start.dim() - 1))
        return torch.where(has_finished, steps[last, rows], start)

    def per_sequence(self, step_states: torch.Tensor) -> torch.Tensor:
        """(N, B, F) per-step states -> (K, F) the state of every packed window."""
        if self.full_grid:
            return step_states.flatten(0, 1)
        return gather_rows(step_states.flatten(0, 1), self.window_number * self.batch_size + self.window_sequence)
