"""The recurrent cache of a causal RAN: constant-size state per layer, plus a key and value per finished window (or
per each of the last `memory_review_cells`). A cache handed to a model is checked in input_checks.py."""

import copy

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin


# The config fields that decide what a cache holds and how a forward reads it: a cache made by a model that differs
# in any of them is another model's state (`input_checks.check_cache`).
CACHE_SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim", "window_size",
                      "min_window_size", "window_overlap", "memory_review_cells", "memory_salient_cells",
                      "associative_memory", "associative_decay", "token_shift")  # fmt: skip
STATE = ("cell", "previous_raw_cell", "cell_states", "salient_cell_states", "salient_windows", "last_token",
         "tail_keys", "tail_values", "binding_state")  # fmt: skip


class RANCacheLayer(LinearAttentionCacheLayerMixin):
    """What one causal RAN layer needs to continue a sequence; its recurrent state (`recurrent_states[0]`) is the cell.
    Per row: `cell` (B, D), the cell the open window reads; `previous_raw_cell` (B, D), the last finished window's;
    `cell_states` (B, C, 2 D), memory review's key and value of each finished window's cell (in a room that doubles as
    it fills, or the last `memory_review_cells`); with `memory_salient_cells`, `salient_cell_states` (B, S, 2 D) and
    their `salient_windows` (B, S; -1: empty); with `token_shift`, first layer, `last_token` (B, D); `tail_keys`,
    `tail_values` (B, window_size + window_overlap, H, d), the open window's un-rotated keys and values, zeros after a
    row's last; with `associative_memory`, its `binding_state` (B, H, d, d) after the last token read. Eager decoding
    steps keep what they derive from it (`step_window`, `step_review`) with the state it came from (`memo_of`), read
    while the cache still holds that state (`RANLayer.decode_token`)."""

    def __init__(self):
        super().__init__(number_of_states=1)  # no convolution state; the one recurrent state is the cell
        for name in STATE[1:]:
            setattr(self, name, None)
        self.cell_room = 0
        self.step_window = self.step_review = self.memo_of = None

    @property
    def cell(self) -> torch.Tensor | None:
        return self.recurrent_states[0]

    @cell.setter
    def cell(self, cell: torch.Tensor | None) -> None:
        self.recurrent_states[0] = cell
        self.is_recurrent_states_initialized[0] = self.has_previous_state[0] = cell is not None
        if cell is not None:
            self.device, self.dtype = cell.device, cell.dtype

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0) -> None:
        if conv_states is not None or state_idx != 0:
            raise ValueError("A RAN cache layer holds one recurrent state (the cell, `state_idx=0`), no conv state.")

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        raise ValueError("A RAN layer has no convolution state: its recurrent state is the cell.")

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.cell = recurrent_states
        return recurrent_states

    def update_tail(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        # Contiguous, whoever wrote it: a compiled step's graph is specialised on the strides it reads.
        self.tail_keys, self.tail_values = keys.contiguous(), values.contiguous()

    @property
    def tail(self) -> torch.Tensor | None:
        """(B, P, 2, H, d) the cached tail's keys and values, stacked as the layer's projections are."""
        return None if self.tail_keys is None else torch.stack([self.tail_keys, self.tail_values], 2)

    def tensors(self) -> dict:
        return {name: value for name in STATE if (value := getattr(self, name)) is not None}

    def _map(self, function) -> None:
        for name, tensor in self.tensors().items():
            setattr(self, name, function(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # (the rows' other changes: `RANCache._map_rows`)
        self._map(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def reset(self) -> None:
        self.__init__()

    def crop(self, tokens_to_remove: int) -> None:  # (`Cache.crop` calls it for every layer)
        raise ValueError("A RAN cache cannot be cropped: its cells have already read the tokens to remove. Keep a "
                         "copy made before them (`copy.deepcopy(cache)`) and continue it, or use a fresh cache.")  # fmt: skip

    def activate_past_recording(self) -> None:
        raise ValueError("A RAN cache cannot record past states to roll back to: its cells read every token.")


class RANCache(Cache):
    """Recurrent state of a causal RAN (`RANCacheLayer` per layer): `generate()` creates and reorders it as needed.
    Streaming a text chunk by chunk gives exactly the logits of one forward pass over all of it:

    ```python
    >>> cache = None
    >>> for chunk in chunks:  # (batch_size, chunk_length) token ids
    ...     outputs = model(chunk, past_key_values=cache, use_cache=True)
    ...     cache = outputs.past_key_values
    ```

    Padding: pass the attention mask of the whole stream so far, or of the new chunk only. Counts: `lengths` (B,) real
    tokens per row, `host_lengths` the same where known without a read, `seen_positions` the padded positions read
    (what `generate` slices its inputs by); compiled steps count on the device (`compiled_positions`), read once later.
    """

    def __init__(self, config, max_cache_len: int | None = None):
        super().__init__(layers=[RANCacheLayer() for _ in range(config.num_hidden_layers)])
        self.model_shape = {name: getattr(config, name) for name in CACHE_SHAPE_FIELDS}  # `check_cache` compares it
        self.window_size, self.memory_review_cells = config.window_size, config.memory_review_cells
        self.tail_slots = config.window_size + config.window_overlap  # the longest tail, plus a step's token
        self.reserved_tokens = max_cache_len or 0  # room for the cells of this many tokens (`reserve`)
        self.checked_by = None  # the marker of the model that checked it last (`input_checks.check_cache`)
        self.reset_counts()

    def reset_counts(self) -> None:
        self.lengths = self.host_lengths = self.compiled_positions = None
        self.seen_positions, self.host_counts_stale = 0, False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.host_counts_stale and not torch.compiler.is_compiling():  # compiled steps ran since: one read
            positions, self.compiled_positions = self.compiled_positions, self.compiled_positions.new_zeros(())
            self.seen_positions += int(positions)
            self.host_lengths, self.host_counts_stale = None, False
        return self.seen_positions

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def is_initialized(self) -> bool:
        return self.lengths is not None

    @property
    def batch_size(self) -> int:
        return -1 if self.lengths is None else self.lengths.shape[0]

    def cell_room(self, finished_windows: int) -> int:
        """The cells memory review's cache holds for `finished_windows`: `memory_review_cells`, or room that doubles as
        it fills (at least the reserved tokens'), so that a step writes its cell in place and a compiled one keeps
        its shapes."""
        if self.memory_review_cells is not None:
            return self.memory_review_cells
        needed = max(finished_windows, self.reserved_tokens // self.window_size, 1)
        return 1 << (needed - 1).bit_length()

    def reserve(self, total_tokens: int) -> None:
        """Make room for the cells of `total_tokens` tokens per row: a compiled decoding step cannot grow the cache."""
        if total_tokens <= self.reserved_tokens:
            return
        self.reserved_tokens = total_tokens
        room = self.cell_room(0)
        for layer in self.layers:
            layer.cell_room = max(layer.cell_room, room)
            cells = layer.cell_states
            if cells is not None and cells.shape[1] < layer.cell_room:
                layer.cell_states = F.pad(cells, (0, 0, 0, layer.cell_room - cells.shape[1]))

    def make_room(self, finished_windows: int) -> None:
        """Before a forward after which rows have finished at most `finished_windows` windows."""
        for layer in self.layers:
            layer.cell_room = self.cell_room(finished_windows)

    def past_lengths(self, batch_size: int, device: torch.device) -> torch.Tensor:
        if self.lengths is None:
            return torch.zeros(batch_size, dtype=torch.long, device=device)
        if self.lengths.shape[0] != batch_size:
            raise ValueError(
                f"`past_key_values` holds {self.lengths.shape[0]} sequences, but the inputs have {batch_size} rows: "
                f"continue it with {self.lengths.shape[0]} rows, pass `past_key_values=None` to start new texts, or "
                "pick the rows to go on with first (`cache.batch_select_indices(rows)`, on a `copy.deepcopy(cache)`)."
            )
        return self.lengths

    def advance(self, new_tokens: torch.Tensor, new_positions: int, host_lengths: list[int] | None = None) -> None:
        """Count a forward: `new_tokens` (B,) over `new_positions` padded columns; each row's length, if read."""
        self.seen_positions = self.get_seq_length() + new_positions
        if self.lengths is None:
            self.lengths, self.compiled_positions = new_tokens, new_tokens.new_zeros(())
        else:
            self.lengths = self.lengths + new_tokens
        self.host_lengths = host_lengths

    def advance_one_token(self, compiling: bool) -> None:
        """Count a decoding step's token per row; compiled, on the device only, so that no step reads a number."""
        self.lengths = self.lengths + 1
        if compiling:
            self.compiled_positions = self.compiled_positions + 1
            self.host_lengths, self.host_counts_stale = None, True
        else:
            self.seen_positions += 1
            self.host_lengths = [length + 1 for length in self.host_lengths]

    def known_lengths(self) -> list[int]:
        """Every row's length on the host: read (once) after beam search reordered the rows or compiled steps ran."""
        self.get_seq_length()
        if self.host_lengths is None:
            self.host_lengths = self.lengths.tolist()
        return self.host_lengths

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.lengths is not None and beam_idx.device.type == "cpu":  # (a read waits for nothing on the CPU)
            rows = self.lengths.shape[0]
            if beam_idx.numel() and not (0 <= int(beam_idx.min()) and int(beam_idx.max()) < rows):
                raise ValueError(f"`reorder_cache` was given rows {beam_idx.tolist()}, but the cache holds {rows} "
                                 f"rows (0 to {rows - 1}): pick rows that exist.")  # fmt: skip
        self._map_rows(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda tensor: tensor[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def _map_rows(self, function) -> None:
        for layer in self.layers:
            layer._map(function)
        if self.lengths is not None:
            self.lengths, self.host_lengths = function(self.lengths), None

    def reset(self) -> None:
        super().reset()
        self.reset_counts()

    def __deepcopy__(self, memo) -> "RANCache":
        # torch copies only graph leaves: a cache filled with gradients on would fail inside torch, unnamed.
        if any(tensor.grad_fn is not None for layer in self.layers for tensor in layer.tensors().values()):
            raise ValueError(
                "This cache holds the autograd graph of the forward that filled it, which cannot be copied: "
                "fill it under `torch.no_grad()`, or copy `cache.detach()` (docs/generation.md)."
            )
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        memo[id(self.checked_by)] = self.checked_by  # a copy is as checked as the cache it copies
        copied.__dict__.update({name: copy.deepcopy(value, memo) for name, value in self.__dict__.items()})
        return copied

    def detach(self) -> "RANCache":
        """Cut backpropagation here, keeping the state (truncated backpropagation through time, chunk by chunk)."""
        for layer in self.layers:
            layer._map(torch.Tensor.detach)
        return self

    def nbytes(self) -> int:
        """Bytes held by all cached tensors."""
        tensors = [t for layer in self.layers for t in layer.tensors().values()] + [self.lengths] * self.is_initialized
        return sum(t.numel() * t.element_size() for t in tensors)


__all__ = ["RANCache", "RANCacheLayer"]
