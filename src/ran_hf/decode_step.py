"""Where a decoding step's token goes: the step's counterpart of the window layout (window_layout.py), and what the
cache keeps after it.

A decoding step reads one new token per row against the cache, in shapes that do not change from step to step: the
token joins its window at the slot after the cached tail, attends over the read cell and that window, reviews the
cached cells and, where it ends its window, the cell scan takes one step. The maths is the layer's own: `RANLayer`,
its window attention, cell scan and memory review each hold a step branch beside their many-token forward, chosen by
the layout they are handed (`StepPositions` here, `RANWindowLayout` for any other call). This module holds what they
share: the positions (`step_positions`, once per step for all layers) and the cache writes after a step
(`next_tail`, `remember_cell`). It reads nothing to the host in a compiled step, which compiles into one graph.

Between eager steps the cache also keeps what stays the same until a window ends (`RANCacheLayer.step_window`,
`step_review`): the window as attention reads it, rotated, with the read cell's key and value in slot 0, and the
cells memory review reads with their score bias. They hold while the cache holds the state they were built from
(`memo_of`), so that nothing that updates the cache has to drop them. A compiled step, which cannot ask whether they
are there, builds them every time.

Shapes: B batch, H heads, d head size, D hidden size, S window slots (the tail plus the new token), C cached cells.
"""

from typing import NamedTuple

import torch

from .building_blocks import rotary_rotations


def decodes_in_steps(config) -> bool:
    """Whether a causal model's one-token calls against a cache take the step branch: not for an encoder, nor for the
    options a step does not compute (salient cells) or record (attentions, hidden states), which take the general
    forward pass."""
    return bool(
        config.is_causal
        and config.memory_salient_cells is None
        and not config.output_attentions
        and not config.output_hidden_states
    )


class StepSettings(NamedTuple):
    """The config's fields a step reads, read once after each edit of it (`RANPreTrainedModel.check_config`), not at
    every step: a config read runs three Python calls through Transformers' `__getattribute__`."""

    window_size: int
    window_overlap: int
    use_rotary: bool
    head_dim: int
    rope_theta: float
    memory_review_cells: int | None
    review_initial_cell: bool
    attn_implementation: str  # window attention's function, looked up by this name in each step
    key_conv: int  # the associative memory's key convolution width (0: none, or no memory)
    hidden_size: int  # what a step's inputs are checked against
    vocab_size: int


def step_settings(config) -> StepSettings:
    return StepSettings(
        config.window_size, config.window_overlap, config.use_rotary, config.head_dim,
        config.rope_parameters["rope_theta"], config.memory_review_cells, config.review_initial_cell,
        config._attn_implementation, config.associative_key_conv if config.associative_memory else 0,
        config.hidden_size, config.vocab_size,
    )  # fmt: skip


class StepPositions(NamedTuple):
    """Where every row's new token sits, shared by all layers of a step: the layout a step hands the layer's modules."""

    slot: torch.Tensor  # (B,) the new token's window slot: the length of the row's cached tail
    key_slot: torch.Tensor  # (B,) its place among the keys window attention reads: after the read cell's
    rows: torch.Tensor  # (B,) 0, 1, ...
    window: torch.Tensor  # (B,) the number of the token's window in its row
    visible: torch.Tensor  # (B, S) the slots the token reads: its tail and itself
    attention_bias: torch.Tensor  # (B, 1, 1, 1 + S) in the states' dtype: 0 for the keys the token reads, else -inf
    # (B, 1, 1, d / 2) the token's rotary embedding, complex (compiled: real pairs, one more axis of 2); None: no rotary
    token_rotations: torch.Tensor | None
    key_rotations: torch.Tensor | None  # (S, 1, d / 2) every slot's (slot s: position s + 1)
    ends_window: torch.Tensor  # (B,) the token is the last of its window: the cell scan takes a step
    scan_runs: bool  # whether any row ends a window (always, compiled: the step cannot ask)
    cells_read: int | None  # eager, unbounded: the cached cells any row reads (the room's rest is empty); else None
    first_readable: torch.Tensor | None  # (B, 1) the first cached cell the token's memory review reads (None: 0)
    readable: torch.Tensor  # (B, 1) the cells it reads end before this one (0: it reads none)
    reads_cells: torch.Tensor  # (B, 1) whether the token reviews any cell
    # (B, c) the slots whose keys the associative memory's key convolution mixes into the token's: its own slot, then
    # the c - 1 before it, clamped at slot 0; and (B, c, 1, 1) which of them are in the window. None: no convolution
    key_lag_slots: torch.Tensor | None
    key_lag_in_window: torch.Tensor | None
    compiled: bool  # inside `torch.compile`: nothing is read to the host, and no step memo is kept
    settings: StepSettings


def step_positions(
    settings: StepSettings, cache, lengths: list[int] | None, dtype: torch.dtype, device: torch.device
) -> StepPositions:
    """Where the new tokens go, from the lengths the cache has read (on the device; on the host, `lengths`, only to
    skip the cell scan in a step where no row ends a window: None in a compiled step, which reads nothing to the
    host). `dtype`: the states', which attention's bias takes."""
    window_size, overlap = settings.window_size, settings.window_overlap
    compiled = lengths is None
    past = cache.lengths  # (B,)
    window, within = torch.div(past, window_size, rounding_mode="floor"), past % window_size
    slot = torch.minimum(past, within + overlap) if overlap else within  # (a first window has no enrichment)
    key_slot = slot + 1  # among the keys attention reads, after the read cell's; the rotary position of slot s too
    num_slots = cache.tail_slots
    reads = torch.arange(1 + num_slots, device=device) <= key_slot[:, None]  # (B, 1 + S): the cell, then the slots
    token_rotations = key_rotations = None
    if settings.use_rotary:
        rotations = step_rotations(settings, num_slots, dtype, device, compiled)
        token_rotations, key_rotations = rotations[key_slot][:, None, None], rotations[1:][:, None]
    ends_window = within == window_size - 1
    scan_runs, cells_read = True, None
    if not compiled:
        scan_runs = window_size - 1 in [length % window_size for length in lengths]
        if settings.memory_review_cells is None:
            cells_read = max(lengths) // window_size
    # Memory review: window w reads the cells of windows before it (the last `memory_review_cells`), after the
    # layer's starting cell where `review_initial_cell` puts it first. Unbounded, cached cell c is window c's; bounded,
    # the M cached cells are right-aligned, the last being window w - 1's.
    initial = int(settings.review_initial_cell)
    bound = settings.memory_review_cells
    if bound is None:
        first_readable, readable = None, (window + initial)[:, None]
    else:
        # (a token of the first window reads no cached cell: its range is empty, not hidden, so its review is zero)
        reads_any = window > 0
        first_readable = torch.where(reads_any, (bound - window).clamp(min=0) + initial, 0)[:, None]
        readable = torch.where(reads_any, bound + initial, initial)[:, None]
    key_lag_slots = key_lag_in_window = None
    if settings.key_conv:
        lags = slot[:, None] - torch.arange(settings.key_conv, device=device)
        key_lag_slots, key_lag_in_window = lags.clamp(min=0), (lags >= 0)[..., None, None]
    return StepPositions(
        slot=slot,
        key_slot=key_slot,
        rows=torch.arange(past.shape[0], device=device),
        window=window,
        visible=reads[:, 1:],
        # (an additive mask in the states' dtype: attention adds it to float64 scores too)
        attention_bias=torch.where(reads, 0.0, float("-inf")).to(dtype)[:, None, None],
        token_rotations=token_rotations,
        key_rotations=key_rotations,
        ends_window=ends_window,
        scan_runs=scan_runs,
        cells_read=cells_read,
        first_readable=first_readable,
        readable=readable,
        reads_cells=readable > 0,
        key_lag_slots=key_lag_slots,
        key_lag_in_window=key_lag_in_window,
        compiled=compiled,
        settings=settings,
    )


_ROTATIONS: dict = {}


def step_rotations(
    settings: StepSettings, num_slots: int, dtype: torch.dtype, device: torch.device, compiled: bool
) -> torch.Tensor:
    """(1 + S, d / 2) the rotary embedding of the cell (position 0) and of every slot as complex numbers, made once per
    device and dtype: the window layout's float32 angles, as complex128 for float64 states. Compiled, a constant of
    the graph, as real pairs (1 + S, d / 2, 2): inductor generates no code for complex products."""
    real_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    head_dim, theta = settings.head_dim, settings.rope_theta
    if compiled:
        return rotary_rotations(num_slots + 1, head_dim, theta, device).to(real_dtype)
    key = (num_slots, head_dim, theta, real_dtype, device)
    if key not in _ROTATIONS:
        rotations = rotary_rotations(num_slots + 1, head_dim, theta, device)
        _ROTATIONS[key] = torch.view_as_complex(rotations.to(real_dtype))
    return _ROTATIONS[key]


ROOM_EXHAUSTED = (
    "A compiled decoding step ran past the room its RANCache holds for cells: give it room for every token first, "
    "`RANCache(config, max_cache_len=N)` or `cache.reserve(N)` (generate() reserves max_new_tokens itself)."
)


def remember_cell(projected, cell_states: torch.Tensor, at: StepPositions) -> torch.Tensor | None:
    """The cached cells after the windows that end here wrote theirs (`projected` (B, 2 D)): unbounded, into the
    window's place; bounded (`memory_review_cells`), after the last M - 1 (right-aligned)."""
    ends = at.ends_window[:, None]
    if at.settings.memory_review_cells is not None:
        shifted = torch.cat([cell_states[:, 1:], projected[:, None].to(cell_states.dtype)], dim=1)
        return torch.where(ends[..., None], shifted, cell_states)
    rows = at.rows
    place = at.window.clamp(max=cell_states.shape[1] - 1)
    written = torch.where(ends, projected.to(cell_states.dtype), cell_states[rows, place])
    if at.compiled:
        # A compiled graph cannot grow the room: a cell past it would overwrite the last one. Checked on the device
        # (no host read), where `generate()` reserved too little or a caller compiled steps without `reserve`.
        overflow = (at.ends_window & (at.window >= cell_states.shape[1])).any()
        torch._assert_async(~overflow, ROOM_EXHAUSTED)
        # A compiled step runs this in every step, ended window or not: written out of place, it would copy the whole
        # room each time. In place, a row's cell goes where no token reads yet (its own window's place), so a step
        # that fails and is run again leaves nothing behind (as the window memo's writes). None: the cache holds it
        # (a graph that returned the tensor it writes in place would copy it all the same).
        cell_states.index_put_((rows, place), written)
        return None
    return cell_states.index_put((rows, place), written)


def next_tail(slots: torch.Tensor, at: StepPositions) -> torch.Tensor:
    """(B, S, H, d) the window's slots with the new token -> the tail the next step reads: the same, or for a row
    whose window ended, the last `overlap` tokens of it (the next window's enrichment), zeros after."""
    ends = at.ends_window[:, None, None, None]
    overlap = at.settings.window_overlap
    if overlap == 0:
        return slots.masked_fill(ends, 0)
    offsets = torch.arange(slots.shape[1], device=slots.device)
    # (clamped both ways: rows whose window does not end, shorter than the overlap, are gathered too, then dropped)
    index = (at.slot[:, None] + 1 - overlap + offsets).clamp(0, slots.shape[1] - 1)  # (B, S)
    moved = slots.gather(1, index[..., None, None].expand(-1, -1, *slots.shape[2:]))
    moved = moved.masked_fill((offsets >= overlap)[None, :, None, None], 0)
    return torch.where(ends, moved, slots)
