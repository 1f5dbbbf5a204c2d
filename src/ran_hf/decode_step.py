"""A decoding step of a causal RAN: one new token per row, read against the cache in fixed shapes.

The general forward pass (ran_layer.py) lays out windows for any number of new tokens, which costs a host read of
the layout's sizes and a few hundred small ops. A decoding step needs none of it: each row's new token joins its
current window at the slot after the cached tail, attends over the read cell and that window, reviews the cached
cells, and, where it ends its window, the cell scan takes one step. Every shape is the cache's own (a tail of
`window_size - 1 + window_overlap` slots, a fixed room of cells), so the step reads nothing to the host and
compiles into one graph that a GPU can replay.

`decode_layer` computes one layer's step and returns the layer's new cache state without writing it; `RANModel`
writes every layer's state once all layers have run, so that a step that fails leaves the cache as it was.

Between eager steps the cache also keeps what stays the same until a window ends (`RANCacheLayer.step_window`,
`step_review`): the window as attention reads it, rotated, with the read cell's key and value in slot 0, and the
cells memory review reads with their score bias. A step then projects, rotates and writes only its own token; the
step after a window ends rebuilds them, and a compiled step, which cannot ask whether they are there, builds them
every time.

Shapes: B batch, H heads, d head size, D hidden size, S window slots (the tail plus the new token), C cached cells.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .building_blocks import rotary_rotations, rotate_pairs_complex
from .cache_ran import RANCache, RANCacheLayer
from .cell_scan import cell_step
from .fused_scan import window_maxima
from .scan_dropout import NO_DROPOUT


class StepSettings(NamedTuple):
    """The config fields a step reads, read once when the config is checked (`RANPreTrainedModel.check_config`)."""

    window_size: int
    window_overlap: int
    review_initial_cell: bool
    memory_review_cells: int | None
    head_dim: int
    rope_theta: float


def step_settings(config) -> StepSettings | None:
    """What decoding steps read of `config`, or None where they do not run: an encoder, and the options a step does
    not compute (the associative memory, salient cells) or what it does not record (attentions, hidden states)."""
    if (
        not config.is_causal
        or config.associative_memory
        or config.memory_salient_cells is not None
        or config.output_attentions
        or config.output_hidden_states
    ):
        return None
    return StepSettings(
        config.window_size, config.window_overlap, config.review_initial_cell, config.memory_review_cells,
        config.head_dim, config.rope_theta,
    )  # fmt: skip


class StepPositions(NamedTuple):
    """Where every row's new token sits, shared by all layers of a step."""

    slot: torch.Tensor  # (B,) the new token's window slot: the length of the row's cached tail
    key_slot: torch.Tensor  # (B,) its place among the keys window attention reads: after the read cell's
    rows: torch.Tensor  # (B,) 0, 1, ...
    window: torch.Tensor  # (B,) the number of the token's window in its row
    visible: torch.Tensor  # (B, S) the slots the token reads: its tail and itself
    attention_bias: torch.Tensor  # (B, 1, 1, 1 + S) 0 for the keys the token reads (its read cell, `visible`), -inf
    token_rotations: torch.Tensor  # (B, 1, 1, d / 2) the token's rotary embedding, complex (slot s: position s + 1)
    key_rotations: torch.Tensor  # (S, 1, d / 2) every slot's
    ends_window: torch.Tensor  # (B,) the token is the last of its window: the cell scan takes a step
    scan_runs: bool  # whether any row ends a window (always, compiled: the step cannot ask)
    cells_read: int | None  # eager, unbounded: the cached cells any row reads (the room's rest is empty); else None
    first_readable: torch.Tensor | None  # (B, 1) the first cached cell the token's memory review reads (None: 0)
    readable: torch.Tensor  # (B, 1) the cells it reads end before this one (0: it reads none)
    review_mask: tuple | None = None  # memory review's (B, C) hidden cells and (B, 1) readable, for all layers


def step_positions(config: StepSettings, cache: RANCache, device: torch.device) -> StepPositions:
    """Where the new tokens go, from the lengths the cache has read (on the device; on the host only to skip the
    cell scan in a step where no row ends a window)."""
    window_size, overlap = config.window_size, config.window_overlap
    past = cache.lengths  # (B,)
    window, within = past // window_size, past % window_size
    slot = torch.minimum(past, within + overlap) if overlap else within  # (a first window has no enrichment)
    key_slot = slot + 1  # among the keys attention reads, after the read cell's; the rotary position of slot s too
    num_slots = cache.tail_slots
    reads = torch.arange(1 + num_slots, device=device) <= key_slot[:, None]  # (B, 1 + S): the cell, then the slots
    rotations = step_rotations(config, num_slots, device)
    ends_window = within == window_size - 1
    scan_runs, cells_read = True, None
    if not torch.compiler.is_compiling():
        lengths = cache.known_lengths()
        scan_runs = any((length + 1) % window_size == 0 for length in lengths)
        if config.memory_review_cells is None:
            cells_read = max(lengths) // window_size
    # Memory review: window w reads the cells of windows before it (the last `memory_review_cells`), after the
    # layer's starting cell where `review_initial_cell` puts it first. Unbounded, cached cell c is window c's; bounded,
    # the M cached cells are right-aligned, the last being window w - 1's.
    initial = int(config.review_initial_cell)
    bound = config.memory_review_cells
    if bound is None:
        first_readable, readable = None, (window + initial)[:, None]
    else:
        # (a token of the first window reads no cached cell: its range is empty, not hidden, so its review is zero)
        reads_cells = window > 0
        first_readable = torch.where(reads_cells, (bound - window).clamp(min=0) + initial, 0)[:, None]
        readable = torch.where(reads_cells, bound + initial, initial)[:, None]
    return StepPositions(
        slot=slot,
        rows=torch.arange(past.shape[0], device=device),
        # (an additive mask: SDPA turns a boolean one into this in every layer)
        attention_bias=torch.where(reads, 0.0, float("-inf"))[:, None, None],
        window=window,
        visible=reads[:, 1:],
        key_slot=key_slot,
        token_rotations=rotations[key_slot][:, None, None],
        key_rotations=rotations[1:][:, None],
        ends_window=ends_window,
        scan_runs=scan_runs,
        cells_read=cells_read,
        first_readable=first_readable,
        readable=readable,
    )


_ROTATIONS: dict = {}


def step_rotations(config: StepSettings, num_slots: int, device: torch.device) -> torch.Tensor:
    """(1 + S, d / 2) the rotary embedding of the cell (position 0) and of every slot as complex numbers, made once
    per device."""
    if torch.compiler.is_compiling():  # a constant of the graph
        return torch.view_as_complex(rotary_rotations(num_slots + 1, config.head_dim, config.rope_theta, device))
    key = (num_slots, config.head_dim, config.rope_theta, device)
    if key not in _ROTATIONS:
        rotations = rotary_rotations(num_slots + 1, config.head_dim, config.rope_theta, device)
        _ROTATIONS[key] = torch.view_as_complex(rotations)
    return _ROTATIONS[key]


class LayerStep(NamedTuple):
    """A layer's cache state after a step, written by `write_step`."""

    cell: torch.Tensor
    previous_raw_cell: torch.Tensor
    cell_states: torch.Tensor | None
    tail_keys: torch.Tensor
    tail_values: torch.Tensor
    window: tuple | None  # the window as attention read it, where it stays the cache's (`current_window`)


def decode_layer(layer, states: torch.Tensor, cache: RANCacheLayer, at: StepPositions, config: StepSettings):
    """One layer's decoding step: states (B, D) of the new tokens -> their states after the layer (B, D), and the
    layer's cache state after the step (`LayerStep`)."""
    # 1. The new token's query, key and value, rotated together (they share a position), and its window.
    normed = layer.normalize_input(states)  # (B, D)
    qkv = layer.project(normed)  # (B, 3, H, d)
    rotated_query, rotated_key = rotate_pairs_complex(qkv[:, :2], at.token_rotations).unbind(1)  # (B, H, d) each
    _, key, value = qkv.unbind(1)
    keys = cache.tail_keys.index_put((at.rows, at.slot), key)  # (B, S, H, d), un-rotated: what the cache keeps
    values = cache.tail_values.index_put((at.rows, at.slot), value)  # (B, S, H, d)
    window_keys, window_values = current_window(layer, cache, keys, values, rotated_key, value, at)

    # 2. Token attention over the read cell (position 0, not rotated) and the window's visible slots.
    attended = F.scaled_dot_product_attention(
        rotated_query[:, :, None], window_keys, window_values, at.attention_bias
    ).flatten(1)  # (B, H * d)
    if layer.residual_stream:
        token = states + layer.attention_output(attended, normed)
    else:
        token = layer.finish_attention(attended, normed)
        token = token if layer.reviews_memory else layer.output_norm(token)

    # 3. Where a row's token ends its window, the cell scan's step for that window. Before memory review, which does
    # not read the window's own cell: a compiled step writes it into the room first, in place, and reviews the room
    # it wrote (a graph that read the room before writing it in place would copy all of it).
    cell, previous_raw, cell_states = cache.cell, cache.previous_raw_cell, cache.cell_states
    tail_keys, tail_values = keys, values
    if at.scan_runs:
        rotated_keys, slot_values = window_keys[:, :, 1:], window_values[:, :, 1:]  # (B, H, S, d)
        raw, new_cell = scan_step(layer, cell, previous_raw, rotated_keys, slot_values, at)
        ends = at.ends_window[:, None]
        cell, previous_raw = torch.where(ends, new_cell, cell), torch.where(ends, raw, previous_raw)
        if layer.reviews_memory:
            cell_states = remember_cell(layer.memory_review.project_cells(raw), cell_states, at, config)
        tail_keys, tail_values = (next_tail(slots, at, config.window_overlap) for slots in (keys, values))
        window_keys = window_values = None  # the window and the cell change: the next step rebuilds them

    # 4. Memory review of the cached cells (the layer's starting cell first, where it reads it).
    if layer.reviews_memory:
        first_cell, cells, score_bias = reviewed_cells(layer, cache, at, config)
        token = layer.memory_review.read_cells(token, cells, score_bias, at.review_mask[1], first_cell)[0]
    window = None if torch.compiler.is_compiling() or window_keys is None else (window_keys, window_values)
    return token, LayerStep(cell, previous_raw, cell_states, tail_keys, tail_values, window)


def current_window(layer, cache: RANCacheLayer, keys, values, rotated_key, value, at: StepPositions):
    """The keys and values (B, H, 1 + S, d) window attention reads: the read cell's (slot 0, not rotated), then the
    window's slots, rotated, the new token's written in. Kept in the cache between eager steps (`step_window`), where
    a step writes only its token's; built from the cached tail and cell where the cache has none (after a window
    ended, or any other update of the state) and in every compiled step, which cannot ask."""
    if cache.step_window is not None and not torch.compiler.is_compiling():
        window_keys, window_values = cache.step_window
        # In place, into the slot after each row's tail: no step reads it before the one that writes it, so a step
        # that fails and is run again leaves nothing behind.
        window_keys[at.rows, :, at.key_slot] = rotated_key
        window_values[at.rows, :, at.key_slot] = value
        return window_keys, window_values
    _, cell_key, cell_value = layer.project(layer.normalize_input(cache.cell)).unbind(1)  # (B, H, d) each
    # (Joined heads-first: joined slot-first and then transposed, inductor wrote wrong values into the cached tail.)
    rotated_keys = rotate_pairs_complex(keys, at.key_rotations).transpose(1, 2)  # (B, H, S, d)
    window_keys = torch.cat([cell_key[:, :, None], rotated_keys], dim=2)  # (B, H, 1 + S, d)
    window_values = torch.cat([cell_value[:, :, None], values.transpose(1, 2)], dim=2)
    return window_keys, window_values


def reviewed_cells(layer, cache: RANCacheLayer, at: StepPositions, config: StepSettings):
    """What memory review reads: the layer's starting cell's key and value (1, 2 D) where it reads it and a compiled
    step runs (else None), the cells' (B, C, 2 D), and every one's score bias (B, 1 + C) or (B, C)
    (`RANMemoryReview.score_bias`). A compiled step rebuilds them every step and reads the starting cell apart: joined
    to the cached cells it would copy the whole room each time. Between eager steps they stay the same until a window
    ends (`step_review`), so there the starting cell is joined to the cached ones once, and each step reads them all
    in one product."""
    if cache.step_review is not None and not torch.compiler.is_compiling():
        return cache.step_review
    cells, hidden = cache.cell_states, at.review_mask[0]
    if at.cells_read is not None:  # not the room's empty rest, which every token would score and hide again
        cells, hidden = cells[:, : at.cells_read], hidden[:, : at.cells_read + config.review_initial_cell]
    review = layer.memory_review
    first_cell = None
    if config.review_initial_cell:
        first_cell = review.project_cells(layer.initial_cell[None]).to(cells.dtype)
    score_bias = review.score_bias(cells, hidden, first_cell)
    if torch.compiler.is_compiling():
        return first_cell, cells, score_bias
    if first_cell is not None:
        cells = torch.cat([first_cell[None].expand(cells.shape[0], 1, -1), cells], dim=1)
    cache.step_review = None, cells, score_bias
    return cache.step_review


def scan_step(layer, cell, previous_raw, rotated_keys, window_values, at: StepPositions):
    """The cell scan's step for the window each row's token ends (`cell_scan.cell_step`): the raw cell and the cell
    (B, D). In the weights' dtype under autocast, as the scan runs: the cell is a running state."""
    device = cell.device.type
    if device != "meta" and torch.is_autocast_enabled(device):
        dtype = layer.qkv_proj.weight.dtype
        with torch.autocast(device, enabled=False):
            return scan_step(
                layer, cell.to(dtype), previous_raw.to(dtype), rotated_keys.to(dtype), window_values.to(dtype), at
            )
    scan = layer.cell_scan
    maxima = None
    if scan.cell_max_pool:
        maxima = window_maxima(window_values[None], at.visible[None])[0]  # (B, H, d)
    continues = (at.window > 0)[:, None] if scan.use_cell_residual else None
    _, _, raw, new_cell = cell_step(
        scan, layer.cell_scan_weights(), cell, previous_raw, rotated_keys, window_values, at.visible, maxima,
        NO_DROPOUT, continues,
    )  # fmt: skip
    return raw, new_cell


def remember_cell(projected, cell_states: torch.Tensor, at: StepPositions, config: StepSettings) -> torch.Tensor:
    """The cached cells after the windows that end here wrote theirs (`projected` (B, 2 D)): unbounded, into the
    window's place; bounded, after the last M - 1 (right-aligned)."""
    ends = at.ends_window[:, None]
    if config.memory_review_cells is not None:
        shifted = torch.cat([cell_states[:, 1:], projected[:, None].to(cell_states.dtype)], dim=1)
        return torch.where(ends[..., None], shifted, cell_states)
    rows = torch.arange(cell_states.shape[0], device=cell_states.device)
    place = at.window.clamp(max=cell_states.shape[1] - 1)
    written = torch.where(ends, projected.to(cell_states.dtype), cell_states[rows, place])
    if torch.compiler.is_compiling():
        # A compiled step runs this in every step, ended window or not: written out of place, it would copy the whole
        # room each time. In place, a row's cell goes where no token reads yet (its own window's place), so a step
        # that fails and is run again leaves nothing behind (as `current_window`'s writes). None: the cache holds it
        # (a graph that returned the tensor it writes in place would copy it all the same).
        cell_states.index_put_((rows, place), written)
        return None
    return cell_states.index_put((rows, place), written)


def next_tail(slots: torch.Tensor, at: StepPositions, overlap: int) -> torch.Tensor:
    """(B, S, H, d) the window's slots with the new token -> the tail the next step reads: the same, or for a row
    whose window ended, the last `overlap` tokens of it (the next window's enrichment), zeros after."""
    ends = at.ends_window[:, None, None, None]
    if overlap == 0:
        return slots.masked_fill(ends, 0)
    offsets = torch.arange(slots.shape[1], device=slots.device)
    index = (at.slot[:, None] + 1 - overlap + offsets).clamp(max=slots.shape[1] - 1)  # (B, S)
    moved = slots.gather(1, index[..., None, None].expand(-1, -1, *slots.shape[2:]))
    moved = moved.masked_fill((offsets >= overlap)[None, :, None, None], 0)
    return torch.where(ends, moved, slots)


def write_step(layer_cache: RANCacheLayer, step: LayerStep, scan_ran: bool) -> None:
    review = None if scan_ran else layer_cache.step_review  # the reviewed cells stay until a window ends
    if scan_ran:  # the cell may have changed
        layer_cache.update_recurrent_state(step.cell)
    layer_cache.previous_raw_cell = step.previous_raw_cell
    if step.cell_states is not None:
        layer_cache.update_cell_states(step.cell_states)
    layer_cache.update_tail(step.tail_keys, step.tail_values)  # (each update drops the step memos ...)
    layer_cache.step_window, layer_cache.step_review = step.window, review  # (... which still hold)
