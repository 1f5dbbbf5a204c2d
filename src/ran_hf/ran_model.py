"""The bare RAN model (`RANModel`): embeddings, the RAN layers over one window layout, and the official pooler. The
base every model shares (`RANPreTrainedModel`) is in pretrained_ran.py.

`RANModel` builds the window layout once per forward pass (window_layout.py), in the same host synchronisation as the
inputs' value checks (input_checks.py), and runs the layers (ran_layer.py) over it. The heads are in modeling_ran.py.
"""

import functools
import inspect
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .adaptive_softmax import RANAdaptiveEmbedding
from .building_blocks import RANCenteredRMSNorm, RANGatedLinearUnit, RANTokenShift, activation_function, apply_dropout
from .cache_ran import RANCache, RANCacheLayer
from .configuration_ran import RANConfig
from .decode_step import step_positions
from .input_checks import (
    check_cache,
    check_cache_position,
    check_embeds_dtype,
    check_exportable,
    check_initial_cell,
    check_step_inputs,
    check_token_type_ids,
    input_batch_shape,
    joined_checks,
    validate_ran_inputs,
)
from .outputs_ran import RANModelOutput
from .packed_documents import documents_apart
from .pretrained_ran import RANPreTrainedModel, cache_transaction
from .ran_layer import RANLayer
from .window_layout import RANWindowLayout


logger = logging.get_logger(__name__)


class RANEmbeddings(nn.Module):
    """Token embedding, LayerNorm and dropout. RAN has no position embedding: positions enter as rotary, per window."""

    def __init__(self, config: RANConfig):
        super().__init__()
        if config.cutoffs is not None:  # adaptive input embeddings, shared with the adaptive softmax
            self.word_embeddings = RANAdaptiveEmbedding(
                config.vocab_size, config.hidden_size, config.cutoffs, config.div_val
            )
        else:
            self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.norm = RANCenteredRMSNorm(config.hidden_size, config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        if config.token_shift:
            self.token_shift = RANTokenShift(config.hidden_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None):
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        return self.norm(inputs_embeds, self.dropout)  # the dropout inside the norm's kernel on CUDA

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
        self.act = activation_function(config.hidden_act)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, pooled_cell: torch.Tensor, token_states: torch.Tensor, attention_mask: torch.Tensor):
        cell = self.cell_glu(apply_dropout(self.dropout, self.act(self.cell_dense(pooled_cell))))  # (B, D)
        return cell + self.token_dense(self.pool_tokens(token_states, attention_mask.bool()))  # (B, D)


def masked_max(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over axis 1 of (B, X, D) where mask (B, X) is True; 0 for rows with nothing to pool."""
    filled = states.masked_fill(~mask[..., None], torch.finfo(states.dtype).min)
    return torch.where(mask.any(1)[:, None], filled.amax(1), torch.zeros_like(filled[:, 0]))


def masked_mean(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over axis 1 of (B, X, D) where mask (B, X) is True; 0 for rows with nothing to pool."""
    total = (states * mask[..., None]).sum(1)
    return total / mask.sum(1, keepdim=True).clamp(min=1)


def decoding_step_first(forward):
    """A call that is a decoding step (`RANModel.as_decoding_step`: `generate()`'s every token) takes the model's step
    branch before Transformers' config defaults and output capture, which resolve and record nothing for it. Any other
    call goes on to them, its config checked."""

    names = list(inspect.signature(forward).parameters)[1:]  # after `self`

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if args:  # by name, as the step's check reads them (a name given twice: Python's own error, below)
            if any(name in kwargs for name in names[: len(args)]):
                return forward(self, *args, **kwargs)
            kwargs.update(zip(names, args))
        step = self.as_decoding_step(**kwargs)  # (which also checks the config, for either path)
        return step if step is not None else forward(self, **kwargs)

    return wrapper


def memory_attentions_with_attentions(forward):
    """`output_attentions` also asks for the memory-review weights (`memory_attentions`), as it asks Transformers'
    output capture for the cross-attentions of the models that have them."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        asked = kwargs.get("output_attentions", self.config.output_attentions)
        kwargs.setdefault("output_memory_attentions", bool(asked) and self.config.memory_review)
        return forward(self, *args, **kwargs)

    return wrapper


_AS_IS = nullcontext()  # (reusable: one object, no Python call to make it)


def checkpointing_off(layer: RANLayer, when: bool):
    """Run `layer` without gradient checkpointing when it reads or updates a cache: recomputed in the backward pass,
    it would read the cache it had already updated. Training through a cache in chunks then costs full activations.
    Otherwise, as it is."""
    return _checkpointing_off(layer) if when and layer.gradient_checkpointing else _AS_IS


@contextmanager
def _checkpointing_off(layer: RANLayer):
    logger.warning_once("RAN layers that read or update a cache run without gradient checkpointing.")
    layer.gradient_checkpointing = False
    try:
        yield
    finally:
        layer.gradient_checkpointing = True


@auto_docstring(
    custom_intro="The bare RAN encoder (or causal decoder when `config.is_causal`): embeddings, RAN layers, optional "
    "pooler (the official cell transform). A row that packs several documents (`position_ids` that restart, "
    "`cu_seq_lens_q`/`cu_seq_lens_k` or `seq_idx`, as `DataCollatorWithFlattening` passes them) reads each document "
    "as if it were alone; cells and pooled outputs then have one row per document (docs/training.md)."
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
        self.norm = RANCenteredRMSNorm(config.hidden_size, config.layer_norm_eps) if config.residual_stream else None
        self.pooler = RANPooler(config) if add_pooling_layer else None
        self.embeddings_shift_tokens = config.token_shift  # a size field: fixed once built
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def as_decoding_step(self, input_ids=None, attention_mask=None, inputs_embeds=None, past_key_values=None,
                         output_attentions=None, output_hidden_states=None, initial_cell=None, token_type_ids=None,
                         **kwargs) -> RANModelOutput | None:  # fmt: skip
        """This call (`forward`'s arguments) as a decoding step (`decode_step`) where it is one, else None: one new
        real token per row (no attention mask: all are real) continuing an initialised `RANCache`, in inference, with
        nothing recorded on the way; its inputs are checked as the forward checks them (`check_step_inputs`).
        Everything else, and the options a step does not compute (salient cells), takes the
        general forward pass. The cache is checked once, when first handed over; the config only after an edit; a
        `cache_position`, where one is given, against the cache."""
        compiling = torch.compiler.is_compiling()  # asked once a step: each ask is two Python calls
        if not compiling:
            if kwargs.get("cache_position") is not None:  # Transformers' own; RAN's cache needs none
                new_positions = (input_ids if input_ids is not None else inputs_embeds).shape[1]
                check_cache_position(kwargs["cache_position"], past_key_values, new_positions)
            if type(past_key_values) is not RANCache:
                return None  # no step: the forward checks the config
            self.check_config()  # a field the model was built from, changed since, is named
        if (
            type(past_key_values) is not RANCache
            or past_key_values.lengths is None
            or attention_mask is not None
            or token_type_ids is not None
            or initial_cell is not None
            or self.training
            or torch.is_grad_enabled()
            or not self.decodes_in_steps
            or output_attentions
            or output_hidden_states
            or kwargs.get("return_dict") is False
            or "is_causal" in kwargs  # a field set for this call: the general pass checks it
            or self.pooler is not None
        ):
            return None
        settings = self.step_settings  # (the config's fields, read once per edit: each read is three Python calls)
        shape = input_batch_shape(input_ids, inputs_embeds, settings.hidden_size)  # (no value read)
        if shape[1] != 1:
            return None
        if shape[0] != past_key_values.lengths.shape[0]:
            past_key_values.past_lengths(shape[0], None)  # as many rows as the cache, or a clear error
        weights_dtype = None if inputs_embeds is None else self.embeddings.norm.weight.dtype  # (what embeddings match)
        check_step_inputs(self.config, settings.vocab_size, input_ids, inputs_embeds, shape, weights_dtype, compiling)
        if past_key_values.checked_by is not self.checked_config:  # handed over: checked once
            check_cache(past_key_values, self.config, self.embeddings.norm.weight.dtype)
            past_key_values.checked_by = self.checked_config
            for layer in past_key_values.layers:  # what another model's steps kept, this model computes anew
                layer.memo_of = None
        return self.decode_step(input_ids, inputs_embeds, past_key_values, compiling)

    def decode_step(self, input_ids, inputs_embeds, cache: RANCache, compiling: bool) -> RANModelOutput:
        """One new token per row against `cache`: every layer's step branch (`RANLayer.decode_token`), in shapes that
        do not change from step to step and without a host read. Returns the last layer's token states and the cache;
        a step computes no cells for the output (`cells`, `pooled_cell` and `last_cell` are None)."""
        embeddings = self.embeddings(input_ids=input_ids, inputs_embeds=inputs_embeds)[:, 0]  # (B, D)
        lengths = None if compiling else cache.known_lengths()  # (compiled: none read)
        if lengths is not None:
            cache.reserve(max(lengths) + 1)  # room for a cell each row may write
        at = step_positions(self.step_settings, cache, lengths, embeddings.dtype, embeddings.device)  # every layer's
        states = embeddings
        if self.embeddings_shift_tokens:
            states = embeddings + self.embeddings.token_shift(cache.layers[0].last_token)
        for layer, layer_cache in zip(self.layers, cache.layers):
            states = layer(states, None, at, layer_cache)[0]
        if self.norm is not None:
            states = self.norm(states)
        if self.embeddings_shift_tokens:
            cache.layers[0].last_token = embeddings
        cache.advance_one_token(compiling)
        return RANModelOutput(last_hidden_state=states[:, None], past_key_values=cache)

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def training_window_size(self, cache: RANCache | None) -> int | None:
        """This training pass's window size, drawn from `config.training_window_sizes` (torch's generator): a
        sequence of the training length then spans as many windows as longer ones do, so the cell and the memories
        learn to carry what they will carry there. None (the config's) where a cache is carried, whose windows must
        keep one size; inference does not ask."""
        sizes, window = self.config.training_window_sizes, self.config.window_size
        if sizes in (None, [window]) or cache is not None or torch.compiler.is_compiling():
            return None
        size = sizes[int(torch.randint(len(sizes), ()))]
        return None if size == window else size  # the config's: the layout inference builds

    @cache_transaction  # a forward that fails leaves `past_key_values` as it was
    @decoding_step_first
    @documents_apart
    @memory_attentions_with_attentions
    @merge_with_config_defaults
    @capture_outputs
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
            Also return the embedding output and every layer's token states (recorded by Transformers' output
            capture; an index or a list of indices, negative ones too, returns only those, None in place of the
            others).
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
        if not torch.compiler.is_compiling():
            self.check_config()  # again, after Transformers' defaults merger set what a call passed (`is_causal`)
        check_exportable(past_key_values, use_cache)
        is_causal = self.config.is_causal
        if (past_key_values is not None or use_cache) and not is_causal:
            raise ValueError("`past_key_values`/`use_cache` need a causal model (`is_causal=True`).")
        if past_key_values is not None and getattr(past_key_values, "checked_by", None) is not self.checked_config:
            check_cache(past_key_values, self.config, self.embeddings.norm.weight.dtype)
            past_key_values.checked_by = self.checked_config  # a decoding step trusts it while the config stays
        past_positions = past_key_values.get_seq_length() if past_key_values is not None else 0
        batch_shape = input_batch_shape(input_ids, inputs_embeds, self.config.hidden_size)
        check_embeds_dtype(inputs_embeds, self.embeddings.norm.weight.dtype)
        cell_checks = type_checks = None
        if initial_cell is not None:
            cell_checks = check_initial_cell(initial_cell, batch_shape, self.config.hidden_size, past_positions)
        if token_type_ids is not None:
            type_checks = check_token_type_ids(token_type_ids, batch_shape, attention_mask, self.config)
        (batch_size, padded_length), input_checks = validate_ran_inputs(
            self.config, input_ids, attention_mask, inputs_embeds, past_positions, batch_shape
        )
        if input_checks is not None:  # not compiled: the segments and the starting cell are read with the inputs
            input_checks = joined_checks(type_checks, cell_checks, input_checks)
        kwargs.pop("output_memory_attentions", None)  # read by the output capture
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        if output_attentions and self.config._attn_implementation != "eager":
            logger.warning_once(
                f"`output_attentions=True` returns window attention weights only with the eager attention; this model "
                f"runs {self.config._attn_implementation!r}, so `attentions` is empty (`memory_attentions` are "
                'returned). Load it with `attn_implementation="eager"` to get both.'
            )
        device = (input_ids if input_ids is not None else inputs_embeds).device
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, padded_length, dtype=torch.bool, device=device)
        attention_mask = attention_mask[:, -padded_length:]  # generate() passes the mask of the whole text so far
        if use_cache and past_key_values is None:
            past_key_values = RANCache(self.config)
            past_key_values.checked_by = self.checked_config
        past_lengths = None if past_key_values is None else past_key_values.past_lengths(batch_size, device)
        # The layout's sizes and the inputs' checks in one host synchronisation, before any token is embedded.
        layout = RANWindowLayout.from_attention_mask(
            attention_mask,
            self.config,
            past_lengths,
            None if input_checks is None else input_checks.values,
            token_type_ids=token_type_ids,
            window_size=self.training_window_size(past_key_values) if self.training else None,
        )
        if input_checks is not None:
            input_checks.judge(layout.read_values)  # a bad input is named before any token is embedded
        if past_key_values is not None:
            past_key_values.make_room(layout.most_finished_windows)
        embeddings = self.embeddings(input_ids=input_ids, inputs_embeds=inputs_embeds)  # (B, L, D)

        token_states = layout.from_padded(embeddings)  # (T, D)
        if self.embeddings_shift_tokens:
            first_cache = past_key_values.layers[0] if past_key_values is not None else None
            token_states = self.embeddings.shift_tokens(token_states, layout, first_cache)
        if initial_cell is not None:
            initial_cell = initial_cell.to(device=embeddings.device, dtype=embeddings.dtype)
        hidden_states = layout.to_padded(token_states)  # (B, L, D), zeros at padding: a view where there is none
        del embeddings, token_states  # the first layer reads its tokens, and the later ones need them no more
        cell = initial_cell  # None: the first layer starts from its own learned cell
        for layer in self.layers:
            if is_causal and layer.layer_idx > 0:
                cell = None  # every later causal layer starts from its own learned cell: the cell below has read ahead
            layer_cache = past_key_values.layers[layer.layer_idx] if past_key_values is not None else None
            with checkpointing_off(layer, when=layer_cache is not None and self.training):
                # By position: reentrant gradient checkpointing returns the layer's `LayerOutputs` as a plain tuple.
                hidden_states, raw_cells, cell, *_ = layer(
                    hidden_states, cell, layout=layout, cache=layer_cache, output_attentions=output_attentions
                )
        token_states = layout.from_padded(hidden_states)  # (T, D)

        if past_key_values is not None:
            past_key_values.advance(layout.lengths, padded_length, layout.total_lengths)
        if self.norm is not None:
            token_states = self.norm(token_states)
        last_hidden_state = layout.to_padded(token_states)  # with hidden states, recorded as the last
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
            past_key_values=past_key_values,
        )
