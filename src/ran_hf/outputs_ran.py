"""The RAN models' outputs: Transformers' output classes, plus the memory-review weights and the cells."""

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput

from .cache_ran import RANCache


def with_field_names(output_class: type) -> type:
    """`output_class` with its field names kept as class attributes (for `set_field` and `post_init`), and its
    `__post_init__` the lean one."""
    output_class.field_order = tuple(field.name for field in dataclasses.fields(output_class))
    output_class.field_names = frozenset(output_class.field_order)
    output_class.__post_init__ = post_init
    return output_class


def set_field(self, name, value):
    """`ModelOutput.__setattr__` with the class's field names looked up once, not rebuilt from `dataclasses.fields` at
    every assignment: a decoding step builds two outputs of up to ten fields each, and that rebuilding was the largest
    part of its Python calls."""
    if value is not None and name in self.field_names:
        OrderedDict.__setitem__(self, name, value)  # as `ModelOutput.__setattr__`: the item a tuple returns
    object.__setattr__(self, name, value)


def post_init(self):
    """`ModelOutput.__post_init__` where a model builds its output (its first field a tensor or None): every field
    that is not None becomes an item, in field order, without listing and checking the dataclass's fields again
    (for a `RANModelOutput`, 45 Python calls that way). Built from a dict or pairs, as `ModelOutput` allows,
    Transformers' own."""
    state = self.__dict__
    first = state[self.field_order[0]]
    if first is not None and not isinstance(first, torch.Tensor):
        return ModelOutput.__post_init__(self)
    for name in self.field_order:
        value = state[name]
        if value is not None:
            OrderedDict.__setitem__(self, name, value)


@with_field_names
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

    __setattr__ = set_field


MEMORY_ATTENTIONS = """
        memory_attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
            Every layer's memory-review weights, `(batch_size, sequence_length, num_cells)`; see [`RANModelOutput`].
"""


# Every head's output is Transformers' own with one more field, last: `memory_attentions`, the memory-review weights
# every RAN head returns beside `attentions`.


@with_field_names
@dataclass
class RANMaskedLMOutput(MaskedLMOutput):
    __doc__ = f"[`MaskedLMOutput`] with the memory-review weights.\n\n    Args:{MEMORY_ATTENTIONS}"

    memory_attentions: tuple[torch.FloatTensor, ...] | None = None

    __setattr__ = set_field


@with_field_names
@dataclass
class RANSequenceClassifierOutput(SequenceClassifierOutput):
    __doc__ = f"[`SequenceClassifierOutput`] with the memory-review weights.\n\n    Args:{MEMORY_ATTENTIONS}"

    memory_attentions: tuple[torch.FloatTensor, ...] | None = None

    __setattr__ = set_field


@with_field_names
@dataclass
class RANTokenClassifierOutput(TokenClassifierOutput):
    __doc__ = f"[`TokenClassifierOutput`] with the memory-review weights.\n\n    Args:{MEMORY_ATTENTIONS}"

    memory_attentions: tuple[torch.FloatTensor, ...] | None = None

    __setattr__ = set_field


@with_field_names
@dataclass
class RANCausalLMOutputWithPast(CausalLMOutputWithPast):
    __doc__ = f"[`CausalLMOutputWithPast`] with the memory-review weights.\n\n    Args:{MEMORY_ATTENTIONS}"

    memory_attentions: tuple[torch.FloatTensor, ...] | None = None

    __setattr__ = set_field


@with_field_names
@dataclass
class RANQuestionAnsweringModelOutput(QuestionAnsweringModelOutput):
    __doc__ = (
        "[`QuestionAnsweringModelOutput`] with the memory-review weights; `start_logits` and `end_logits` are the "
        f"lowest float at padding positions.\n\n    Args:{MEMORY_ATTENTIONS}"
    )

    memory_attentions: tuple[torch.FloatTensor, ...] | None = None

    __setattr__ = set_field
