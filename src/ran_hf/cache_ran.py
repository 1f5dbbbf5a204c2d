"""The recurrent cache of a causal RAN: constant-size state per layer, plus a key and value per finished window (or
per each of the last `memory_review_cells` windows)."""

import copy
import functools
import inspect

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin


# The config fields that decide what a cache holds and how a forward reads it: a cache made by a model that differs
# in any of them is another model's state (cells of another width, another number of layers, windows cut elsewhere).
CACHE_SHAPE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "head_dim",
    "window_size",
    "min_window_size",
    "window_overlap",
    "memory_review_cells",
    "memory_salient_cells",
    "associative_memory",
)


CROP_REFUSED = (
    "A RAN cache cannot be cropped: its cells have already read the tokens to remove. Keep a copy made before them "
    "(`copy.deepcopy(cache)`) and continue that, or read the text again into a fresh cache."
)


def cache_shape(config) -> dict:
    # A first layer with token shift caches the last token read.
    return {
        **{name: getattr(config, name) for name in CACHE_SHAPE_FIELDS},
        "token_shift": config.token_shift,
    }


def check_cache(past_key_values, config, dtype: torch.dtype | None = None) -> None:
    """Refuse, naming the mismatch, a `past_key_values` this model cannot continue: a cache of another kind (a
    transformer's `DynamicCache`, legacy tuples), a `RANCache` made by a model of another shape, or one whose cells a
    model of another `dtype` (its weights') wrote."""
    if past_key_values is None:
        return
    if not isinstance(past_key_values, RANCache):
        raise TypeError(
            f"`past_key_values` must be a RANCache (what a causal RAN returns with `use_cache=True`), got "
            f"{type(past_key_values).__name__}: a RAN carries a recurrent state, not per-token keys and values. Pass "
            "the cache this model returned, or None to start a new text."
        )
    differing = [
        f"{name} {made!r} there, {config_value!r} here"
        for name, config_value in cache_shape(config).items()
        if (made := past_key_values.model_shape.get(name)) != config_value
    ]
    if differing:
        raise ValueError(
            f"`past_key_values` was made by another model ({'; '.join(differing)}): its state cannot be continued "
            "by this one. Pass the cache this model returned, or None to start a new text."
        )
    written = next((layer.cell.dtype for layer in past_key_values.layers if layer.cell is not None), None)
    if dtype is not None and written is not None and written != dtype:
        raise ValueError(
            f"`past_key_values` was written by a model in {written}, and this one computes in {dtype}: its state "
            f"cannot be continued in another dtype. Continue it with the model that wrote it (or one cast to "
            f"{written}), or pass None to start a new text."
        )
    past_key_values.check_graph()


def check_cache_position(cache_position, past_key_values, new_positions: int) -> None:
    """Refuse a `cache_position` (Transformers' index of the new positions) that disagrees with what
    `past_key_values` has read: a RAN cache knows where every row stands and needs none, so one given must say the
    same (a host read, only where one is given)."""
    read = 0 if past_key_values is None else past_key_values.get_seq_length()
    expected = list(range(read, read + new_positions))
    given = cache_position.tolist() if torch.is_tensor(cache_position) else cache_position
    if given != expected:
        shown = f"{given}" if not isinstance(given, list) or len(given) <= 6 else f"[{given[0]}, ..., {given[-1]}]"
        raise ValueError(
            f"`cache_position` is {shown}, but `past_key_values` has read {read} positions, so the {new_positions} new "
            f"ones are {read}..{read + new_positions - 1}: the cache and the positions given with it disagree. A RAN "
            "cache knows where each row stands: leave `cache_position` out, or pass the cache that read the text "
            "before these tokens (a `copy.deepcopy` made then, or None for a new text)."
        )


def after_last_finished(steps: torch.Tensor, finished_here: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """(N, B, ...) per scan step -> (B, ...) each row's entry after its last window finished in this pass
    (`finished_here` (B,) windows), or `start` for a row that finished none."""
    if not steps.numel():
        return start
    last = (finished_here - 1).clamp(min=0)
    rows = torch.arange(last.shape[0], device=last.device)
    has_finished = (finished_here > 0).view(-1, *[1] * (start.dim() - 1))
    return torch.where(has_finished, steps[last, rows], start)


class RANCacheLayer(LinearAttentionCacheLayerMixin):
    """What one causal RAN layer needs to continue a sequence: a recurrent layer in Transformers' cache API, whose
    recurrent state (`recurrent_states[0]`, `get_recurrent_state`) is the cell, with the rest of its state beside it.

    Per row of the batch:
        cell (B, D): the cell the current window reads (the last finished window's, or the learned initial cell);
        previous_raw_cell (B, D): the raw output of the last finished window, joined to the next one by the residual;
        cell_states (B, C, 2 D): memory review's keys and values of the raw cells of all finished windows (C grows by
            one per window; projected once, so a decoding step does not redo work for the whole past), or with
            `config.memory_review_cells = M` of the last M at most (right-aligned per row, C <= M);
        salient_cell_states (B, S, 2 D), salient_windows (B, S): with `config.memory_salient_cells = S`, the S most
            salient cells older than those, and the window each was written by (-1: a slot not filled yet);
        last_token (B, D): first layer only, with `config.token_shift`: the embedding of the last token read, which
            the next one reads as its predecessor;
        tail_keys, tail_values (B, P, H, d): un-rotated keys and values of the tokens a later window still reads:
            the current window's tokens and, before them, the enrichment tokens of `window_overlap`, zeros after a
            row's last (P = window_size + window_overlap, one more than the longest tail: a decoding step's token);
        binding_state (B, H, d, d), tail_betas (B, P, H): with `config.associative_memory`, the memory's state after
            the last finished window, and the write strengths of the tail's tokens (written when their window ends).
    """

    # Fixed shapes between passes: the tail is `window_size - 1 + window_overlap` slots wide whatever it holds, and the
    # cells memory review reads have a fixed room (`RANCache.cell_room`), so a decoding step can be compiled.
    is_compileable = True
    is_sliding = False

    def __init__(self):
        super().__init__(number_of_states=1)  # no convolution state; the one recurrent state is the cell
        self.previous_raw_cell = None
        self.cell_states = None
        self.salient_cell_states = None
        self.salient_windows = None
        self.last_token = None
        self.tail_keys = None
        self.tail_values = None
        self.binding_state = None
        self.tail_betas = None
        self.cell_room = 0  # how many cells `cell_states` holds without a bound (`RANCache.cell_room`)
        self.forget_step_memos()

    def forget_step_memos(self) -> None:
        """Drop what eager decoding steps keep between steps (decode_step.py), derived from this state: the current
        window as window attention reads it (`step_window`: rotated keys and values (B, H, 1 + S, d), the read cell's
        in slot 0), and the cells memory review reads with their score bias (`step_review`). Every update of the
        state drops them; a step rebuilds what it needs."""
        self.step_window = None
        self.step_review = None

    @property
    def cell(self) -> torch.Tensor | None:
        return self.recurrent_states[0]

    @cell.setter
    def cell(self, cell: torch.Tensor | None) -> None:
        self.recurrent_states[0] = cell
        self.is_recurrent_states_initialized[0] = self.has_previous_state[0] = cell is not None
        if cell is not None:
            self.device, self.dtype = cell.device, cell.dtype

    @property
    def is_initialized(self) -> bool:
        return self.cell is not None

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0) -> None:
        if conv_states is not None or state_idx != 0:
            raise ValueError(
                "A RAN cache layer holds one recurrent state (its cell, `state_idx=0`) and no conv state."
            )
        if recurrent_states is not None:
            self.device, self.dtype = recurrent_states.device, recurrent_states.dtype

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        raise ValueError("A RAN layer has no convolution state: its recurrent state is the cell.")

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Set the cell the next window reads, (B, D)."""
        self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.cell = recurrent_states
        self.forget_step_memos()
        return recurrent_states

    def update_cell(self, cells, raw_cells, finished_here: torch.Tensor, start: tuple) -> None:
        """Keep the cell after each row's last window finished in this pass (`finished_here` (B,) of the pass's
        (N, B, D) `cells`), and its raw cell; a row that finished none keeps the `start` (cell, raw cell) it read."""
        self.update_recurrent_state(after_last_finished(cells, finished_here, start[0]))
        self.previous_raw_cell = after_last_finished(raw_cells, finished_here, start[1])

    def update_binding(self, states, finished_here: torch.Tensor, start: torch.Tensor, tail_betas) -> None:
        """The associative memory after each row's last finished window (`states` (N, B, ...) after each scan step),
        and the write strengths of the tail kept for the next pass."""
        self.binding_state = after_last_finished(states, finished_here, start)
        self.tail_betas = tail_betas

    def update_cell_states(self, cell_states: torch.Tensor) -> None:
        self.cell_states = cell_states
        self.forget_step_memos()

    def update_salient(self, cell_states: torch.Tensor, windows: torch.Tensor) -> None:
        self.salient_cell_states, self.salient_windows = cell_states, windows

    def update_tail(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        # Contiguous, whoever wrote it: a compiled step's graph is specialised on the strides it reads.
        self.tail_keys, self.tail_values = keys.contiguous(), values.contiguous()
        self.forget_step_memos()

    def update_last_token(self, last_token: torch.Tensor) -> None:
        self.last_token = last_token

    @property
    def tail(self) -> torch.Tensor | None:
        """(B, P, 2, H, d) the cached tail's keys and values, stacked as the layer's projections are."""
        return None if self.tail_keys is None else torch.stack([self.tail_keys, self.tail_values], 2)

    def tensors(self) -> dict:
        names = (
            "cell", "previous_raw_cell", "cell_states", "salient_cell_states", "salient_windows", "last_token",
            "tail_keys", "tail_values", "binding_state", "tail_betas",
        )  # fmt: skip
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def _map(self, function) -> None:
        self.forget_step_memos()  # rebuilt by the next step, for the rows it has
        for name, tensor in self.tensors().items():
            setattr(self, name, function(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda tensor: tensor[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self.__init__()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(CROP_REFUSED)

    def activate_past_recording(self) -> None:
        raise ValueError("A RAN cache cannot record past states to roll back to: its cells read every token.")

    def offload(self) -> None:
        self._map(lambda tensor: tensor.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.device is not None:
            self._map(lambda tensor: tensor.to(self.device, non_blocking=True))


class RANCache(Cache):
    """Recurrent state of a causal RAN, in Transformers' `Cache` API: `generate()` creates and reorders it as needed.

    Per layer one cell, one raw cell and the keys/values of at most one window, plus the memory-review key and value
    of each finished window's cell (2 D numbers per window): a window's worth of a transformer's cache per window.
    With `config.memory_review_cells = M` only the last M windows' cells are kept (and with
    `config.memory_salient_cells = S` the S most salient older ones), and memory is flat.

    Streaming an unbounded text chunk by chunk gives exactly the logits of one forward pass over all of it:

    ```python
    >>> cache = None
    >>> for chunk in chunks:  # (batch_size, chunk_length) token ids
    ...     outputs = model(chunk, past_key_values=cache, use_cache=True)
    ...     cache = outputs.past_key_values
    ```

    Padding: pass the attention mask of the whole stream so far, or of the new chunk only; padded positions are
    skipped and each row continues its own windows.
    """

    def __init__(self, config, max_cache_len: int | None = None):
        super().__init__(layers=[RANCacheLayer() for _ in range(config.num_hidden_layers)])
        self.model_shape = cache_shape(config)  # what a model continuing this cache must have (`check_cache`)
        self.window_size = config.window_size
        self.window_overlap = config.window_overlap
        # The longest tail a row can have, plus the slot a decoding step writes its token into.
        self.tail_slots = config.window_size + config.window_overlap
        self.memory_review_cells = config.memory_review_cells
        # Room for the cells of this many tokens from the start (`reserve`): a compiled step then never needs more.
        self.reserved_tokens = max_cache_len or 0
        self.lengths = None  # (B,) real tokens read by each row, on the device
        self.host_lengths = None  # the same as a list on the host, where known without a read (None: read it)
        self.seen_positions = 0  # padded positions read, what `generate` slices its inputs by
        self.compiled_positions = None  # (,) positions read by compiled steps since the host counts were last read
        self.host_counts_stale = False  # compiled steps ran since: `bring_host_counts_up` reads their count
        self.graph_probe = None  # the autograd node `watch_graph` put after the last forward that built a graph
        self.in_transaction = False  # a head's `cache_transaction` already holds a snapshot
        self.checked_by = None  # the (config, edit count) of the model that checked it (`check_cache`) last

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self.bring_host_counts_up()
        return self.seen_positions

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self.lengths is not None

    @property
    def batch_size(self) -> int:
        return -1 if self.lengths is None else self.lengths.shape[0]

    def cell_room(self, finished_windows: int) -> int:
        """How many cells memory review's cache holds for rows that finished at most `finished_windows` windows:
        `memory_review_cells` when bounded; else room that doubles as it fills (at least for the windows of the
        reserved tokens), so that decoding writes each new cell into place and a compiled step keeps its shapes."""
        if self.memory_review_cells is not None:
            return self.memory_review_cells
        needed = max(finished_windows, self.reserved_tokens // self.window_size, 1)
        return 1 << (needed - 1).bit_length()

    def reserve(self, total_tokens: int) -> None:
        """Make room for the cells of `total_tokens` tokens per row (`RANForCausalLM.prepare_inputs_for_generation`
        calls it before every step): a compiled decoding step cannot grow the cache itself."""
        if total_tokens <= self.reserved_tokens:
            return
        self.reserved_tokens = total_tokens
        room = self.cell_room(0)
        for layer in self.layers:
            layer.cell_room = max(layer.cell_room, room)
            cells = layer.cell_states
            if cells is not None and cells.shape[1] < layer.cell_room:
                layer.update_cell_states(F.pad(cells, (0, 0, 0, layer.cell_room - cells.shape[1])))

    def make_room(self, finished_windows: int) -> None:
        """Before a forward pass after which rows have finished at most `finished_windows` windows: the room every
        layer keeps its cells in (`cell_room`)."""
        room = self.cell_room(finished_windows)
        for layer in self.layers:
            layer.cell_room = room

    def past_lengths(self, batch_size: int, device: torch.device) -> torch.Tensor:
        if self.lengths is None:
            return torch.zeros(batch_size, dtype=torch.long, device=device)
        if self.lengths.shape[0] != batch_size:
            raise ValueError(
                f"`past_key_values` holds {self.lengths.shape[0]} sequences, but the inputs have {batch_size} rows: a "
                "cache continues the batch it was made with, one row per sequence. Continue it with inputs of "
                f"{self.lengths.shape[0]} rows, pass `past_key_values=None` to start new texts, or pick the rows to "
                "go on with first (`cache.batch_select_indices(rows)`, on a `copy.deepcopy(cache)` to keep the "
                "original)."
            )
        return self.lengths

    def advance(self, new_tokens: torch.Tensor, new_positions: int, host_lengths: list[int] | None = None) -> None:
        """Count what one forward pass read: `new_tokens` (B,) real tokens over `new_positions` padded columns, and
        each row's length after it as read to the host (`host_lengths`, None where it was not read)."""
        self.bring_host_counts_up()
        if self.lengths is None:
            self.lengths, self.compiled_positions = new_tokens, new_tokens.new_zeros(())
        else:
            self.lengths = self.lengths + new_tokens
        self.host_lengths = host_lengths
        self.seen_positions += new_positions

    def advance_one_token(self) -> None:
        """Count a decoding step's one real token per row. Compiled, only on the device: the host counts are
        brought up to date when next asked for (`bring_host_counts_up`), so that no step reads a changing number."""
        self.lengths = self.lengths + 1
        if torch.compiler.is_compiling():
            self.compiled_positions = self.compiled_positions + 1
            self.host_lengths, self.host_counts_stale = None, True
            return
        self.seen_positions += 1
        self.host_lengths = [length + 1 for length in self.host_lengths]

    def bring_host_counts_up(self) -> None:
        """After compiled steps, read their count and every row's length to the host (one read)."""
        if not self.host_counts_stale:
            return
        positions, self.compiled_positions = self.compiled_positions, self.compiled_positions.new_zeros(())
        self.seen_positions += int(positions)
        self.host_lengths, self.host_counts_stale = None, False

    def known_lengths(self) -> list[int]:
        """Every row's length on the host: known after a forward pass, read (once) after beam search reordered the
        rows or compiled steps ran."""
        self.bring_host_counts_up()
        if self.host_lengths is None:
            self.host_lengths = self.lengths.tolist()
        return self.host_lengths

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.lengths is not None and beam_idx.device.type == "cpu":  # (a read waits for nothing on the CPU)
            rows = self.lengths.shape[0]
            if beam_idx.numel() and not (0 <= int(beam_idx.min()) and int(beam_idx.max()) < rows):
                raise ValueError(
                    f"`reorder_cache` was given rows {beam_idx.tolist()}, but the cache holds {rows} rows (0 to "
                    f"{rows - 1}): pick rows that exist."
                )
        super().reorder_cache(beam_idx)
        if self.lengths is not None:
            self.lengths = self.lengths.index_select(0, beam_idx.to(self.lengths.device))
            self.host_lengths = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.lengths is not None:
            self.lengths = self.lengths[indices]
            self.host_lengths = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.lengths is not None:
            self.lengths = self.lengths.repeat_interleave(repeats, dim=0)
            if self.host_lengths is not None:
                self.host_lengths = [length for length in self.host_lengths for _ in range(repeats)]

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(CROP_REFUSED)

    def reset(self) -> None:
        super().reset()
        self.lengths, self.host_lengths, self.seen_positions, self.graph_probe = None, None, 0, None
        self.compiled_positions, self.host_counts_stale = None, False

    def __deepcopy__(self, memo) -> "RANCache":
        # torch copies only graph leaves: a cache filled with gradients on would fail inside torch, unnamed.
        if any(tensor.grad_fn is not None for layer in self.layers for tensor in layer.tensors().values()):
            raise ValueError(
                "This cache holds the autograd graph of the forward that filled it, which cannot be copied: fill it "
                "under `torch.no_grad()`, or copy `cache.detach()` (which cuts backpropagation there; "
                "docs/generation.md)."
            )
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        memo[id(self.checked_by)] = self.checked_by  # a copy is as checked as the cache it copies
        copied.__dict__.update({name: copy.deepcopy(value, memo) for name, value in self.__dict__.items()})
        return copied

    def detach(self) -> "RANCache":
        """Cut backpropagation here, keeping the state: training on a stream in chunks then backpropagates through
        one chunk at a time (truncated backpropagation through time) while every chunk still reads the ones before.
        Returns the cache itself."""
        for layer in self.layers:
            layer._map(torch.Tensor.detach)
        self.graph_probe = None
        return self

    # ---- one transaction per forward ----------------------------------------------------------------------------

    def snapshot(self) -> tuple:
        """What a forward may change, by reference: every update replaces a tensor, none writes into one (the base
        layer's per-state dicts are copied, their tensors are not). Two exceptions are written in place, each only
        where no step reads before writing it again: `step_window` in the slot after each row's tail, and, in a
        compiled step, the cells' room at each row's own window's place."""
        layers = [(dict(vars(layer)), *map(dict, per_state(layer))) for layer in self.layers]
        return layers, dict(vars(self))

    def restore(self, snapshot: tuple) -> None:
        layers, own = snapshot
        vars(self).clear()
        vars(self).update(own)
        for layer, (state, *state_dicts) in zip(self.layers, layers):
            vars(layer).clear()
            vars(layer).update(state)
            for name, saved in zip(PER_STATE_DICTS, state_dicts):
                setattr(layer, name, dict(saved))

    # ---- a graph that backward has freed -------------------------------------------------------------------------

    def watch_graph(self, token_states: torch.Tensor) -> torch.Tensor:
        """`token_states` (on the way to the outputs) through an identity node whose saved tensor backward frees: if
        a later forward finds it freed while the cache still carries this forward's graph, the backward of that
        forward would run into freed buffers (`check_graph`)."""
        if not (torch.is_grad_enabled() and token_states.requires_grad) or torch.compiler.is_compiling():
            return token_states
        token_states = _GraphProbe.apply(token_states)
        self.graph_probe = token_states.grad_fn
        return token_states

    def check_graph(self) -> None:
        """Refuse, naming the fix, to continue a cache whose tensors carry the autograd graph of an earlier forward
        that a backward has since freed: PyTorch would fail in the next backward with "Trying to backward through the
        graph a second time", without a word about the cache."""
        if self.graph_probe is None or not torch.is_grad_enabled():
            return
        try:
            self.graph_probe.saved_tensors
            return
        except RuntimeError:
            pass
        if any(tensor.requires_grad for layer in self.layers for tensor in layer.tensors().values()):
            raise RuntimeError(
                "`past_key_values` carries the autograd graph of an earlier forward, through which a backward has "
                'already run and freed it: a backward through this forward would fail ("Trying to backward through '
                'the graph a second time"). Training on chunks of a stream, call `cache.detach()` after each '
                "backward (truncated backpropagation through time, docs/training.md); or call `backward()` once, on "
                "the sum of the chunks' losses (or with `retain_graph=True`)."
            )

    def nbytes(self) -> int:
        """Bytes held by all cached tensors."""
        total = 0 if self.lengths is None else self.lengths.numel() * self.lengths.element_size()
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for t in layer.tensors().values())
        return total


# The base layer's state dicts (`LinearAttentionCacheLayerMixin`), written into by key: copied by a snapshot.
PER_STATE_DICTS = ("recurrent_states", "conv_states", "is_recurrent_states_initialized", "is_conv_states_initialized",
                   "has_previous_state")  # fmt: skip


def per_state(layer) -> list:
    return [getattr(layer, name) for name in PER_STATE_DICTS]


class _GraphProbe(torch.autograd.Function):
    """Identity; its saved tensor tells whether a backward has run through it (`RANCache.watch_graph`)."""

    @staticmethod
    def forward(ctx, tensor):
        ctx.save_for_backward(tensor)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad


def cache_transaction(forward):
    """A forward given a `RANCache` either completes or leaves the cache as it was: its layers update the cache one
    after another, and an exception in a later layer (or in the head, or an interrupt) would leave the earlier
    layers' state a step ahead of the others."""
    position = list(inspect.signature(forward).parameters).index("past_key_values")  # `self` included

    @functools.wraps(forward)
    def transaction(*args, **kwargs):
        cache = kwargs.get("past_key_values", args[position] if len(args) > position else None)
        # One snapshot per call: a head's transaction covers its base model's.
        if type(cache) is not RANCache or cache.in_transaction or torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        snapshot = cache.snapshot()
        cache.in_transaction = True
        try:
            return forward(*args, **kwargs)
        except BaseException:
            cache.restore(snapshot)
            raise
        finally:
            cache.in_transaction = False

    return transaction


__all__ = ["RANCache", "RANCacheLayer", "cache_transaction", "check_cache"]
