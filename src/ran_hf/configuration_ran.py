"""Configuration of the Recurrent Attention Network (RAN). Every field is described in docs/configuration.md."""

import copy
import math
import os
from typing import Literal

from huggingface_hub.dataclasses import as_validated_field, strict
from transformers import PreTrainedConfig

from .files.safe_writes import hub_repo, write_into
from .files.saved_code import REMOTE_CODE_AUTO_MAP, kept_pipelines, save_code, served_pipelines


# The layer's two designs, as the values they give nine fields (docs/memory.md): "official" is the paper's layer,
# "learnable_memory" the causal layer whose memory learns what later windows need. A field set on its own wins.
_ON_IN_OFFICIAL = ("cell_input_residual", "review_initial_cell", "attention_qk_activation", "memory_value_activation")
LAYER_DESIGN_FIELDS = ("residual_stream", "review_qk_norm", "cell_max_pool", "review_salience", "token_shift",
                       *_ON_IN_OFFICIAL)  # fmt: skip
LAYER_DESIGNS = {
    "official": {name: name in _ON_IN_OFFICIAL for name in LAYER_DESIGN_FIELDS},
    "learnable_memory": {
        name: name not in _ON_IN_OFFICIAL or name == "review_initial_cell" for name in LAYER_DESIGN_FIELDS
    },
}
# Fields left None follow the design (`to_dict` writes what they resolved to): the design fields, and the causal
# learnable-memory layer's associative memory with its key convolution and training window sizes (docs/memory.md).
FOLLOWING_FIELDS = ("layer_design", *LAYER_DESIGN_FIELDS, "associative_memory", "associative_key_conv",
                    "training_window_sizes")  # fmt: skip
_WINDOW_FIELDS = ("window_size", "min_window_size", "window_overlap")  # the training window sizes follow them
MEMORY_KEY_CONV = 4
_PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")


# Our own field validators: Transformers' (`transformers.utils.type_validators`) import its tokenizer, video and
# activation modules, which take seconds and load triton and torch.onnx; and its `interval` accepts inf.
def interval(low: float, high: float = math.inf, open_low: bool = False, open_high: bool = False):
    """A finite number in [low, high] (or open at either end); None passes (an optional field left unset)."""

    @as_validated_field
    def check(value):
        if value is None:
            return
        inside = (low < value if open_low else low <= value) and (value < high if open_high else value <= high)
        if not (math.isfinite(value) and inside):
            raise ValueError(f"must be finite and in {'[('[open_low]}{low}, {high}{'])'[open_high]}, got {value}")

    return check


@as_validated_field
def activation_name(value: str):
    from transformers.activations import ACT2FN  # here, not at import: it costs about as much as Transformers

    if value not in ACT2FN:
        raise ValueError(f"must be the name of a Transformers activation ({', '.join(sorted(ACT2FN))}), got {value!r}")


def misspells(name: str, field: str) -> bool:
    """Whether `name` is `field` written otherwise (`windowsize`), cut short by at most three letters (`cell_pool`) or
    with two neighbouring letters swapped (`is_casual`); not another model's name for a like field
    (`layer_norm_epsilon`, which Transformers' tests set on every config)."""
    short, long = sorted((name.replace("_", "").lower(), field.replace("_", "").lower()), key=len)
    swaps = {long[:i] + long[i + 1] + long[i] + long[i + 2 :] for i in range(len(long) - 1)}
    return short == long or (
        len(short) > 4 and (long.startswith(short) and len(long) - len(short) <= 3 or short in swaps)
    )


@strict
class RANConfig(PreTrainedConfig):
    r"""
    Configuration of a [`RANModel`], the Recurrent Attention Network of Li et al. (ACL 2023): it reads a document in
    windows and carries a global perception cell from window to window. Defaults follow the official "V3 EN base"
    model; docs/configuration.md describes every field. A field is checked when set, the rules between fields when the
    config is made, saved or run; set on a built model, an `architecture_fields` field is refused when it next runs.

    ```python
    >>> from ran_hf import RANConfig, RANModel

    >>> model = RANModel(RANConfig(hidden_size=256, num_attention_heads=4, window_size=128, min_window_size=8))
    ```
    """

    model_type = "ran"
    keys_to_ignore_at_inference = ["past_key_values", "cells", "last_cell"]
    tasks_registered_here = frozenset()  # pipeline tasks `import ran_hf` registered: left out of `custom_pipelines`
    max_parameters = 10**11  # a larger config is refused (raise it on the class for a model this large)
    # What a built model's weights or modules were made from: set on its config, they are refused when it runs or saves.
    # (`is_causal` and `layer_design` first: an edit of either is named, not the fields that follow it)
    architecture_fields = ("is_causal", "layer_design", "vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "head_dim", "memory_review", "associative_memory",
                           "associative_key_conv", "associative_decay", "use_cell_residual", "hidden_act",
                           "token_pooling", "layer_norm_eps", "tie_word_embeddings", "cutoffs", "div_val",
                           "review_log_scaling", *LAYER_DESIGN_FIELDS)  # fmt: skip

    vocab_size: int = interval(1)(default=30522)
    hidden_size: int = interval(1)(default=768)
    num_hidden_layers: int = interval(1)(default=2)
    num_attention_heads: int = interval(1)(default=12)
    head_dim: int = interval(2)(default=64)
    window_size: int = interval(2)(default=256)
    min_window_size: int = interval(1)(default=16)
    cell_pooling: Literal["last", "mean", "max"] = "last"
    token_pooling: Literal["max", "mean"] = "max"
    memory_review: bool = True
    memory_review_cells: int | None = interval(1)(default=None)
    memory_salient_cells: int | None = interval(1)(default=None)
    associative_memory: bool | None = None
    associative_key_conv: int | None = interval(0)(default=None)
    associative_decay: bool = False
    use_cell_residual: bool = True
    use_rotary: bool = True
    window_overlap: int = interval(0)(default=0)
    training_window_sizes: list[int] | None = None
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
    review_log_scaling: bool = False
    token_shift: bool | None = None
    scan_implementation: str = "auto"
    hidden_act: str = activation_name(default="silu")
    hidden_dropout_prob: float | int = interval(0, 1, open_high=True)(default=0.1)
    attention_probs_dropout_prob: float | int = interval(0, 1, open_high=True)(default=0.1)
    layer_norm_eps: float | int = interval(0, open_low=True)(default=1e-7)
    rope_parameters: dict | None = None
    initializer_range: float | int = interval(0)(default=0.02)
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool | None = None
    cutoffs: list[int] | None = None
    div_val: int = interval(1)(default=1)

    def __post_init__(self, **kwargs):
        # The design, resolved once into plain fields; those left None (`_from_design`, not saved) follow `is_causal`
        # and `layer_design` if they are set later, as if the config had been made with them.
        given = {name: getattr(self, name) for name in LAYER_DESIGN_FIELDS if getattr(self, name) is not None}
        if self.layer_design is None and len(given) == len(LAYER_DESIGN_FIELDS):  # a saved config names its design
            self.layer_design = next((design for design, values in LAYER_DESIGNS.items() if values == given), None)
        self._from_design = [name for name in FOLLOWING_FIELDS if getattr(self, name) is None]
        self._follow_design()
        self.tie_word_embeddings = not self.is_causal if self.tie_word_embeddings is None else self.tie_word_embeddings
        self.auto_map = dict(REMOTE_CODE_AUTO_MAP)  # every saved folder names every head's code
        pipelines = kept_pipelines(self, kwargs.pop("custom_pipelines", None))
        super().__post_init__(**kwargs, **({"custom_pipelines": pipelines} if pipelines else {}))

    def _follow_design(self):
        if "layer_design" in self._from_design or self.layer_design is None:
            self.__dict__["layer_design"] = "learnable_memory" if self.is_causal else "official"
        design = LAYER_DESIGNS[self.layer_design]
        self.__dict__.update({name: design[name] for name in self._from_design if name in design})
        if "associative_memory" in self._from_design:  # the learnable-memory design's, causal only
            self.__dict__["associative_memory"] = self.is_causal and self.layer_design == "learnable_memory"
        if "associative_key_conv" in self._from_design:  # the memory's; 0: none
            self.__dict__["associative_key_conv"] = MEMORY_KEY_CONV if self.associative_memory else 0
        if "training_window_sizes" in self._from_design:  # the memory's: a short text then spans several windows
            self.__dict__["training_window_sizes"] = self._memory_window_sizes() if self.associative_memory else None

    def _memory_window_sizes(self) -> list[int]:
        """A quarter, half and all of the window, those a window can have."""
        window, floor = self.window_size, max(1, self.min_window_size, self.window_overlap)
        return sorted({size for size in (window // 4, window // 2) if size > floor} | {window})

    def __setattr__(self, name, value):
        if self.__dict__.get(name, self) is value:  # set to what it holds (Transformers sets `is_causal` per call)
            return
        if name not in self.__dataclass_fields__ and name not in self.__dict__ and not hasattr(type(self), name):
            close = [field for field in RAN_FIELDS if misspells(name, field)]
            if close and not name.startswith("_"):  # other new names pass: Transformers attaches its own
                raise ValueError(f"`{name}` is not a field of RANConfig (did you mean {close[0]!r}?).")
        if name == "num_labels" and not (type(value) is int and value >= 1):  # as given, before it becomes id2label
            raise ValueError(f"`num_labels` must be >= 1, got {value!r}: a classification head needs a class.")
        if name == "per_layer_config" and value is not None:
            raise ValueError("`per_layer_config` is not supported: every RAN layer is built from the config's fields.")
        super().__setattr__(name, value)
        self.__dict__["edits"] = self.__dict__.get("edits", 0) + 1  # a model checks its config again after an edit
        if self.__dict__.get("_from_design") is not None and name in ("is_causal", *_WINDOW_FIELDS, *FOLLOWING_FIELDS):
            # Set by hand, a design field no longer follows the design; set to None, it follows it again.
            self._from_design = [field for field in self._from_design if field != name] + [name] * (value is None)
            self._follow_design()

    def validate_architecture(self):
        window, cutoffs, theta = self.window_size, self.cutoffs or [], self.rope_theta
        sizes = self.training_window_sizes
        rules = [
            (self.min_window_size >= window, f"`min_window_size` ({self.min_window_size}) must be smaller than "),
            (self.window_overlap >= window, f"`window_overlap` ({self.window_overlap}) must be smaller than "),
            (self.head_dim % 2, f"`head_dim` must be even (rotary embedding rotates pairs), got {self.head_dim}"),
            (sizes is not None and not (sizes and all(size > max(1, self.min_window_size, self.window_overlap)
             for size in sizes)), f"`training_window_sizes` must be window sizes above `min_window_size` "
             f"({self.min_window_size}) and `window_overlap` ({self.window_overlap}), got {self.training_window_sizes}"),
            (self.memory_review_cells is not None and not self.is_causal, "`memory_review_cells` bounds what a causal "
             "model's tokens review; the bidirectional encoder reviews every cell: set `is_causal=True` or None"),
            (self.memory_salient_cells is not None and self.memory_review_cells is None, "`memory_salient_cells` "
             "keeps cells beyond the last `memory_review_cells`, but `memory_review_cells` is None: set both"),
            (self.memory_salient_cells is not None and not self.review_salience, "`memory_salient_cells` ranks "
             "cells by `review_salience`, which this config turns off"),
            (not self.is_causal and (self.associative_memory or self.cutoffs is not None), "`associative_memory` "
             "and `cutoffs` belong to the causal LM (`RANForCausalLM`, `run_clm.py`, `is_causal=True`): leave them out"),
            (self.associative_key_conv and not self.associative_memory, "`associative_key_conv` "
             "convolves the keys of the associative memory, which this config turns off: set `associative_memory`, or "
             "`associative_key_conv=0`"),
            (self.associative_decay and not self.associative_memory, "`associative_decay` decays the associative "
             "memory, which this config turns off: set `associative_memory`"),
            (self.is_encoder_decoder, "`is_encoder_decoder=True` describes a decoder reading an encoder's output; a "
             "RAN is one stack (`RANForPrefixLM` reads source and target as one text): leave it False"),
            (not (type(theta) in (int, float) and 0 < theta < math.inf), f"`rope_theta` must be finite and > 0, got "
             f"{theta!r}"),
            ((self.rope_parameters or {}).get("rope_type", "default") != "default", "`rope_parameters` must have "
             "`rope_type` 'default': positions are short, within a window"),
            (cutoffs != sorted(set(cutoffs)) or not all(0 < cutoff < self.vocab_size for cutoff in cutoffs),
             f"`cutoffs` must be strictly increasing ids in (0, vocab_size={self.vocab_size}), got {cutoffs}"),
            (self.hidden_size // self.div_val ** len(cutoffs) < 1, f"`div_val={self.div_val}` leaves the last of "
             f"{len(cutoffs) + 1} clusters no dimension: use fewer cutoffs or a smaller div_val"),
            (self.id2label == {}, "`id2label` names no label: a classification head needs a class"),
            (self.problem_type not in (None, *_PROBLEM_TYPES), f"`problem_type` must be one of {_PROBLEM_TYPES} or "
             f"None (from the labels), got {self.problem_type!r}"),
        ]  # fmt: skip
        if (size := self.estimated_parameters()) > self.max_parameters:
            largest = max(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"), key=self._share)
            rules.append((True, f"This config describes about {size:.2g} parameters, mostly through `{largest}="
                          f"{getattr(self, largest)}`, more than `RANConfig.max_parameters` ({self.max_parameters:.2g}):"
                          " if a model this large is meant, raise it (`RANConfig.max_parameters = ...`)"))  # fmt: skip
        if broken := [message for failed, message in rules if failed]:
            raise ValueError(broken[0] + (f"`window_size` ({window})." if broken[0].endswith("than ") else "."))

    def validate_token_ids(self):
        """Transformers only warns (configs on the Hub store `pad_token_id=-1`); a RAN's embedding would fail later."""
        eos_ids = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        for name, token in [("pad_token_id", self.pad_token_id), ("bos_token_id", self.bos_token_id)] + [
            ("eos_token_id", token) for token in eos_ids
        ]:
            if token is not None and not 0 <= token < self.vocab_size:
                raise ValueError(f"`{name}` ({token}) is outside the vocabulary [0, {self.vocab_size - 1}].")

    def estimated_parameters(self, **sizes) -> int:
        """About how many parameters (within a few percent) a `RANModel` of this config holds, task heads aside;
        `sizes` replace the config's size fields. Nothing is built."""
        vocab, width, depth, heads, head_dim = (sizes.get(name, getattr(self, name)) for name in _SIZE_FIELDS)
        embedding = vocab * width
        if self.cutoffs and self.div_val > 1 and self.cutoffs[-1] < vocab:  # adaptive: narrower clusters
            bounds, dims = [0, *self.cutoffs, vocab], [width // self.div_val**i for i in range(len(self.cutoffs) + 1)]
            embedding = sum((high - low + width) * dim for low, high, dim in zip(bounds, bounds[1:], dims))
        layer = 4 * heads * head_dim * width + 4 * width * width + 3 * heads * head_dim + 12 * width
        layer += (6 * width * width + 9 * width) * self.memory_review + heads * (
            (width + 1) * (1 + self.associative_decay) + 1 + head_dim * (self.associative_key_conv or 0)
        ) * self.associative_memory
        return embedding + depth * layer + 4 * width * width  # and the pooler

    def _share(self, name: str) -> int:
        """How much smaller the model gets with `name` at its default: what makes it large."""
        return -self.estimated_parameters(**{name: self.__dataclass_fields__[name].default})

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        # Fields given to `from_pretrained` are fields of the config made, checked with the others; a config naming
        # its design but not the fields added later (`cell_max_pool`, ...) was saved before they existed.
        if "transformers_version" in config_dict or "residual_stream" in config_dict:  # saved: the memory it had
            config_dict = {"associative_memory": False} | config_dict
            if config_dict.get("associative_key_conv", 0) is None:
                config_dict["associative_key_conv"] = 0  # saved when None meant no convolution
            if config_dict.get("training_window_sizes", 0) is None and config_dict["associative_memory"]:
                config_dict["training_window_sizes"] = [config_dict.get("window_size", 256)]  # None: the window alone
        given = {name: kwargs.pop(name) for name in cls.__dataclass_fields__ if name in kwargs}
        if "associative_memory" in given:  # the memory's convolution and window sizes follow it, unless given too
            given = {"associative_key_conv": None, "training_window_sizes": None} | given
        config_dict = config_dict | given
        if "residual_stream" in config_dict:
            config_dict = dict.fromkeys(("cell_max_pool", "review_salience", "token_shift"), False) | config_dict
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict:
        output = {k: v for k, v in super().to_dict().items() if k not in ("_from_design", "edits", "custom_pipelines")}
        return output | ({"custom_pipelines": pipelines} if (pipelines := served_pipelines(self)) else {})

    @property
    def rope_theta(self) -> float:
        return (self.rope_parameters or {}).get("rope_theta", 10000.0)

    @rope_theta.setter
    def rope_theta(self, value: float):  # (Transformers' legacy name: set into `rope_parameters`)
        self.rope_parameters = {"rope_type": "default", **(self.rope_parameters or {}), "rope_theta": value}

    def with_causal(self, is_causal: bool) -> "RANConfig":
        """A copy with `is_causal` set (for a head that needs it); fields left to the design follow, as if made so."""
        copied = copy.deepcopy(self)
        copied.is_causal = is_causal
        copied.validate()
        return copied

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs):
        """With a model (`architectures` set), first writes the code the folder loads without `ran_hf` (saved_code.py)."""
        with write_into(save_directory) as staging:  # safe_writes.py: no link in the folder is written through
            save_code(self, staging)
            super().save_pretrained(staging, push_to_hub=push_to_hub, **hub_repo(save_directory, push_to_hub, kwargs))


# The fields RANConfig declares besides those of every Transformers config.
RAN_FIELDS = tuple(
    name for name in RANConfig.__dataclass_fields__ if name not in PreTrainedConfig.__dataclass_fields__
)
__all__ = ["RANConfig"]
