"""Configuration of the Recurrent Attention Network (RAN)."""

import difflib
import math
import os
import shutil
import sys
import types
import typing
import weakref
from dataclasses import fields
from pathlib import Path

from transformers import GenerationConfig, PreTrainedConfig
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import logging

logger = logging.get_logger(__name__)

# The layer's two designs, as data: the value each gives every field that differs between them. "official" is the
# layer of the paper and of its checkpoints; "learnable_memory" the causal layer whose memory learns to carry what a
# later window needs (docs/memory.md). `layer_design` picks one (by default the encoder's is official, a causal
# model's learnable); a field set on its own overrides it (an ablation). `RANConfig.layer_option` is the one lookup.
LAYER_DESIGNS = {
    "official": {
        "residual_stream": False,
        "cell_input_residual": True,
        "review_qk_norm": False,
        "review_initial_cell": True,
        "attention_qk_activation": True,
        "memory_value_activation": True,
        "cell_max_pool": False,
        "review_salience": False,
        "token_shift": False,
    },
    "learnable_memory": {
        "residual_stream": True,
        "cell_input_residual": False,
        "review_qk_norm": True,
        "review_initial_cell": True,
        "attention_qk_activation": False,
        "memory_value_activation": False,
        "cell_max_pool": True,
        "review_salience": True,
        "token_shift": True,
    },
}
LAYER_DESIGN_FIELDS = tuple(LAYER_DESIGNS["official"])
# Design fields added after others were saved: a saved config that names the older fields but not one of these
# was trained without it.
_LATER_MEMORY_FIELDS = ("cell_max_pool", "review_salience", "token_shift")
_CELL_POOLINGS = ("last", "mean", "max")
_PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
# The size check (`RANConfig.estimated_parameters`): a config describing a larger model is refused unless this
# environment variable raises the bound.
MAX_PARAMETERS_VARIABLE = "RAN_HF_MAX_PARAMETERS"
DEFAULT_MAX_PARAMETERS = 10**11
_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")
_TOKEN_POOLINGS = ("max", "mean")

# Keywords every Transformers config may receive besides its fields (from `from_pretrained`, `AutoConfig`, configs
# saved by other versions); anything else given to `RANConfig` is most likely a typo.
_GENERIC_CONFIG_KEYWORDS = frozenset(
    {
        "num_labels",
        "torch_dtype",
        "name_or_path",
        "_name_or_path",
        "_commit_hash",
        "output_attentions",
        "attn_implementation",
        "experts_implementation",
        "_attn_implementation_internal",
        "_experts_implementation_internal",
        "per_layer_config",
        "rope_scaling",
        "auto_map",
        "model_type",
        "finetuning_task",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "sep_token_id",
        "decoder_start_token_id",
        "is_decoder",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "torchscript",
        "use_bfloat16",
        "tf_legacy_loss",
        "pruned_heads",
        "tie_last_hidden_states",
        "custom_pipelines",
    }
)


def _code_here(module: str) -> bool:
    """Whether `module`.py is beside this file: always in the package; in a copy loaded from a saved folder, where
    Transformers fetched that module."""
    return Path(__file__).with_name(f"{module}.py").is_file()


def _generation_keywords() -> frozenset:
    """Generation settings that older configs carry; Transformers moves them to the generation config."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    return frozenset(defaults()) if defaults is not None else frozenset()


REMOTE_CODE_AUTO_MAP = {
    "AutoConfig": "configuration_ran.RANConfig",
    "AutoModel": "modeling_ran.RANModel",
    "AutoModelForCausalLM": "modeling_ran.RANForCausalLM",
    "AutoModelForMaskedLM": "modeling_ran.RANForMaskedLM",
    "AutoModelForQuestionAnswering": "modeling_ran.RANForQuestionAnswering",
    "AutoModelForSequenceClassification": "modeling_ran.RANForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_ran.RANForTokenClassification",
}

# The pipeline a question-answering model's folder ships (question_answering.py) and names in `custom_pipelines`,
# so that `pipeline(QUESTION_ANSWERING_TASK, model=folder, trust_remote_code=True)` runs without `ran_hf`.
QUESTION_ANSWERING_TASK = "extractive-question-answering"
QUESTION_ANSWERING_PIPELINE = {
    "impl": "question_answering.ExtractiveQuestionAnsweringPipeline",
    "pt": ["AutoModelForQuestionAnswering"],
    "type": "text",
}


class RANConfig(PreTrainedConfig):
    r"""
    Configuration of a [`RANModel`]: the Recurrent Attention Network of Li et al. (ACL 2023), which reads a document in
    windows and carries a global perception cell from window to window. Defaults follow the official "V3 EN base"
    model (2 RAN layers, window 256, minimum window 16).

    Args:
        vocab_size (`int`, *optional*, defaults to 30522):
            Size of the token vocabulary.
        hidden_size (`int`, *optional*, defaults to 768):
            Width D of token states and cells (`embedding_size` in the official code).
        num_hidden_layers (`int`, *optional*, defaults to 2):
            Number of RAN layers (`ran_layers`).
        num_attention_heads (`int`, *optional*, defaults to 12):
            Heads of the window attention (`head_num`).
        head_dim (`int`, *optional*, defaults to 64):
            Size of one head (`head_size`). Queries, keys and values project D -> heads * head_dim; it need not divide
            `hidden_size`.
        window_size (`int`, *optional*, defaults to 256):
            Tokens per window W.
        min_window_size (`int`, *optional*, defaults to 16):
            A final window shorter than this is merged into the window before it.
        cell_pooling (`str`, *optional*, defaults to `"last"`):
            How the per-window cells become one document cell: `"last"` (final cell), `"mean"` or `"max"` (over the
            raw cell outputs of all windows).
        token_pooling (`str`, *optional*, defaults to `"max"`):
            How the pooler summarises the last layer's token states (paper eq. 11): `"max"` as in the paper, or
            `"mean"` (the paper's first ablation).
        memory_review (`bool`, *optional*, defaults to `True`):
            Whether token states attend to the cells of all windows at the end of each layer.
        memory_review_cells (`int`, *optional*):
            Causal models only: a token reviews the cells of the last `memory_review_cells` windows before its own
            (and the starting cell) instead of all of them, and the cache keeps only those, so that decoding memory
            stays the same at any context length. What lies further back reaches a token only through the cell
            carried from window to window. `None` (default): every earlier window's cell. Can be set on a trained
            model; a model trained on texts of at most that many windows computes the same as without it there.
        memory_salient_cells (`int`, *optional*):
            With `memory_review_cells`: besides the cells of the last `memory_review_cells` windows, a token also
            reviews the `memory_salient_cells` older cells of highest salience (the learned prior of
            `review_salience`), and the cache keeps those too. Decoding memory stays flat (at most
            `memory_review_cells + memory_salient_cells` cells per layer), and a cell that stood out, such as the
            one holding a key, stays readable however far back it lies. Can be set on a trained model. `None`
            (default): older cells are dropped.
        associative_memory (`bool`, *optional*, defaults to `False`):
            Causal models only: whether every layer also keeps an associative memory, a head_dim x head_dim matrix
            per head into which each finished window binds its tokens' window-attention keys to their values by
            the delta rule, and which every later token reads with its query (`ran_hf.associative_memory`). It keeps
            apart what a cell mixes (several key-value pairs in one window), stays the same size at any length,
            and adds `num_attention_heads * (hidden_size + 2)` parameters per layer.
        use_cell_residual (`bool`, *optional*, defaults to `True`):
            Whether a window's cell adds the gated raw cell of the window before it (paper eq. 7). `False` is the
            paper's "w/o residual connection" ablation: the cell is the window's raw output alone.
        use_rotary (`bool`, *optional*, defaults to `True`):
            Whether queries and keys are rotated by their position in the window. `False` is the paper's "w/o
            rotary position" ablation: attention inside a window sees no order.
        window_overlap (`int`, *optional*, defaults to 0):
            Breaking-point enrichment: every window also reads the last `window_overlap` tokens of the window before
            it (their outputs are dropped). 0 reproduces the official model.
        is_causal (`bool`, *optional*, defaults to `False`):
            Strictly causal mode for language modelling: tokens see the read cell and earlier tokens of their window,
            memory review sees only earlier windows' cells, and every layer starts from its own learned cell.
        layer_design (`str`, *optional*):
            Which layer design the fields below default to (`ran_hf.configuration_ran.LAYER_DESIGNS`): `"official"`,
            the layer of the paper and of its checkpoints, or `"learnable_memory"`, the causal layer whose memory
            learns to carry what a later window needs (docs/memory.md). Defaults to `"official"` for the encoder
            and `"learnable_memory"` for causal models. Each field below set on its own overrides the design.
        residual_stream (`bool`, *optional*):
            Whether token states run through every layer on an identity path: the window attention and the memory
            review each read the states through a pre-norm and add their output to them (a final norm follows the last
            layer). `False` is the official post-norm layer, where only gated (GLU) residuals of the normalised
            inputs carry a token through; trained from scratch, memory review then washes token identity out.
            Defaults to `True` for causal models and `False` (official) for the encoder.
        cell_input_residual (`bool`, *optional*):
            Whether a window's raw cell adds the gated residual of its own normalised input before its norm, as the
            official layer does. `False`: the raw cell is the standardised output of its attention over the window
            alone; the input residual (a constant in the first window) otherwise swamps what the cell reads, and the
            cell does not learn to carry a token across windows. Defaults to `False` for causal models and `True`
            (official) for the encoder.
        review_qk_norm (`bool`, *optional*):
            Whether memory review scores cells by the cosine of un-activated query and key projections scaled by
            `sqrt(hidden_size)`, instead of the official product of activated ones. Scores then have the statistics
            of ordinary attention at initialisation, and picking one cell among many is learned in hundreds of steps
            instead of not at all. Defaults to `True` for causal models and `False` (official) for the encoder.
        review_initial_cell (`bool`, *optional*, defaults to `True`):
            Causal models only: whether memory review can also read the layer's learned starting cell, besides the
            cells of earlier windows, so that tokens of the first window have a cell to read and any token can read
            "nothing". That constant cell can become a sink: early in training, while cells still carry noise, a
            run may put all its review weight on it and never learn to pick the cell that holds what a token needs.
            `False` removes it (tokens of the first window then read no cell); measured on key retrieval it rescues
            such runs but stalls others (docs/memory.md), so it is not the default.
        attention_qk_activation (`bool`, *optional*):
            Whether the window attention (tokens and cell alike) scores keys by the product of swish-activated query
            and key projections, as the official layer does. `False`: by the product of the projections themselves,
            as transformers do (values stay activated). Defaults to `False` for causal models, where it makes the
            cell's write attention learn to pick a token among its window's (docs/memory.md), and `True`
            (official) for the encoder.
        memory_value_activation (`bool`, *optional*):
            Whether the memory path is swish-activated where the official layer activates it: the output projection
            that writes a cell, and memory review's values and output projection. `False` keeps that path linear,
            so that swish's flat negative side cannot merge what cells carry (two key digits that differ there
            become one). Defaults to `False` for causal models and `True` (official) for the encoder.
        cell_max_pool (`bool`, *optional*):
            Whether a window's raw cell also writes the feature-wise maximum of its window's token values (a soft
            maximum, log-sum-exp at temperature 0.03, whose gradient survives bfloat16 rounding), besides what its
            attention reads. The attention writes an average, and averages of windows look alike: memory
            review could then find the cell that holds a key only when that cell stood out otherwise (the first
            window's, written by the constant starting cell), and a key anywhere else was never learned. A maximum
            keeps a rare token's features at full strength whatever else the window holds. Defaults to `True` for
            causal models and `False` (official) for the encoder; a causal config saved before this field existed
            loads with `False`, as it was trained.
        review_salience (`bool`, *optional*):
            Whether memory review adds a learned prior to every cell's score, the dot product of its key with one
            learned vector (zero at initialisation): how worth reading a cell is, whoever asks. Training raises it
            for the cells that tokens need, and `memory_salient_cells` keeps the cells it ranks highest. Defaults
            to `True` for causal models and `False` (official) for the encoder; a causal config saved before this
            field existed loads with `False`.
        token_shift (`bool`, *optional*):
            Whether every token also reads its predecessor before the first layer: a learned projection of the
            previous token's embedding (zero at initialisation) is added to its own. A cell then writes what a token
            is *and* what came before it, so a window's cell keeps the order of what it holds: without it, a cell
            holds a 2-digit key as a set of two digits, and which came first is not learned. Defaults to `True` for
            causal models and `False` (official) for the encoder; a causal config saved before this field existed
            loads with `False`.
        scan_implementation (`str`, *optional*, defaults to `"auto"`):
            Which cell scan the layers run, by its name in `ran_hf.cell_scan.ALL_SCAN_FUNCTIONS`. `"auto"` runs
            `"triton"` on a CUDA device where Triton is installed and `"reference"` elsewhere. `"reference"` is the
            plain step-by-step loop that autograd records op by op. `"fused"` runs a layer's whole scan as one
            autograd node with a hand-written backward (about half the ops per window). `"triton"` runs each window
            as three Triton kernels forward and three backward (docs/gpu.md); without CUDA or Triton it runs the
            fused scan, warning once. All agree within 1e-4, dropout included (the same masks for a seed). For an
            activation other than SiLU, or wrapped projections (LoRA adapters), the fused and Triton scans run the
            reference, warning once. Other scans register there and must compute the same thing.
        hidden_act (`str`, *optional*, defaults to `"silu"`):
            Activation of every projection (swish in the paper).
        hidden_dropout_prob (`float`, *optional*, defaults to 0.1):
            Dropout on embeddings, token states, cells and head inputs.
        attention_probs_dropout_prob (`float`, *optional*, defaults to 0.1):
            Dropout on attention probabilities.
        layer_norm_eps (`float`, *optional*, defaults to 1e-07):
            Epsilon of the layer norms.
        rope_theta (`float`, *optional*, defaults to 10000.0):
            Base of the rotary embedding inside each window.
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the normal weight initialisation.
        pad_token_id (`int`, *optional*, defaults to 0):
            Padding token id.
        bos_token_id (`int`, *optional*):
            Beginning-of-sequence token id.
        eos_token_id (`int`, *optional*):
            End-of-sequence token id.
        tie_word_embeddings (`bool`, *optional*):
            Whether language-model heads share the token embedding. Defaults to `True` for the encoder (the official
            checkpoints are tied) and to `False` for causal models: trained from scratch, a tied causal RAN can merge
            the embeddings of tokens that play the same role (two key digits reached a cosine of 0.99) and then never
            tell them apart again. Set when the config is built: a config whose `is_causal` changes later keeps it.
        cutoffs (`list[int]`, *optional*):
            Causal LM only: adaptive input embeddings and an adaptive softmax (the official `RanNetForAdaptiveLM`).
            The vocabulary is cut at these increasing ids into a head cluster and tail clusters; None (default) keeps
            the token embedding and the LM head. The softmax shares the clusters' embeddings and projections, and its
            input is a swish output mapping after dropout, as in `rannet`. See `ran_hf.adaptive_softmax`.
        div_val (`int`, *optional*, defaults to 1):
            With `cutoffs`: cluster i embeds its ids in `hidden_size // div_val**i` dimensions. With 1, as in the
            official layers, there is one embedding and one tied softmax over the whole vocabulary, whatever `cutoffs`.

    Sizes: a config whose model would hold more than 10^11 parameters (`estimated_parameters()`, about 400 GB in
    float32) is refused when it is made, naming the field that makes it so large (`num_hidden_layers=10**6` is a typo
    more often than a plan). To build a larger model, raise the bound with the environment variable
    `RAN_HF_MAX_PARAMETERS` (e.g. `RAN_HF_MAX_PARAMETERS=1e12`); it applies to every config made after it is set,
    saved folders loaded as remote code included.

    `update_from_string` (the training scripts' `--config_overrides`) reads every field by its type:
    `"window_size=128,cutoffs=[2000,10000],memory_review_cells=4,layer_design=none"` (a list of ints also as
    `2000;10000`, a None field as `none`), and names a field whose value does not parse.

    Example:

    ```python
    >>> from ran_hf import RANConfig, RANModel

    >>> config = RANConfig(hidden_size=256, num_attention_heads=4, window_size=128, min_window_size=8)
    >>> model = RANModel(config)
    ```
    """

    model_type = "ran"
    keys_to_ignore_at_inference = ["past_key_values", "cells", "last_cell"]

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 2
    num_attention_heads: int = 12
    head_dim: int = 64
    window_size: int = 256
    min_window_size: int = 16
    cell_pooling: str = "last"
    token_pooling: str = "max"
    memory_review: bool = True
    memory_review_cells: int | None = None
    memory_salient_cells: int | None = None
    associative_memory: bool = False
    use_cell_residual: bool = True
    use_rotary: bool = True
    window_overlap: int = 0
    is_causal: bool = False
    layer_design: str | None = None
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
    hidden_act: str = "silu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-7
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool | None = None
    cutoffs: list[int] | None = None
    div_val: int = 1

    # Pipeline tasks registered in this process (`import ran_hf` sets it): a loaded config leaves them out of its
    # `custom_pipelines`, which Transformers would otherwise serve with the folder's copy of the pipeline, and only
    # with `trust_remote_code=True`. Saving writes them again (`to_dict`).
    tasks_registered_here = frozenset()

    def __post_init__(self, **kwargs):
        if self.tie_word_embeddings is None:
            self.tie_word_embeddings = not self.is_causal
        self._validate_ran_fields()
        self._warn_about_unknown_keywords(kwargs)
        # Every saved folder names the code of every head, so that any Auto class loads it as remote code.
        self.auto_map = dict(REMOTE_CODE_AUTO_MAP)
        pipelines = kwargs.pop("custom_pipelines", None) or {}
        pipelines = {task: info for task, info in pipelines.items() if task not in self.tasks_registered_here}
        if pipelines:
            kwargs["custom_pipelines"] = pipelines
        super().__post_init__(**kwargs)
        self.validate_label_fields()  # `num_labels` is Transformers' and set by the call above

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        # A saved config names every memory field it resolved (`to_dict`); one that names them but not a later
        # field was saved before that field existed, and its model was trained without it.
        if "residual_stream" in config_dict:
            missing = {name: False for name in _LATER_MEMORY_FIELDS if name not in config_dict}
            config_dict = {**config_dict, **missing}
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict:
        """Also names the memory design a config resolves to, so that a saved checkpoint keeps computing what it was
        trained to compute if the causal defaults change."""
        output = super().to_dict()
        resolved = {name: self.layer_option(name) for name in LAYER_DESIGN_FIELDS}
        output.update(resolved)
        # The design these values are, where they are one (else the default they override).
        matching = [design for design, values in LAYER_DESIGNS.items() if values == resolved]
        output["layer_design"] = self.layer_design or (matching[0] if matching else self.resolved_layer_design)
        # The pipelines a saved folder serves follow from its model, as its `auto_map` does.
        output.pop("custom_pipelines", None)
        if "RANForQuestionAnswering" in (self.architectures or ()) and _code_here("question_answering"):
            output["custom_pipelines"] = {QUESTION_ANSWERING_TASK: dict(QUESTION_ANSWERING_PIPELINE)}
        return output

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs):
        """Saved with a model (`architectures` set), also writes to the folder the code of every module the config
        names, with the sibling modules each imports: the `auto_map`'s models (a folder saved from any head loads
        with any Auto class) and the pipeline of `custom_pipelines` (a question-answering model's folder serves its
        pipeline), with `trust_remote_code=True` and without `ran_hf`. It writes them before the config: a model's
        `save_pretrained(push_to_hub=True)` uploads the files written after it started."""
        if self.architectures and not os.path.isfile(save_directory):
            named = [reference for reference in self.auto_map.values() if isinstance(reference, str)]
            named += [info["impl"] for info in self.to_dict().get("custom_pipelines", {}).values()]
            os.makedirs(save_directory, exist_ok=True)
            for module in sorted({reference.split("--")[-1].split(".")[0] for reference in named}):
                if _code_here(module):  # a copy of this code loaded from a folder has only the modules it ran
                    source = Path(__file__).with_name(f"{module}.py")
                    for file in (source, *map(Path, get_relative_import_files(source))):
                        target = Path(save_directory) / file.name
                        if not target.exists() or not target.samefile(file):
                            shutil.copyfile(file, target)
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    def _warn_about_unknown_keywords(self, kwargs: dict) -> None:
        """A keyword that is no field (`windowsize=8`) would be stored and read by nothing: say so."""
        unknown = sorted(set(kwargs) - _GENERIC_CONFIG_KEYWORDS - _generation_keywords())
        if not unknown:
            return
        field_names = [field.name for field in fields(self)]
        described = []
        for name in unknown:
            close = difflib.get_close_matches(name, field_names, n=1)
            described.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        logger.warning(
            f"RANConfig got keyword(s) that are not RAN configuration fields: {', '.join(described)}. They are kept "
            "on the config, but the model reads none of them."
        )

    def _validate_ran_fields(self):
        """Reject values that would make windows, heads or pooling ill-defined, naming the field."""
        positive_ints = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "window_size",
            "min_window_size",
        )
        for name in positive_ints + ("window_overlap",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"`{name}` must be an int, got {value!r} ({type(value).__name__}).")
        # Floats: real numbers, finite (a NaN passes every comparison below silently).
        for name in (
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "layer_norm_eps",
            "rope_theta",
            "initializer_range",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"`{name}` must be a number, got {value!r} ({type(value).__name__}).")
            if not math.isfinite(value):
                raise ValueError(f"`{name}` must be finite, got {value}.")
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.min_window_size >= self.window_size:
            raise ValueError(
                f"`min_window_size` ({self.min_window_size}) must be smaller than `window_size` ({self.window_size})."
            )
        if self.window_overlap < 0:
            raise ValueError(f"`window_overlap` must be >= 0, got {self.window_overlap}.")
        if self.window_overlap >= self.window_size:
            raise ValueError(
                f"`window_overlap` ({self.window_overlap}) must be smaller than `window_size` ({self.window_size})."
            )
        if self.memory_review_cells is not None:
            if isinstance(self.memory_review_cells, bool) or not isinstance(self.memory_review_cells, int):
                raise ValueError(f"`memory_review_cells` must be an int or None, got {self.memory_review_cells!r}.")
            if self.memory_review_cells < 1:
                raise ValueError(f"`memory_review_cells` must be >= 1, got {self.memory_review_cells}.")
            if not self.is_causal:
                raise ValueError(
                    "`memory_review_cells` bounds what a causal model's tokens review (and its cache keeps); the "
                    "bidirectional encoder reviews every cell of its text. Set `is_causal=True` or leave it None."
                )
        self._validate_salient_cells()
        if self.associative_memory is True and not self.is_causal:
            raise ValueError(
                "`associative_memory` binds what earlier windows held for later tokens of a causal model; the "
                "bidirectional encoder reads every window already. Set `is_causal=True` or leave it False."
            )
        if self.cell_pooling not in _CELL_POOLINGS:
            raise ValueError(f"`cell_pooling` must be one of {_CELL_POOLINGS}, got {self.cell_pooling!r}.")
        if self.token_pooling not in _TOKEN_POOLINGS:
            raise ValueError(f"`token_pooling` must be one of {_TOKEN_POOLINGS}, got {self.token_pooling!r}.")
        if not isinstance(self.scan_implementation, str) or not self.scan_implementation:
            # Whether the name is registered is checked when a layer runs: scans may register after the config.
            raise ValueError(f"`scan_implementation` must be a cell-scan name, got {self.scan_implementation!r}.")
        switches = ("memory_review", "use_cell_residual", "use_rotary", "is_causal", "tie_word_embeddings")
        for name in (*switches, "associative_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
        if self.layer_design is not None and self.layer_design not in LAYER_DESIGNS:
            raise ValueError(
                f"`layer_design` must be one of {sorted(LAYER_DESIGNS)} or None, got {self.layer_design!r}."
            )
        for name in LAYER_DESIGN_FIELDS:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool or None, got {getattr(self, name)!r}.")
        from transformers.activations import ACT2FN  # here: importing it costs about as much as Transformers

        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACT2FN:
            raise ValueError(
                f"`hidden_act` must be the name of a Transformers activation ({', '.join(sorted(ACT2FN))}), "
                f"got {self.hidden_act!r}."
            )
        if self.initializer_range < 0:
            raise ValueError(f"`initializer_range` (a standard deviation) must be >= 0, got {self.initializer_range}.")
        self._validate_token_ids()
        self._validate_adaptive_softmax()
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"`{name}` must be in [0, 1), got {value}.")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"`layer_norm_eps` must be > 0, got {self.layer_norm_eps}.")
        if self.head_dim % 2:
            raise ValueError(f"`head_dim` must be even (rotary embedding rotates pairs), got {self.head_dim}.")
        if self.rope_theta <= 0:
            raise ValueError(f"`rope_theta` must be > 0, got {self.rope_theta}.")
        self._validate_size()

    def validate_label_fields(self) -> None:
        """`num_labels` and `problem_type`, which the classification heads read (checked again when one is built:
        they may be set on a config after it is made)."""
        num_labels = self.num_labels
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(
                f"`num_labels` must be >= 1, got {num_labels!r}: a classification head needs a class (1 for "
                "regression)."
            )
        if self.problem_type is not None and self.problem_type not in _PROBLEM_TYPES:
            raise ValueError(
                f"`problem_type` must be one of {', '.join(map(repr, _PROBLEM_TYPES))} or None (inferred from the "
                f"labels as Transformers does), got {self.problem_type!r}."
            )

    def estimated_parameters(self, **sizes) -> int:
        """About how many parameters (within a few percent) a `RANModel` of this config holds, task heads aside;
        `sizes` replace fields of `_SIZE_FIELDS`. Pure arithmetic: nothing is built."""
        values = {name: sizes.get(name, getattr(self, name)) for name in _SIZE_FIELDS}
        vocab, width, depth = values["vocab_size"], values["hidden_size"], values["num_hidden_layers"]
        heads = values["num_attention_heads"] * values["head_dim"]
        cutoffs = self.cutoffs if isinstance(self.cutoffs, list | tuple) else None
        if cutoffs and self.div_val > 1 and cutoffs[-1] < vocab:
            bounds = [0, *cutoffs, vocab]
            dims = [width // self.div_val**i for i in range(len(bounds) - 1)]
            embedding = sum((high - low + width) * dim for low, high, dim in zip(bounds[:-1], bounds[1:], dims))
        else:
            embedding = vocab * width
        layer = 4 * heads * width + 4 * width * width + 3 * heads + 12 * width  # window attention, GLUs, norms
        if self.memory_review:
            layer += 6 * width * width + 9 * width
        if self.associative_memory:
            layer += values["num_attention_heads"] * (width + 2)
        return embedding + depth * layer + 4 * width * width  # and the pooler

    def _validate_size(self) -> None:
        """Refuse a config whose model would not fit any machine (`RAN_HF_MAX_PARAMETERS`), naming the field."""
        setting = os.environ.get(MAX_PARAMETERS_VARIABLE)
        bound = DEFAULT_MAX_PARAMETERS
        if setting is not None:
            try:
                bound = float(setting)
            except ValueError:
                bound = math.nan
            if not bound >= 1:
                raise ValueError(
                    f"The environment variable {MAX_PARAMETERS_VARIABLE} (the most parameters a RAN config may "
                    f"describe) must be a number >= 1, e.g. 1e12, got {setting!r}."
                )
        estimate = self.estimated_parameters()
        if estimate <= bound:
            return
        # The field that, set to its default, shrinks the model most.
        culprit = min(_SIZE_FIELDS, key=lambda name: self.estimated_parameters(**{name: getattr(type(self), name)}))
        sizes = ", ".join(f"{name}={getattr(self, name)}" for name in _SIZE_FIELDS)
        raise ValueError(
            f"This config describes a model of about {estimate:.2g} parameters ({estimate * 4 / 1e9:.2g} GB in "
            f"float32), more than the bound of {bound:.2g}, mostly through `{culprit}={getattr(self, culprit)}` "
            f"({sizes}). If a model this large is meant, raise the bound with the environment variable "
            f"{MAX_PARAMETERS_VARIABLE} (e.g. {MAX_PARAMETERS_VARIABLE}={max(estimate, 1) * 10:.0e})."
        )

    def update_from_string(self, update_str: str) -> None:
        """Set fields from `"name=value,name=value"` (the training scripts' `--config_overrides`), each value read by
        its field's type: ints, numbers, `true`/`false`, strings, `none` for a field that may be None, and lists of
        ints as `[2000,10000]` or `2000;10000` (`cutoffs`). Unlike Transformers' version, every field can be set and a
        value that does not parse is named with the type expected; nothing is set unless all parse and the config
        they make is valid."""
        parsed = {}
        for item in _split_overrides(update_str):
            name, equals, text = (part.strip() for part in item.partition("="))
            if not equals or not name:
                raise ValueError(
                    f"`{item.strip()}` is not an override: write it `name=value` (several joined by commas)."
                )
            if not hasattr(self, name) or name.startswith("_"):
                close = difflib.get_close_matches(name, [field.name for field in fields(self)], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"`{name}` is not a field of RANConfig{hint}.")
            parsed[name] = self._parse_override(name, text)
        previous = {name: getattr(self, name) for name in parsed}
        for name, value in parsed.items():
            setattr(self, name, value)
        try:
            self._validate_ran_fields()
            self.validate_label_fields()
        except ValueError:
            for name, value in previous.items():
                setattr(self, name, value)
            raise

    def _parse_override(self, name: str, text: str):
        """One `--config_overrides` value, read by the field's annotated type (or, for Transformers' properties such
        as `num_labels`, by the type of its value now)."""
        annotation = _field_annotation(type(self), name)
        kinds = _override_kinds(annotation) if annotation is not None else None
        if kinds is None:
            value = getattr(self, name)
            kinds = [kind for kind, cls in (("bool", bool), ("int", int), ("float", float), ("str", str))
                     if type(value) is cls]  # fmt: skip
            if not kinds:
                raise ValueError(
                    f"`{name}` (now {value!r}) cannot be set by `update_from_string` (`--config_overrides`): set it on "
                    "the config in Python."
                )
        word = text.lower()
        for kind in kinds:
            if kind == "none" and word in ("none", "null"):
                return None
            if kind == "bool" and word in ("true", "false", "1", "0", "yes", "no"):
                return word in ("true", "1", "yes")
            if kind == "int":
                try:
                    return int(text)
                except ValueError:
                    pass
            if kind == "float":
                try:
                    return float(text)
                except ValueError:
                    pass
            if kind == "list":
                items = text[1:-1] if text.startswith("[") and text.endswith("]") else text
                try:
                    return [int(item) for item in items.replace(";", ",").split(",") if item.strip()]
                except ValueError:
                    pass
            if kind == "str":
                return text
            if isinstance(kind, tuple) and text in kind:
                return text
        described = sorted(kinds, key=lambda kind: kind == "none")  # "an int or none"
        expected = " or ".join(_OVERRIDE_KIND_NAMES.get(kind) or f"one of {', '.join(kind)}" for kind in described)
        raise ValueError(f"`{name}` must be {expected}, got {text!r}.")

    def _validate_adaptive_softmax(self) -> None:
        if isinstance(self.div_val, bool) or not isinstance(self.div_val, int) or self.div_val < 1:
            raise ValueError(f"`div_val` must be an int >= 1, got {self.div_val!r}.")
        if self.cutoffs is None:
            return
        cutoffs = self.cutoffs
        if not isinstance(cutoffs, list | tuple) or not all(type(c) is int for c in cutoffs):
            raise ValueError(f"`cutoffs` must be a list of token ids (ints) or None, got {cutoffs!r}.")
        if list(cutoffs) != sorted(set(cutoffs)) or (cutoffs and not 0 < cutoffs[0] <= cutoffs[-1] < self.vocab_size):
            raise ValueError(
                f"`cutoffs` must be strictly increasing ids in (0, vocab_size={self.vocab_size}), got {list(cutoffs)}."
            )
        if not self.is_causal:
            raise ValueError(
                "`cutoffs` (adaptive embeddings and softmax) belong to the causal LM: set `is_causal=True` "
                "(RANForCausalLM), or leave `cutoffs` None."
            )
        smallest = self.hidden_size // self.div_val ** len(cutoffs)
        if self.div_val > 1 and smallest < 1:
            raise ValueError(
                f"With `div_val={self.div_val}` the last of {len(cutoffs) + 1} clusters would embed its ids in "
                f"hidden_size // div_val**{len(cutoffs)} = {smallest} dimensions: use fewer cutoffs or a smaller div_val."
            )
        self.cutoffs = list(cutoffs)

    def validate_if_changed(self) -> None:
        """Validate the RAN fields again if one was set since they were last validated (`model.config.window_size = 0`
        on a built model, say). Every eager forward calls it; when nothing changed it costs tens of microseconds."""
        values = tuple(
            tuple(value) if isinstance(value, list) else value for value in map(self.__dict__.get, _RAN_FIELD_NAMES)
        )
        if _validated_values.get(id(self)) == values:
            return
        try:
            self._validate_ran_fields()
        except ValueError as error:
            raise ValueError(
                f"The model's config was changed after the model was built and is not valid: {error}"
            ) from error
        if id(self) not in _validated_values:
            weakref.finalize(self, _validated_values.pop, id(self), None)
        _validated_values[id(self)] = values

    def _validate_salient_cells(self) -> None:
        """`memory_salient_cells` needs a bounded review (what it adds to) and a salience (what it ranks by)."""
        value = self.memory_salient_cells
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`memory_salient_cells` must be an int >= 1 or None, got {value!r}.")
        if self.memory_review_cells is None:
            raise ValueError(
                "`memory_salient_cells` keeps salient cells beyond the last `memory_review_cells` windows, but "
                "`memory_review_cells` is None (every cell is reviewed already). Set both, or neither."
            )
        if not self.layer_option("review_salience"):
            raise ValueError(
                "`memory_salient_cells` ranks cells by the learned prior of `review_salience`, which this config "
                "turns off; a model trained without it has no ranking to keep cells by."
            )

    @property
    def resolved_layer_design(self) -> str:
        """`layer_design`, or where it is None the default: official for the encoder, learnable memory when causal."""
        if self.layer_design is not None:
            return self.layer_design
        return "learnable_memory" if self.is_causal else "official"

    @property
    def num_hidden_states(self) -> int:
        """How many hidden states `output_hidden_states=True` returns: the embeddings' and every layer's."""
        return self.num_hidden_layers + 1

    def layer_option(self, name: str) -> bool:
        """The value of a design field (`LAYER_DESIGNS`): the field's own where it is set, else its design's. Resolved
        when read, so that switching `is_causal` or `layer_design` follows; a saved config holds the resolved values
        (`to_dict`). `review_initial_cell` is read by causal models only."""
        value = getattr(self, name)
        if value is not None:
            return value
        return LAYER_DESIGNS[self.resolved_layer_design][name]

    def _validate_token_ids(self):
        """Special token ids must be ids of the vocabulary (None: no such token)."""
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if name == "eos_token_id" and isinstance(value, list | tuple) else [value]
            for token_id in ids:
                if token_id is None and not isinstance(value, list | tuple):
                    continue
                if isinstance(token_id, bool) or not isinstance(token_id, int):
                    raise ValueError(f"`{name}` must be an int or None, got {value!r}.")
                if not 0 <= token_id < self.vocab_size:
                    raise ValueError(
                        f"`{name}` ({token_id}) is outside the vocabulary [0, {self.vocab_size - 1}] "
                        f"(`vocab_size={self.vocab_size}`)."
                    )

    @property
    def max_window_length(self) -> int:
        """Longest window a layer can see: a full window plus a merged tail, plus the enrichment tokens."""
        return self.window_size + self.min_window_size - 1 + self.window_overlap


_OVERRIDE_KIND_NAMES = {
    "int": "an int",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "none": "none",
    "list": "a list of ints (written [2000,10000] or 2000;10000)",
}


def _field_annotation(cls: type, name: str):
    """The type annotation of field `name`, resolved where it is a string (Transformers' own fields); None where
    there is none (a property such as `num_labels`) or it does not resolve."""
    for owner in cls.__mro__:
        annotation = vars(owner).get("__annotations__", {}).get(name)
        if annotation is not None:
            break
    else:
        return None
    if isinstance(annotation, str):
        try:
            annotation = eval(annotation, vars(sys.modules[owner.__module__]))  # what `typing.get_type_hints` does
        except Exception:
            return None
    return annotation


def _override_kinds(annotation) -> list | None:
    """What a field's type annotation accepts, as `_parse_override` kinds (a tuple: a `Literal`'s choices); None
    where it is none of those (a dict, a dtype)."""
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = []
    for member in members or (annotation,):
        if member is type(None):
            kinds.append("none")
        elif member in (bool, int, float, str):
            kinds.append(member.__name__)
        elif typing.get_origin(member) is list and typing.get_args(member) in ((int,), ()):
            kinds.append("list")
        elif typing.get_origin(member) is typing.Literal:
            kinds.append(tuple(map(str, typing.get_args(member))))
        else:
            return None
    return sorted(kinds, key=lambda kind: kind != "none")  # `none` first: a None field reads "none" as None


def _split_overrides(text: str) -> list[str]:
    """`"a=1,cutoffs=[2,3],b=x"` -> `["a=1", "cutoffs=[2,3]", "b=x"]`: commas inside brackets belong to a list."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth <= 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return [item for item in items if item.strip()]


# What `validate_if_changed` compares: the fields RANConfig declares, not those every Transformers config has.
_RAN_FIELD_NAMES = tuple(
    field.name for field in fields(RANConfig) if field.name not in {field.name for field in fields(PreTrainedConfig)}
)
# id(config) -> its RAN fields' values when they were last validated (`RANConfig.validate_if_changed`). Kept off the
# config: its __dict__ is what it saves and compares.
_validated_values: dict[int, tuple] = {}


__all__ = ["RANConfig"]
