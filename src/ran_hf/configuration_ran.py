"""Configuration of the Recurrent Attention Network (RAN)."""

import copy
import os
from typing import Literal

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .config_checks import (
    activation_name,
    apply_overrides,
    check_architecture,
    check_built,
    check_label_fields,
    check_new_name,
    check_num_labels,
    check_review_bounds,
    check_token_ids,
    estimated_parameters,
    interval,
    value_errors,
)
from .safe_writes import hub_repo, write_into
from .saved_code import REMOTE_CODE_AUTO_MAP, kept_pipelines, save_code, served_pipelines


# The layer's two designs, as data: the value each gives the fields that differ between them. "official" is the layer
# of the paper and of its checkpoints; "learnable_memory" the causal layer whose memory learns to carry what a later
# window needs (docs/memory.md). `layer_design` picks one when the config is made; a field set on its own overrides it.
_OFF_IN_OFFICIAL = ("residual_stream", "review_qk_norm", "cell_max_pool", "review_salience", "token_shift")
_ON_IN_OFFICIAL = ("cell_input_residual", "review_initial_cell", "attention_qk_activation", "memory_value_activation")
LAYER_DESIGNS = {
    "official": {**dict.fromkeys(_OFF_IN_OFFICIAL, False), **dict.fromkeys(_ON_IN_OFFICIAL, True)},
    "learnable_memory": {**dict.fromkeys(_OFF_IN_OFFICIAL, True), **dict.fromkeys(_ON_IN_OFFICIAL, False)},
}
LAYER_DESIGNS["learnable_memory"]["review_initial_cell"] = True
LAYER_DESIGN_FIELDS = tuple(LAYER_DESIGNS["official"])
# Design fields added after the others: a saved config naming the others but not one of these was trained without it.
_LATER_MEMORY_FIELDS = ("cell_max_pool", "review_salience", "token_shift")

# What a field set on a built model does: one rule per field, which `check_built` applies and docs/architecture.md
# lists. "read": read from the config on every call. "taken up": modules hold a copy of it (dropout rates, the
# embedding's padding index), which the model renews when it next runs or saves (`RANPreTrainedModel.check_config`).
# "refused: ...": the weights or modules were made from it, so the next forward or save raises, naming the fix that
# fits (`config_checks.REFUSED_FIXES`). "labels": a classifier's number of scores, refused where it changes, else
# only names. "metadata": nothing a built model computes reads it (generation reads `model.generation_config`).
_BUILT_FIELDS = ("num_hidden_layers", "hidden_act", "is_causal", "memory_review", "associative_memory")
_BUILT_FIELDS += ("use_cell_residual", "token_pooling", "layer_norm_eps", "tie_word_embeddings", "layer_design")
EDIT_RULES = {
    **dict.fromkeys(("window_size", "min_window_size", "window_overlap", "cell_pooling", "use_rotary"), "read"),
    **dict.fromkeys(("rope_theta", "memory_review_cells", "memory_salient_cells", "scan_implementation"), "read"),
    **dict.fromkeys(("problem_type", "output_attentions", "output_hidden_states", "return_dict"), "read"),
    **dict.fromkeys(("hidden_dropout_prob", "attention_probs_dropout_prob", "pad_token_id"), "taken up"),
    "hidden_size": "refused: build anew",
    **dict.fromkeys(("num_attention_heads", "head_dim", "cutoffs", "div_val"), "refused: keep matching weights"),
    "vocab_size": "refused: resize",
    **dict.fromkeys((*_BUILT_FIELDS, *LAYER_DESIGN_FIELDS), "refused: load with it"),
    **dict.fromkeys(("num_labels", "id2label", "label2id"), "labels"),
    **dict.fromkeys(("initializer_range", "bos_token_id", "eos_token_id", "dtype", "is_encoder_decoder"), "metadata"),
    **dict.fromkeys(("chunk_size_feed_forward", "architectures", "auto_map", "custom_pipelines"), "metadata"),
    **dict.fromkeys(("model_type", "transformers_version", "_name_or_path"), "metadata"),
}


@value_errors
@strict
class RANConfig(PreTrainedConfig):
    r"""
    Configuration of a [`RANModel`]: the Recurrent Attention Network of Li et al. (ACL 2023), which reads a document in
    windows and carries a global perception cell from window to window. Defaults follow the official "V3 EN base"
    model; the official code's names are in brackets. A field is checked when set (type, range) and when the config
    is made or saved (the rules between fields); a wrong value raises `ValueError` naming the field. Every layer is
    built from these fields: Transformers' per-layer values (`per_layer_config`) are refused.

    Args:
        vocab_size (`int`, defaults to 30522): Size of the token vocabulary.
        hidden_size (`int`, defaults to 768): Width D of token states and cells (`embedding_size`).
        num_hidden_layers (`int`, defaults to 2): Number of RAN layers (`ran_layers`).
        num_attention_heads (`int`, defaults to 12): Heads of the window attention (`head_num`).
        head_dim (`int`, defaults to 64): Size of one head (`head_size`), even; need not divide `hidden_size`.
        window_size (`int`, defaults to 256): Tokens per window W.
        min_window_size (`int`, defaults to 16): A final window shorter than this joins the window before it.
        cell_pooling (`"last"`, `"mean"` or `"max"`): How the windows' cells become one document cell.
        token_pooling (`"max"` or `"mean"`): How the pooler summarises the last layer's token states (paper eq. 11).
        memory_review (`bool`, defaults to `True`): Whether tokens attend to the cells of all windows after each layer.
        memory_review_cells (`int`, *optional*): Causal only: a token reviews the cells of only the last N windows
            (and the starting cell), and the cache keeps only those. Can be set on a trained model. None: every cell.
        memory_salient_cells (`int`, *optional*): With `memory_review_cells`: a token also reviews the N older cells
            of highest salience (`review_salience`); decoding memory stays flat. Can be set on a trained model.
        associative_memory (`bool`, defaults to `False`): Causal only: every layer also keeps a head_dim x head_dim
            matrix per head binding finished windows' keys to values by the delta rule (`ran_hf.associative_memory`).
        use_cell_residual (`bool`, defaults to `True`): Whether a cell adds the gated raw cell before it (paper eq. 7).
        use_rotary (`bool`, defaults to `True`): Whether queries and keys are rotated by their position in the window.
        window_overlap (`int`, defaults to 0): Every window also reads the last N tokens of the window before it.
        is_causal (`bool`, defaults to `False`): Causal mode for language modelling: tokens see earlier tokens of their
            window and earlier windows' cells only, and every layer starts from its own learned cell.
        layer_design (`"official"` or `"learnable_memory"`, *optional*): What the nine fields below take where left
            None (`LAYER_DESIGNS`): the paper's layer, or the causal layer whose memory learns what later windows
            need. None: official for the encoder, learnable memory when causal. Resolved when the config is made.
        residual_stream (`bool`): Pre-norm branches on an identity path and a final norm (official: post-norm).
        cell_input_residual (`bool`): A window's raw cell adds the gated residual of its own normalised input.
        review_qk_norm (`bool`): Memory review scores cells by the scaled cosine of un-activated queries and keys.
        review_initial_cell (`bool`): Causal only: memory review can also read the layer's learned starting cell.
        attention_qk_activation (`bool`): Window attention scores swish-activated queries and keys.
        memory_value_activation (`bool`): The memory path (cell write, review values and output) is swish-activated.
        cell_max_pool (`bool`): A raw cell also writes a soft feature-wise maximum of its window's token values.
        review_salience (`bool`): Memory review adds a learned prior (key . a learned vector) to every cell's score.
        token_shift (`bool`): Every token also reads a learned projection of its predecessor's embedding.
        scan_implementation (`str`, defaults to `"auto"`): The cell scan, by its name in `cell_scan.ALL_SCAN_FUNCTIONS`
            (`"reference"`, `"fused"`, `"triton"`; `"auto"`: Triton on CUDA).
        hidden_act (`str`, defaults to `"silu"`): Activation of every projection (swish in the paper).
        hidden_dropout_prob (`float`, defaults to 0.1): Dropout on embeddings, token states, cells and head inputs.
        attention_probs_dropout_prob (`float`, defaults to 0.1): Dropout on attention probabilities.
        layer_norm_eps (`float`, defaults to 1e-7): Epsilon of the norms.
        rope_theta (`float`, defaults to 10000.0): Base of the rotary embedding inside each window.
        initializer_range (`float`, defaults to 0.02): Standard deviation of the normal weight initialisation.
        pad_token_id (`int`, defaults to 0), bos_token_id, eos_token_id (`int`, *optional*): Special token ids.
        tie_word_embeddings (`bool`, *optional*): Whether LM heads share the token embedding; None: not `is_causal`.
        cutoffs (`list[int]`, *optional*): Causal LM only: adaptive input embeddings and softmax
            (`RanNetForAdaptiveLM`), the vocabulary cut at these increasing ids (`ran_hf.adaptive_softmax`).
        div_val (`int`, defaults to 1): With `cutoffs`, cluster i embeds its ids in `hidden_size // div_val**i` dims.

    A config of more than 10^11 parameters (`estimated_parameters()`) is refused unless `RAN_HF_MAX_PARAMETERS` raises
    the bound. A field set on a built model takes effect at once or is refused, naming the fix, when the model next
    runs or saves (`EDIT_RULES`, listed in docs/architecture.md); dropout rates take effect at once.

    Example:

    ```python
    >>> from ran_hf import RANConfig, RANModel

    >>> config = RANConfig(hidden_size=256, num_attention_heads=4, window_size=128, min_window_size=8)
    >>> model = RANModel(config)
    ```
    """

    model_type = "ran"
    keys_to_ignore_at_inference = ["past_key_values", "cells", "last_cell"]
    tasks_registered_here = frozenset()  # pipeline tasks `import ran_hf` registered: left out of `custom_pipelines`

    vocab_size: int = interval(min=1)(default=30522)
    hidden_size: int = interval(min=1)(default=768)
    num_hidden_layers: int = interval(min=1)(default=2)
    num_attention_heads: int = interval(min=1)(default=12)
    head_dim: int = interval(min=1)(default=64)
    window_size: int = interval(min=1)(default=256)
    min_window_size: int = interval(min=1)(default=16)
    cell_pooling: Literal["last", "mean", "max"] = "last"
    token_pooling: Literal["max", "mean"] = "max"
    memory_review: bool = True
    memory_review_cells: int | None = interval(min=1)(default=None)
    memory_salient_cells: int | None = interval(min=1)(default=None)
    associative_memory: bool = False
    use_cell_residual: bool = True
    use_rotary: bool = True
    window_overlap: int = interval(min=0)(default=0)
    is_causal: bool = False
    layer_design: Literal["official", "learnable_memory"] | None = None
    residual_stream: bool | None = None
    cell_input_residual: bool | None = None
    review_qk_norm: bool | None = None
    review_initial_cell: bool | None = None
    attention_qk_activation: bool | None = None
    memory_value_activation: bool | None = None
    cell_max_pool: bool | None = None
    review_salience: bool | None = None
    token_shift: bool | None = None
    scan_implementation: str = "auto"
    hidden_act: str = activation_name(default="silu")
    hidden_dropout_prob: float | int = interval(min=0, max=1, exclude_max=True)(default=0.1)
    attention_probs_dropout_prob: float | int = interval(min=0, max=1, exclude_max=True)(default=0.1)
    layer_norm_eps: float | int = interval(min=0, exclude_min=True)(default=1e-7)
    rope_theta: float | int = interval(min=0, exclude_min=True)(default=10000.0)
    initializer_range: float | int = interval(min=0)(default=0.02)
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool | None = None
    cutoffs: list[int] | None = None
    div_val: int = interval(min=1)(default=1)

    # Every layer is built from the config's own fields, so per-layer values (Transformers' heterogeneous configs) are
    # refused. Without them, and with no name mapped to another (`attribute_map` is empty), Transformers' attribute
    # access (`PreTrainedConfig.__getattribute__`) changes nothing but costs three Python calls a read, and a forward
    # pass reads the config dozens of times: fields are read as plain attributes.
    __getattribute__ = object.__getattribute__

    def _refuse_per_layer_config(self, per_layer_config):
        if per_layer_config is not None:
            raise ValueError(
                "`per_layer_config` is not supported by RANConfig: every RAN layer is built from the config's own "
                "fields. Set the field on the config itself; layers that differ need models of their own."
            )

    per_layer_config = property(PreTrainedConfig.per_layer_config.fget, _refuse_per_layer_config)

    def __post_init__(self, **kwargs):
        # The design, resolved once into plain fields. What was left None follows `is_causal` and `layer_design` if
        # they are set later (`_from_mode`, not saved): as if the config had been made with them.
        given = {name: getattr(self, name) for name in LAYER_DESIGN_FIELDS if getattr(self, name) is not None}
        if self.layer_design is None and len(given) == len(LAYER_DESIGN_FIELDS):  # a saved config names its design
            self.layer_design = next((design for design, values in LAYER_DESIGNS.items() if values == given), None)
        self._from_mode = tuple(name for name in ("layer_design", *LAYER_DESIGN_FIELDS) if getattr(self, name) is None)
        self._resolve_design()
        if self.tie_word_embeddings is None:
            self.tie_word_embeddings = not self.is_causal
        self.auto_map = dict(REMOTE_CODE_AUTO_MAP)  # every saved folder names every head's code
        pipelines = kept_pipelines(self, kwargs.pop("custom_pipelines", None))
        super().__post_init__(**kwargs, **({"custom_pipelines": pipelines} if pipelines else {}))

    @property
    def edits(self) -> int:
        """How many times a field was set since the config was made: a model checks its config again only after
        this changed (`RANPreTrainedModel.check_config`)."""
        return self.__dict__.get("_edits", 0)

    def _resolve_design(self):
        """Give the fields left to the design (`_from_mode`) the values of `layer_design` (or of the mode's)."""
        if "layer_design" in self._from_mode or self.layer_design is None:
            self.__dict__["layer_design"] = "learnable_memory" if self.is_causal else "official"
        for name in self._from_mode:
            if name != "layer_design":
                self.__dict__[name] = LAYER_DESIGNS[self.layer_design][name]

    def __setattr__(self, name, value):
        state = self.__dict__  # (a value set to what it holds never gets here: `value_errors`)
        check_new_name(self, name)  # a misspelt field (`config.windowsize = 3`) is refused, as `@strict` does
        if name == "num_labels" and value is not None:
            check_num_labels(value)  # named as given, before Transformers turns it into `id2label`
        super().__setattr__(name, value)
        state["_edits"] = state.get("_edits", 0) + 1
        if self.__dict__.get("_post_init_done") and name in ("is_causal", "layer_design", *LAYER_DESIGN_FIELDS):
            # Set by hand, a design field no longer follows the design (set to None, it follows it again).
            kept = tuple(field for field in self._from_mode if field != name)
            self._from_mode = kept + (name,) if value is None else kept
            self._resolve_design()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        # Fields given to `from_pretrained` are fields of the config made, checked with the others.
        config_dict = {**config_dict, **{name: kwargs.pop(name) for name in RAN_FIELDS if name in kwargs}}
        # A config that names its memory design but not a later field was saved before that field existed.
        if "residual_stream" in config_dict:
            config_dict = {**dict.fromkeys(_LATER_MEMORY_FIELDS, False), **config_dict}
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict:
        output = super().to_dict()
        output.pop("_from_mode", None)
        output.pop("_edits", None)
        output.pop("custom_pipelines", None)  # what a saved folder serves follows from its model, as `auto_map` does
        return output | ({"custom_pipelines": pipelines} if (pipelines := served_pipelines(self)) else {})

    # The rules between fields: `@strict`'s `validate()` runs every `validate_*` method when the config is made/saved.
    validate_architecture = check_architecture  # then the review bounds and the size bound
    validate_review_bounds = check_review_bounds
    validate_token_ids = check_token_ids
    validate_label_fields = check_label_fields

    @classmethod
    def architecture_fields(cls) -> tuple[str, ...]:
        """The fields a built model's weights or modules depend on (`EDIT_RULES`: "refused: ..."): changing one on a
        built model is refused when it runs or saves, naming the fix. The others take effect at once or are metadata."""
        return tuple(name for name, rule in EDIT_RULES.items() if rule.startswith("refused"))

    def snapshot(self) -> tuple:
        """The RAN fields' values (lists as tuples), as a model built from this config records them."""
        values = map(self.__dict__.get, RAN_FIELDS)
        return tuple(tuple(value) if isinstance(value, list) else value for value in values)

    def check_built(self, snapshot: tuple, model_name: str = "RANModel", num_labels: int | None = None) -> tuple:
        """Compare the fields with the `snapshot` of a model (of class `model_name`, with a classifier of `num_labels`
        scores where it has one): a changed `architecture_fields()` field, or another number of labels, raises naming
        it and the fix (`EDIT_RULES`); then the config is validated. Returns the snapshot the model keeps."""
        return check_built(self, snapshot, RAN_FIELDS, EDIT_RULES, model_name, num_labels)

    def with_causal(self, is_causal: bool) -> "RANConfig":
        """A copy with `is_causal` set (for a head that needs it); fields left to the design follow, as if made so."""
        copied = copy.deepcopy(self)
        copied.is_causal = is_causal
        copied.validate()
        return copied

    @property
    def max_window_length(self) -> int:
        """Longest window a layer can see: a full window plus a merged tail, plus the enrichment tokens."""
        return self.window_size + self.min_window_size - 1 + self.window_overlap

    def estimated_parameters(self, **sizes) -> int:
        """About how many parameters (within a few percent) a `RANModel` of this config holds, task heads aside;
        `sizes` replace the size fields. Pure arithmetic: nothing is built."""
        return estimated_parameters(self, **sizes)

    def update_from_string(self, update_str: str) -> None:
        """Set fields from `"name=value,name=value"` (`--config_overrides`), each value read by its field's type:
        ints, numbers, `true`/`false`, strings, `none`, lists of ints as `[2000,10000]` or `2000;10000`. Unlike
        Transformers' version, every field can be set; nothing is set unless all parse and make a valid config."""
        apply_overrides(self, update_str)

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs):
        """With a model (`architectures` set), first writes the code the folder loads without `ran_hf` (saved_code.py),
        then the config: a model's `save_pretrained(push_to_hub=True)` uploads the files written after it started."""
        with write_into(save_directory) as staging:  # safe_writes.py: no link in the folder is written through
            save_code(self, staging)
            kwargs = hub_repo(save_directory, push_to_hub, kwargs)
            super().save_pretrained(staging, push_to_hub=push_to_hub, **kwargs)


# The fields RANConfig declares besides those of every Transformers config: what a built model records.
_COMMON_FIELDS = PreTrainedConfig.__dataclass_fields__
RAN_FIELDS = tuple(name for name in RANConfig.__dataclass_fields__ if name not in _COMMON_FIELDS)
__all__ = ["RANConfig"]
