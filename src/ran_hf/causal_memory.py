"""A layer's memory bookkeeping: which cells each token may read (all of its sequence's in the encoder; for a causal
layer those of earlier windows, cached ones first, and the salient older cells a bounded memory keeps in reach), and
what a causal layer's cache keeps for the next pass.

The memory review itself (memory_review.py) only sees ranges: each token reads cells [first, limit) of its row,
plus, with `memory_salient_cells`, the salient ones its window's row of a table allows.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .cache_ran import RANCacheLayer
from .configuration_ran import RANConfig
from .window_layout import RANWindowLayout


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


# (..., 2 D) cell keys and values -> (...) each cell's learned prior (`RANMemoryReview.cell_salience`)
Salience = Callable[[torch.Tensor], torch.Tensor]


def reviewable_cells(cells: torch.Tensor, layout: RANWindowLayout, cache: RANCacheLayer | None, bounded: bool):
    """(B, C, 2 D) memory-review keys and values of every sequence's cells, cached ones first, and (B,) the window
    number of each row's cell 0: cell c of row b is that of window `first_cell[b] + c`.

    `cells` (B, N, 2 D) are this pass's cells, projected: with a cache, a decoding step costs the same at any
    context length. A cache holds every finished window's cell, or with a `bounded` memory (`memory_review_cells=M`)
    the last M at most (right-aligned: the last cached cell of every row is that of its last finished window).
    """
    first_cell = torch.zeros_like(layout.first_window)
    if cache is None or cache.cell_states is None:
        return cells, first_cell
    cached = cache.cell_states
    if bounded:
        first_cell = layout.first_window - cached.shape[1]
        room = layout.num_steps
    else:
        cached = cached[:, : layout.cell_capacity]  # the cells there are, not the room decoding steps keep
        room = max(0, layout.cell_capacity - cached.shape[1])
    # The packed windows are exactly this pass's cells: window k is cell `window_number[k]` of its sequence.
    sequence, number = layout.window_sequence, layout.window_number
    slots = (sequence, layout.first_window[sequence] - first_cell[sequence] + number)
    # Out of place: inductor (torch 2.13, CPU) miscompiled the in-place writes into a zeros buffer when decoding
    # with two or more layers, giving a layer the cells of the next one.
    room = cells.new_zeros(layout.batch_size, room, cells.shape[-1])
    return torch.cat([cached, room], dim=1).index_put(slots, cells[sequence, number]), first_cell


def salient_pool(cells: torch.Tensor, first_cell: torch.Tensor, cache: RANCacheLayer | None):
    """With `memory_salient_cells`: the cells a salient one is chosen from, as (B, S, 2 D) cached salient cells
    (none without a cache) to append to `cells`, and (B, C + S) the window of each of `cells` and of them."""
    windows = first_cell[:, None] + torch.arange(cells.shape[1], device=cells.device)  # (B, C)
    if cache is None or cache.salient_cell_states is None:
        return cells[:, :0], windows
    return cache.salient_cell_states, torch.cat([windows, cache.salient_windows], dim=1)


def chosen_salient(salience: Salience, config: RANConfig, all_cells, windows, reading_windows) -> torch.Tensor:
    """(B, R, C) which of `all_cells` (written by `windows`) each of the `reading_windows` keeps as salient."""
    return salient_cells(
        salience(all_cells), windows, reading_windows, config.memory_review_cells, config.memory_salient_cells
    )


def causal_reading(config: RANConfig, salience: Salience, cells, first_cell, initial_cell, layout, pool=None):
    """What each token of a causal layer reads: a token in window w reads the cells of windows 0 .. w - 1 (w - M ..
    w - 1 with `memory_review_cells=M`, then the `memory_salient_cells` most salient older ones), and with
    `review_initial_cell` the layer's starting cell before them.

    `initial_cell` (B, 2 D) is the starting cell's key and value; `pool` comes from `salient_pool`. Returns the cells
    (B, C', 2 D) to review, (B, L) each token's limit and first readable cell (None: from 0), and the salient table
    and each token's row of it (None without salient cells).
    """
    # (B, L); none in the first window, whose range is empty (a bounded cache's room holds zeros before it)
    readable_cells = (layout.token_window - first_cell[:, None]) * (layout.token_window > 0)
    first_readable, salient = None, None
    if config.memory_review_cells is not None:
        oldest = (layout.token_window - config.memory_review_cells).clamp(min=0)
        first_readable = oldest - first_cell[:, None]
    if pool is not None:  # cached salient cells go last, out of every token's range
        cells = torch.cat([cells, pool[0]], dim=1)
        reading = layout.first_window[:, None] + torch.arange(layout.num_steps, device=cells.device)  # (B, R)
        rows = (layout.token_window - layout.first_window[:, None]).clamp(0, layout.num_steps - 1)
        salient = chosen_salient(salience, config, cells, pool[1], reading), rows
    if config.review_initial_cell:
        cells = torch.cat([initial_cell[:, None], cells], dim=1)  # (B, 1 + C, 2 D)
        readable_cells = readable_cells + 1  # ... and the initial cell before them
        first_readable = None if first_readable is None else first_readable + 1
        salient = None if salient is None else (F.pad(salient[0], (1, 0)), salient[1])
    return cells, readable_cells, first_readable, salient


def remember(config: RANConfig, salience: Salience, cache: RANCacheLayer, layout: RANWindowLayout, cell_states,
             first_cell, pool=None) -> None:  # fmt: skip
    """Cache the cells memory review may read again: every finished window's, or the last `memory_review_cells`
    (right-aligned) and, with `memory_salient_cells`, the salient older ones the next window reads."""
    finished_windows = layout.finished_windows
    if config.memory_review_cells is None:  # in a room of `cache.cell_room` cells, zeros after a row's last
        kept = min(layout.most_finished_windows, cell_states.shape[1])
        finished = torch.arange(kept, device=cell_states.device)[None, :] < finished_windows[:, None]
        kept_cells = cell_states[:, :kept] * finished[..., None]
        cache.cell_states = F.pad(kept_cells, (0, 0, 0, max(0, cache.cell_room - kept)))
        return
    bound = config.memory_review_cells  # the last M windows', right-aligned; zeros for windows before the first
    window = finished_windows[:, None] - bound + torch.arange(bound, device=cell_states.device)  # (B, M)
    index = (window - first_cell[:, None]).clamp(min=0)[..., None].expand(-1, -1, cell_states.shape[-1])
    cache.cell_states = cell_states.gather(1, index) * (window >= 0)[..., None]
    if pool is None:
        return
    # The salient cells the next window reads beyond its range, oldest first; slots not yet filled hold zeros and
    # window -1.
    all_cells, windows = torch.cat([cell_states, pool[0]], dim=1), pool[1]
    kept = config.memory_salient_cells
    if all_cells.shape[1] < kept:
        all_cells = F.pad(all_cells, (0, 0, 0, kept - all_cells.shape[1]))
        windows = F.pad(windows, (0, kept - windows.shape[1]), value=-1)
    keep = chosen_salient(salience, config, all_cells, windows, finished_windows[:, None])[:, 0]  # (B, C + S)
    order = torch.where(keep, windows, torch.iinfo(windows.dtype).max).argsort(dim=-1, stable=True)[:, :kept]
    valid = keep.gather(1, order)
    chosen = all_cells.gather(1, order[..., None].expand(-1, -1, all_cells.shape[-1]))
    cache.salient_cell_states = chosen * valid[..., None]
    cache.salient_windows = torch.where(valid, windows.gather(1, order), -1)


def memory_to_read(config: RANConfig, salience: Salience, cells, initial_cell, layout: RANWindowLayout, cache=None):
    """What every token of a layer reads in memory review: all the cells of its sequence in the encoder; a prefix
    LM's token those of the source's windows and of its own window and those before it; a causal token those of
    earlier windows (`causal_reading`).

    `cells` (B, N, 2 D) this pass's cells, projected; `initial_cell` (B, 2 D) the starting cell's key and value where a
    causal layer reads it (else None). Returns the review's inputs after the token states (cells (B, C, 2 D), (B, L)
    each token's limit, its first readable cell or None, the salient table and rows or None) and what the cache
    keeps: the cells (B, C, 2 D), the window number of each row's first (B,), and the salient pool.
    """
    cells, first_cell = reviewable_cells(cells, layout, cache, bounded=config.memory_review_cells is not None)
    if config.is_causal:
        pool = salient_pool(cells, first_cell, cache) if config.memory_salient_cells is not None else None
        reading = causal_reading(config, salience, cells, first_cell, initial_cell, layout, pool)
        return reading, (cells, first_cell, pool)
    if layout.source_windows is not None:
        # Prefix LM: a cell reads the source only, but how many windows follow it is the target's length.
        readable_cells = torch.maximum(layout.token_window + 1, layout.source_windows[:, None])
    else:
        readable_cells = layout.num_windows[:, None].expand_as(layout.token_window)  # (B, L): all of them
    return (cells, readable_cells, None, None), (cells, first_cell, None)


def update_cache(config: RANConfig, cache: RANCacheLayer, layout: RANWindowLayout, start, raw_cells, cells,
                 new_kv) -> None:  # fmt: skip
    """Keep what a causal layer's next pass needs: the cell after the last finished window and the unfinished tail
    of keys and values. (Memory review keeps the cells it may read again itself: `remember`.)"""
    cache.cell = layout.after_last_finished(cells, start[0])
    cache.previous_raw_cell = layout.after_last_finished(raw_cells, start[1])
    tail = layout.sources(new_kv, cache.tail)[layout.next_tail]  # (B, P', 2, H, d)
    # Kept `window_size + window_overlap` slots wide, zeros after a row's last: the most any row can need and the
    # slot a decoding step writes its token into, so that it keeps the cache's shapes.
    tail_slots = config.window_size + config.window_overlap
    cache.update_tail(*F.pad(tail, (0, 0, 0, 0, 0, 0, 0, tail_slots - tail.shape[1])).unbind(2))
