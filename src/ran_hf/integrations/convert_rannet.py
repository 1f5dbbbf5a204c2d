"""Convert an official RAN checkpoint (the TensorFlow `rannet` release) into a Transformers folder.

The official release (e.g. "V3 EN base", used with `rannet>0.2.1`) is a folder holding `config.json` (the keys of
`rannet.RanNetParams`), `vocab.txt` (a lower-cased WordPiece vocabulary) and a TensorFlow checkpoint
(`model.ckpt.index`, `model.ckpt.data-*`). Its variables are named as in `RanNet.variable_mapping`
(`rannet/ran-0/encode-attn/dense-q/kernel`, ...). Checkpoints saved by `rannet`'s own pretraining (Keras
`save_weights`, names like `layer_with_weights-2/encode_attn/q_dense/kernel/.ATTRIBUTES/VARIABLE_VALUE`) are read
too, as `RanNet.export_checkpoint` would rename them.

`convert_rannet_checkpoint` writes a folder that loads with the Auto classes and `trust_remote_code=True`:

* `config.json`, `model.safetensors` and the model code: a `RANForMaskedLM` (encoder and MLM head) saved with
  `save_pretrained`. Other heads (`AutoModelForSequenceClassification`, `AutoModelForTokenClassification`) load the
  encoder from it and start their own layers fresh, as they do in `rannet`. A `RanNetForAdaptiveLM` checkpoint
  (Keras `save_weights`, recognised by its output mapping) becomes a causal `RANForCausalLM` with `cutoffs` and
  `div_val` read from its embeddings' shapes (docs/adaptive-softmax.md).
* `tokenizer.json` and `tokenizer_config.json`: the fast-tokenizer equivalent of `rannet.RanNetWordPieceTokenizer`
  (BERT normalisation with lower-casing and accent stripping, BERT pre-tokenisation, WordPiece with `##`
  continuations), which gives `rannet`'s ids. Like `rannet`, and like the data the released model was pretrained on,
  it adds **no special tokens** to a single sequence (no `[CLS]`/`[SEP]`; RAN classifies from its cells, not from a
  special token); a pair becomes `A [SEP] B [SEP]`.
* `README.md`: the model card.

The TensorFlow checkpoint is read by `ran_hf.files.tf_checkpoint`, with NumPy alone: converting needs no TensorFlow.

Usage:

```python
>>> from ran_hf import convert_rannet_checkpoint

>>> convert_rannet_checkpoint("rannet-v3-en-base", "ran-v3-en-base")  # doctest: +SKIP
```

or `python scripts/convert_rannet_checkpoint.py --rannet_dir rannet-v3-en-base --output_dir ran-v3-en-base`.
"""

import hashlib
import json
import os
import re
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from huggingface_hub.errors import StrictDataclassError
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.utils import logging

from ..configuration_ran import LAYER_DESIGN_FIELDS, RANConfig
from ..files.folders import (
    check_not_inputs,
    contents,
    keeps_user_files,
    lock_folder,
    recover_interrupted,
    releases_folder_locks,
    write_folder,
)
from ..files.tf_checkpoint import TFCheckpointReader
from ..modeling_ran import RANForCausalLM, RANForMaskedLM


logger = logging.get_logger(__name__)

__all__ = [
    "RANNET_CONFIG_KEYS",
    "OutputFolderNotEmptyError",
    "build_rannet_tokenizer",
    "convert_rannet_checkpoint",
    "rannet_config_to_ran_config",
]

# --------------------------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------------------------

# Official key -> (`RANConfig` fields it sets, the default `rannet.RanNetParams` uses when the key is absent).
RANNET_CONFIG_KEYS = {
    "vocab_size": (("vocab_size",), None),  # required
    "embedding_size": (("hidden_size",), 512),
    "dropout_rate": (("hidden_dropout_prob", "attention_probs_dropout_prob"), 0.1),
    "ran_layers": (("num_hidden_layers",), 2),
    "head_size": (("head_dim",), 128),
    "head_num": (("num_attention_heads",), 8),
    "window_size": (("window_size",), 256),
    "min_window_size": (("min_window_size",), 16),
    "cell_pooling": (("cell_pooling",), "last"),
    "kernel_initializer_range": (("initializer_range",), 0.02),
}
# Keys that only choose how `rannet` initialises a fresh model: accepted, and without meaning for trained weights.
RANNET_INITIALIZER_KEYS = ("embedding_initializer", "kernel_initializer")


def rannet_config_to_ran_config(rannet_config: dict, source: str = "config.json") -> dict:
    """Map an official `config.json` dict onto `RANConfig` keyword arguments.

    Absent keys take `rannet`'s defaults; initializer kinds are dropped; any other key is an error, since silently
    ignoring it could give a model that computes something else than the checkpoint was trained for.
    """
    unknown = sorted(set(rannet_config) - set(RANNET_CONFIG_KEYS) - set(RANNET_INITIALIZER_KEYS))
    if unknown:
        raise ValueError(
            f"{source}: unknown key(s) {', '.join(repr(key) for key in unknown)}; an official RAN config has only "
            f"{', '.join(sorted(RANNET_CONFIG_KEYS) + sorted(RANNET_INITIALIZER_KEYS))}"
        )
    if "vocab_size" not in rannet_config:
        raise ValueError(f"{source}: the required key 'vocab_size' is missing")
    kwargs = {}
    for key, (fields, default) in RANNET_CONFIG_KEYS.items():
        for field in fields:
            kwargs[field] = rannet_config.get(key, default)
    return kwargs


def read_rannet_config(path: Path) -> RANConfig:
    try:
        rannet_config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(rannet_config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(rannet_config).__name__}")
    kwargs = rannet_config_to_ran_config(rannet_config, str(path))
    try:
        return RANConfig(**kwargs, pad_token_id=0)  # pad id 0: `rannet` treats every id > 0 as a token
    except (TypeError, ValueError, StrictDataclassError) as error:
        # Name the official keys, not the `RANConfig` fields they became (`@strict`'s error: its cause).
        message = str(error.__cause__ if isinstance(error, StrictDataclassError) else error)
        for key, (fields, _) in RANNET_CONFIG_KEYS.items():
            for field in fields:
                message = message.replace(f"`{field}`", f"`{key}`")
        raise ValueError(f"{path}: {message}") from None


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------------

# `rannet.tokenizer.SpecialTokens`: each is a special (unsplittable, skipped when decoding) token if the vocabulary
# has it. The first four must be there: [PAD] as id 0 (the padding mask is `ids > 0`), [SEP] for pairs, [UNK] for
# unknown words and [MASK] for the masked-LM head.
RANNET_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[MASK]", "[SEP]", "[START]", "[END]") + tuple(
    f"[unused{i}]" for i in range(1000)
)
REQUIRED_TOKENS = ("[PAD]", "[UNK]", "[SEP]", "[MASK]")


def read_vocab(path: Path) -> tuple[dict[str, int], int]:
    """The WordPiece vocabulary as `tokenizers` reads it (token -> line number), and the number of lines."""
    vocab = models.WordPiece.read_file(str(path))
    num_lines = max(vocab.values()) + 1 if vocab else 0
    for token in REQUIRED_TOKENS:
        if token not in vocab:
            raise ValueError(f"{path}: the vocabulary has no {token} token")
    if vocab["[PAD]"] != 0:
        raise ValueError(f"{path}: [PAD] must be the first token (id 0), found at id {vocab['[PAD]']}")
    return vocab, num_lines


def build_rannet_tokenizer(vocab_file: str | os.PathLike) -> PreTrainedTokenizerFast:
    """The fast tokenizer that gives the ids of `rannet.RanNetWordPieceTokenizer(vocab_file, lowercase=True)`.

    Single sequences get no special tokens (as in `rannet` and in the released model's pretraining data); pairs become
    `A [SEP] B [SEP]` with token type 1 for `B [SEP]`. `token_type_ids` are not returned: RAN has no segment
    embedding. There is no length limit: RAN reads documents of any length.
    """
    vocab, _ = read_vocab(Path(vocab_file))
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    backend.add_special_tokens([token for token in RANNET_SPECIAL_TOKENS if token in vocab])
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )  # strip_accents=None: strip them because text is lower-cased
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A [SEP] $B:1 [SEP]:1", special_tokens=[("[SEP]", vocab["[SEP]"])]
    )
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "attention_mask"],
    )


# --------------------------------------------------------------------------------------------------------------------
# Checkpoint variables
# --------------------------------------------------------------------------------------------------------------------

PREFIX = "rannet"

# Entries that training adds next to the weights (optimizer state, step counters, the object graph).
_BOOKKEEPING = re.compile(
    r"^(_CHECKPOINTABLE_OBJECT_GRAPH|global_step|save_counter|optimizer)(/|$)|/\.OPTIMIZER_SLOT/"
)

# Attribute names of `rannet`'s Keras layers (what object-based checkpoints use) -> official name parts.
_TRAINING_SCOPES = {
    "cell_glu": "cell-glu",
    "cell_residual_layernorm": "cell-residual-layernorm",
    "concat_layernorm": "concat-layernorm",
    "encode_attn": "encode-attn",
    "glu": "glu",
    "layernorm": "layernorm",
    "linear": "dense-t",
    "sigmoid": "dense-g",
    "q_dense": "dense-q",
    "k_dense": "dense-k",
    "v_dense": "dense-v",
    "o_dense": "dense-o",
    "kernel": "kernel",
    "bias": "bias",
    "gamma": "gamma",
    "beta": "beta",
}
_TRAINING_NAME = re.compile(r"^layer_with_weights-(\d+)/(.+)/\.ATTRIBUTES/VARIABLE_VALUE$")


def official_variable_name(name: str, num_layers: int) -> str | None:
    """The official (`RanNet.variable_mapping`) name of a checkpoint variable; None for a name it cannot map.

    Official names map to themselves. Names of `rannet`'s pretraining checkpoints follow the Keras model's
    structure: layers with weights are numbered in model order (token embedding, embedding norm, the RAN layers, the
    MLM hidden block, the MLM output bias) and their sub-layers are named by Python attribute.
    """
    if name.startswith(PREFIX + "/"):
        return name
    match = _TRAINING_NAME.match(name)
    if match is None:
        return None
    index, path = int(match.group(1)), match.group(2)
    mlm_hidden = {
        "layer_with_weights-0/kernel": "dense/kernel",
        "layer_with_weights-0/bias": "dense/bias",
        "layer_with_weights-1/gamma": "layernorm/gamma",
        "layer_with_weights-1/beta": "layernorm/beta",
    }
    if index == 0 and path == "embeddings":
        return f"{PREFIX}/token-embedding/embeddings"
    if index == 1 and path in ("gamma", "beta"):
        return f"{PREFIX}/embedding-layernorm/{path}"
    if index == num_layers + 2 and path in mlm_hidden:
        return f"{PREFIX}/mlm-hidden/{mlm_hidden[path]}"
    if index == num_layers + 3 and path == "bias":
        return f"{PREFIX}/mlm-matching/bias"
    if not 2 <= index < num_layers + 2:
        return None
    layer = f"{PREFIX}/ran-{index - 2}"
    parts = path.split("/")
    if parts[0] == "cell_initializer":  # a Sequential: Dense (kernel only), then LayerNorm
        initializer = {
            "layer_with_weights-0/kernel": "cell-initializer/kernel",
            "layer_with_weights-1/gamma": "cell-initializer-layernorm/gamma",
            "layer_with_weights-1/beta": "cell-initializer-layernorm/beta",
        }
        mapped = initializer.get("/".join(parts[1:]))
        return f"{layer}/{mapped}" if mapped else None
    if parts[0] == "memory_review":  # memory-review attention, or a plain LayerNorm without memory review
        parts[0] = "output-layernorm" if parts[1:] in (["gamma"], ["beta"]) else "output-attn"
    elif parts[0] in _TRAINING_SCOPES:
        parts[0] = _TRAINING_SCOPES[parts[0]]
    else:
        return None
    if not all(part in _TRAINING_SCOPES for part in parts[1:]):
        return None
    return "/".join([layer, parts[0]] + [_TRAINING_SCOPES[part] for part in parts[1:]])


# `RanNetForAdaptiveLM` (saved by Keras `save_weights`; `rannet` names its variables nowhere else): layers with weights
# are the adaptive embedding, the embedding norm, the RAN layers, the output mapping and the adaptive softmax. Names
# here follow the official pattern, `rannet/<layer>/<weight>`, lower-cased from the Keras layer and weight names.
_ADAPTIVE_EMBEDDING_WEIGHT = re.compile(r"^(embeddings|kernel)(-\d+)?$")
_ADAPTIVE_SOFTMAX_WEIGHT = re.compile(r"^(bias(-\d+)?|kernel-cluster|bias-cluster)$")


def is_adaptive_checkpoint(names, num_layers: int) -> bool:
    """Whether the checkpoint holds a `RanNetForAdaptiveLM`: its output mapping is one Dense where the MLM head has a
    Dense inside a block."""
    mapping = f"layer_with_weights-{num_layers + 2}/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    return any(name == mapping or name.startswith(f"{PREFIX}/adaptive-embedding/") for name in names)


def adaptive_variable_name(name: str, num_layers: int) -> str | None:
    """`official_variable_name` for a `RanNetForAdaptiveLM` checkpoint."""
    if name.startswith(PREFIX + "/"):
        return name
    match = _TRAINING_NAME.match(name)
    if match is None:
        return None
    index, path = int(match.group(1)), match.group(2)
    if index == 0:
        return f"{PREFIX}/adaptive-embedding/{path}" if _ADAPTIVE_EMBEDDING_WEIGHT.match(path) else None
    if index == num_layers + 2:
        return f"{PREFIX}/output-mapping/{path}" if path in ("kernel", "bias") else None
    if index == num_layers + 3:
        return f"{PREFIX}/adaptive-softmax/{path}" if _ADAPTIVE_SOFTMAX_WEIGHT.match(path) else None
    return official_variable_name(name, num_layers)


def adaptive_clusters(shapes: dict[str, tuple[int, ...]], config: RANConfig, source: str) -> tuple[list[int], int]:
    """`cutoffs` and `div_val` of an adaptive checkpoint, read from its embeddings' shapes (the constructor's
    arguments are not in config.json): cluster i holds (ids, hidden_size // div_val**i)."""
    embedding = f"{PREFIX}/adaptive-embedding"
    if f"{embedding}/embeddings" in shapes:  # div_val 1: one embedding, one tied softmax; cutoffs change nothing
        return [], 1
    clusters = []
    while f"{embedding}/embeddings-{len(clusters)}" in shapes:
        clusters.append(shapes[f"{embedding}/embeddings-{len(clusters)}"])
    if not clusters:
        raise ValueError(f"{source}: no adaptive embedding ({embedding}/embeddings or embeddings-0)")
    div_val = clusters[0][1] // clusters[1][1] if len(clusters) > 1 and clusters[1][1] else 2
    cutoffs = [int(n) for n in np.cumsum([rows for rows, _ in clusters])[:-1]]
    expected = [config.hidden_size // div_val**i for i in range(len(clusters))]
    if [width for _, width in clusters] != expected or sum(rows for rows, _ in clusters) != config.vocab_size:
        raise ValueError(
            f"{source}: the adaptive embeddings have shapes {clusters}, which no `cutoffs`/`div_val` give for "
            f"vocab_size={config.vocab_size} and embedding_size={config.hidden_size}"
        )
    return cutoffs, div_val


def adaptive_config(config: RANConfig, cutoffs: list[int], div_val: int) -> RANConfig:
    """The causal config of a converted `RanNetForAdaptiveLM`: the official layer, strictly causal (see
    docs/adaptive-softmax.md for how its outputs relate to the official causal mode)."""
    design = {*LAYER_DESIGN_FIELDS, "layer_design"}
    values = {key: value for key, value in config.to_dict().items() if key not in design}
    values.update(layer_design="official", is_causal=True, cutoffs=cutoffs, div_val=div_val, tie_word_embeddings=False)
    return RANConfig.from_dict(values)


def adaptive_variables(config: RANConfig) -> dict[str, tuple[int, ...]]:
    """{official name: shape} of the adaptive embedding, output mapping and adaptive softmax."""
    hidden = config.hidden_size
    if config.div_val == 1:
        return {
            f"{PREFIX}/adaptive-embedding/embeddings": (config.vocab_size, hidden),
            f"{PREFIX}/output-mapping/kernel": (hidden, hidden),
            f"{PREFIX}/output-mapping/bias": (hidden,),
            f"{PREFIX}/adaptive-softmax/bias": (config.vocab_size,),
        }
    bounds = [0, *config.cutoffs, config.vocab_size]
    shapes = {f"{PREFIX}/output-mapping/kernel": (hidden, hidden), f"{PREFIX}/output-mapping/bias": (hidden,)}
    for i in range(len(bounds) - 1):
        rows, width = bounds[i + 1] - bounds[i], hidden // config.div_val**i
        shapes[f"{PREFIX}/adaptive-embedding/embeddings-{i}"] = (rows, width)
        shapes[f"{PREFIX}/adaptive-embedding/kernel-{i}"] = (width, hidden)
        shapes[f"{PREFIX}/adaptive-softmax/bias-{i}"] = (rows,)
    shapes[f"{PREFIX}/adaptive-softmax/kernel-cluster"] = (hidden, len(bounds) - 2)
    shapes[f"{PREFIX}/adaptive-softmax/bias-cluster"] = (len(bounds) - 2,)
    return shapes


def expected_variables(config: RANConfig, memory_review: bool) -> dict[str, tuple[int, ...]]:
    """{official name: shape} of every variable a checkpoint for `config` holds."""
    hidden, inner, vocab = config.hidden_size, config.num_attention_heads * config.head_dim, config.vocab_size

    def dense(name, fan_in=hidden, fan_out=hidden):
        return {f"{name}/kernel": (fan_in, fan_out), f"{name}/bias": (fan_out,)}

    def norm(name):
        return {f"{name}/gamma": (hidden,), f"{name}/beta": (hidden,)}

    def glu(name):
        return {**dense(f"{name}/dense-t"), **dense(f"{name}/dense-g")}

    shapes = {f"{PREFIX}/token-embedding/embeddings": (vocab, hidden), **norm(f"{PREFIX}/embedding-layernorm")}
    for i in range(config.num_hidden_layers):
        layer = f"{PREFIX}/ran-{i}"
        shapes.update(
            {
                f"{layer}/cell-initializer/kernel": (hidden, hidden),
                **norm(f"{layer}/cell-initializer-layernorm"),
                **norm(f"{layer}/concat-layernorm"),
                **dense(f"{layer}/encode-attn/dense-q", fan_out=inner),
                **dense(f"{layer}/encode-attn/dense-k", fan_out=inner),
                **dense(f"{layer}/encode-attn/dense-v", fan_out=inner),
                **dense(f"{layer}/encode-attn/dense-o", fan_in=inner),
                **glu(f"{layer}/encode-attn/glu"),
                **norm(f"{layer}/encode-attn/layernorm"),
                **glu(f"{layer}/cell-glu"),
                **norm(f"{layer}/cell-residual-layernorm"),
            }
        )
        if memory_review:
            shapes.update(
                {
                    **dense(f"{layer}/output-attn/dense-q"),
                    **dense(f"{layer}/output-attn/dense-k"),
                    **dense(f"{layer}/output-attn/dense-v"),
                    **dense(f"{layer}/output-attn/dense-o"),
                    **glu(f"{layer}/output-attn/glu"),
                    **norm(f"{layer}/output-attn/layernorm"),
                }
            )
        else:
            shapes.update(norm(f"{layer}/output-layernorm"))
    if config.cutoffs is not None:  # the adaptive LM: its own input embedding and output layers
        del shapes[f"{PREFIX}/token-embedding/embeddings"]
        return {**shapes, **adaptive_variables(config)}
    shapes.update(dense(f"{PREFIX}/mlm-hidden/dense"))
    shapes.update(norm(f"{PREFIX}/mlm-hidden/layernorm"))
    shapes[f"{PREFIX}/mlm-matching/bias"] = (vocab,)
    return shapes


def read_checkpoint(prefix: str, config: RANConfig) -> tuple[dict[str, np.ndarray], bool, RANConfig]:
    """Every variable of the checkpoint under its official name, checked against `config`; whether the layers have
    memory review; and the config (that of a causal adaptive LM when the checkpoint holds a `RanNetForAdaptiveLM`)."""
    reader = TFCheckpointReader(prefix)
    source = reader.index_path
    adaptive = is_adaptive_checkpoint(reader.entries, config.num_hidden_layers)
    rename = adaptive_variable_name if adaptive else official_variable_name
    renamed, unexpected = {}, []
    for name in sorted(reader.entries):
        if _BOOKKEEPING.search(name):
            continue
        official = rename(name, config.num_hidden_layers)
        if official is None:
            unexpected.append(name)
        elif official in renamed:
            raise ValueError(f"{source}: two variables map to {official!r} (one is {name!r})")
        else:
            renamed[official] = name
    memory_review = f"{PREFIX}/ran-0/output-layernorm/gamma" not in renamed
    if adaptive:
        found = {official: reader.entries[name].shape for official, name in renamed.items()}
        config = adaptive_config(config, *adaptive_clusters(found, config, source))
    shapes = expected_variables(config, memory_review)
    unexpected += [renamed[name] for name in sorted(set(renamed) - set(shapes))]
    missing = sorted(set(shapes) - set(renamed))
    if missing:
        more = f" (and {len(missing) - 1} more, such as {missing[1]!r})" if len(missing) > 1 else ""
        raise ValueError(
            f"{source}: variable {missing[0]!r} is missing{more}; config.json asks for "
            f"{config.num_hidden_layers} RAN layer(s)"
        )
    if unexpected:
        raise ValueError(
            f"{source}: unexpected variable(s) {', '.join(repr(name) for name in unexpected[:5])}"
            f"{', ...' if len(unexpected) > 5 else ''}: not part of an official RAN "
            f"{'adaptive-LM' if adaptive else 'masked-LM'} checkpoint for "
            f"{config.num_hidden_layers} layer(s)"
        )
    variables = {}
    for official, shape in shapes.items():
        name = renamed[official]
        found = reader.entries[name].shape
        if found != shape:
            raise ValueError(
                f"{source}: variable {name!r} has shape {found}, expected {shape} from config.json (embedding_size="
                f"{config.hidden_size}, head_num * head_size={config.num_attention_heads * config.head_dim}, "
                f"vocab_size={config.vocab_size})"
            )
        variables[official] = reader.read(name).astype(np.float32, copy=False)
    return variables, memory_review, config


# --------------------------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------------------------


def convert_variables(
    variables: dict[str, np.ndarray], model: RANForMaskedLM | RANForCausalLM
) -> dict[str, torch.Tensor]:
    """The state dict of `model` from official variables (Keras kernels are (in, out): transposed)."""
    config = model.config

    def tensor(name):
        return torch.from_numpy(variables[f"{PREFIX}/{name}"])

    def linear(target, *sources):
        """One `nn.Linear` from one or more Dense layers, concatenated along the output axis."""
        return {
            f"{target}.weight": torch.cat([tensor(f"{source}/kernel").T for source in sources], dim=0).contiguous(),
            f"{target}.bias": torch.cat([tensor(f"{source}/bias") for source in sources], dim=0),
        }

    def norm(target, source):
        return {f"{target}.weight": tensor(f"{source}/gamma"), f"{target}.bias": tensor(f"{source}/beta")}

    state = norm("model.embeddings.norm", "embedding-layernorm")
    for i in range(config.num_hidden_layers):
        ours, theirs = f"model.layers.{i}", f"ran-{i}"
        # The official initial cell is LayerNorm(swish(U @ 0)) = the LayerNorm's beta; U and gamma never matter.
        # Only the first layer's is ever read (later layers start from the cell of the layer below), and only the
        # layers that read one have the parameter.
        if hasattr(model.model.layers[i], "initial_cell"):
            state[f"{ours}.initial_cell"] = tensor(f"{theirs}/cell-initializer-layernorm/beta")
        state.update(norm(f"{ours}.input_norm", f"{theirs}/concat-layernorm"))
        attention = f"{theirs}/encode-attn"
        state.update(
            linear(f"{ours}.qkv_proj", f"{attention}/dense-q", f"{attention}/dense-k", f"{attention}/dense-v")
        )
        state.update(linear(f"{ours}.o_proj", f"{attention}/dense-o"))
        state.update(linear(f"{ours}.attention_glu.proj", f"{attention}/glu/dense-t", f"{attention}/glu/dense-g"))
        state.update(norm(f"{ours}.attention_norm", f"{attention}/layernorm"))
        cell = f"{ours}.cell_scan"  # the modules only the cell uses are its scan's
        state.update(linear(f"{cell}.cell_glu.proj", f"{theirs}/cell-glu/dense-t", f"{theirs}/cell-glu/dense-g"))
        state.update(norm(f"{cell}.cell_norm", f"{theirs}/cell-residual-layernorm"))
        if config.memory_review:
            review, source = f"{ours}.memory_review", f"{theirs}/output-attn"
            state.update(linear(f"{review}.q_proj", f"{source}/dense-q"))
            state.update(linear(f"{review}.kv_proj", f"{source}/dense-k", f"{source}/dense-v"))
            state.update(linear(f"{review}.o_proj", f"{source}/dense-o"))
            state.update(linear(f"{review}.glu.proj", f"{source}/glu/dense-t", f"{source}/glu/dense-g"))
            state.update(norm(f"{review}.norm", f"{source}/layernorm"))
        else:
            state.update(norm(f"{ours}.output_norm", f"{theirs}/output-layernorm"))
    if config.cutoffs is not None:
        state.update(adaptive_state(tensor, linear, config))
        return state
    embeddings = tensor("token-embedding/embeddings")
    state["model.embeddings.word_embeddings.weight"] = embeddings
    state.update(linear("head.dense", "mlm-hidden/dense"))
    state.update(norm("head.norm", "mlm-hidden/layernorm"))
    state["decoder.weight"] = embeddings  # tied
    state["decoder.bias"] = tensor("mlm-matching/bias")
    return state


def adaptive_state(tensor, linear, config: RANConfig) -> dict[str, torch.Tensor]:
    """The adaptive embedding, output mapping and adaptive softmax (whose cluster embeddings and projections are the
    embedding's own: the official model binds them, and so do we, by reading them)."""
    embedding, softmax = "model.embeddings.word_embeddings", "decoder"
    state = linear("head.dense", "output-mapping")
    if config.div_val == 1:
        state[f"{embedding}.clusters.0.weight"] = tensor("adaptive-embedding/embeddings")
        state[f"{softmax}.biases.0"] = tensor("adaptive-softmax/bias")
        return state
    for i in range(len(config.cutoffs) + 1):
        state[f"{embedding}.clusters.{i}.weight"] = tensor(f"adaptive-embedding/embeddings-{i}")
        # official kernel-i is (cluster width, hidden): the projection's weight transposed
        state[f"{embedding}.projections.{i}.weight"] = tensor(f"adaptive-embedding/kernel-{i}").T.contiguous()
        state[f"{softmax}.biases.{i}"] = tensor(f"adaptive-softmax/bias-{i}")
    if config.cutoffs:
        state[f"{softmax}.tail_logits.weight"] = tensor("adaptive-softmax/kernel-cluster").T.contiguous()
        state[f"{softmax}.tail_logits.bias"] = tensor("adaptive-softmax/bias-cluster")
    return state


# --------------------------------------------------------------------------------------------------------------------
# The folder
# --------------------------------------------------------------------------------------------------------------------

MODEL_CARD = "rannet-v3-en-base.md"
ADAPTIVE_MODEL_CARD = "rannet-adaptive-lm.md"  # a converted RanNetForAdaptiveLM


def find_checkpoint_prefix(folder: Path) -> str:
    """The checkpoint prefix in `folder`: the one its `checkpoint` state file names, else its only `*.index`."""
    state_file = folder / "checkpoint"
    if state_file.is_file():
        match = re.search(
            r'^model_checkpoint_path:\s*"(.*)"\s*$', state_file.read_text(encoding="utf-8"), re.MULTILINE
        )
        if match is None:
            raise ValueError(f"{state_file}: no model_checkpoint_path line")
        prefix = Path(match.group(1))
        prefix = prefix if prefix.is_absolute() else folder / prefix
        if not Path(f"{prefix}.index").is_file() and Path(f"{folder / prefix.name}.index").is_file():
            prefix = folder / prefix.name  # a folder moved after saving with absolute paths
        return str(prefix)
    indexes = sorted(folder.glob("*.index"))
    if len(indexes) != 1:
        found = ", ".join(path.name for path in indexes) or "none"
        raise FileNotFoundError(
            f"{folder}: expected one TensorFlow checkpoint (a `*.index` file with its `*.data-*` files, such as "
            f"model.ckpt.index) or a `checkpoint` file naming one; found {found}"
        )
    return str(indexes[0].with_suffix(""))


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_card(config: RANConfig, rannet_dir: Path, source_files: list[Path]) -> str:
    """The packaged model card, followed by what this conversion read and wrote."""
    name = ADAPTIVE_MODEL_CARD if config.cutoffs is not None else MODEL_CARD
    card = resources.files("ran_hf").joinpath("model_cards").joinpath(name).read_text(encoding="utf-8")
    rows = [
        ("layers", config.num_hidden_layers),
        ("hidden size", config.hidden_size),
        ("heads x head size", f"{config.num_attention_heads} x {config.head_dim}"),
        ("window / minimum window", f"{config.window_size} / {config.min_window_size}"),
        ("cell pooling", config.cell_pooling),
        ("memory review", config.memory_review),
        ("vocabulary", config.vocab_size),
    ]
    if config.cutoffs is not None:
        rows += [("adaptive softmax: cutoffs / div_val", f"{config.cutoffs} / {config.div_val}")]
    lines = [
        "",
        "## This conversion",
        "",
        f"Converted by `ran_hf.convert_rannet_checkpoint` from `{rannet_dir.name}/`.",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
        "",
        "Source files (SHA-256):",
        "",
        *(f"- `{path.name}`: `{file_digest(path)}`" for path in source_files),
        "",
    ]
    return card.rstrip("\n") + "\n" + "\n".join(lines)


class OutputFolderNotEmptyError(FileExistsError):
    """The output folder exists and is not empty, and replacing it was not asked for. The message names the Python
    argument (`overwrite=True`); a command line that sets it another way says so with `fix("add --overwrite")`."""

    def __init__(self, output_dir: str | os.PathLike):
        self.output_dir = Path(output_dir)
        super().__init__(self.fix("pass overwrite=True"))

    def fix(self, how: str) -> str:
        return (
            f"{self.output_dir} exists and is not empty; {how} to replace the model there (files that are not a "
            "saved model's stay), or choose another output folder."
        )


@releases_folder_locks
def convert_rannet_checkpoint(
    rannet_dir: str | os.PathLike, output_dir: str | os.PathLike, overwrite: bool = False
) -> Path:
    """Convert the official RAN checkpoint in `rannet_dir` into a Transformers folder at `output_dir`.

    Everything is read and checked before anything is written; the folder is written next to `output_dir` under a
    temporary name and moved into place at the end, so a failed conversion leaves no partial folder (and what a killed
    one left beside `output_dir` is cleaned up by the next run). An existing, non-empty `output_dir` is replaced only
    with `overwrite=True`, and then only a saved model's files go (`ran_hf.files.folders.keeps_user_files`): your notes
    and other files there stay. An `output_dir` that is `rannet_dir`, contains it or lies inside it is always refused.

    Args:
        rannet_dir: folder with `config.json`, `vocab.txt` and a TensorFlow checkpoint (`model.ckpt.index` and
            `model.ckpt.data-*`, or the checkpoint a `checkpoint` state file names).
        output_dir: the folder to write.
        overwrite: replace the model in `output_dir` if it exists and is not empty (files that are not a saved
            model's stay).

    Returns:
        The path of the written folder.

    Raises:
        FileNotFoundError: a folder or file is missing.
        OutputFolderNotEmptyError: `output_dir` exists, is not empty, and `overwrite` is False (a `FileExistsError`).
        ValueError: `output_dir` is, contains or lies inside `rannet_dir`; or the config, vocabulary or checkpoint is
            not an official RAN checkpoint or disagrees with itself (the message names the file and the key or
            variable).
    """
    rannet_dir, output_dir = Path(rannet_dir), Path(output_dir)
    if not rannet_dir.is_dir():
        raise FileNotFoundError(f"RAN checkpoint folder not found: {rannet_dir}")
    config_path, vocab_path = rannet_dir / "config.json", rannet_dir / "vocab.txt"
    for path in (config_path, vocab_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path.name} not found in {rannet_dir}")
    check_apart(rannet_dir, output_dir)
    prefix = find_checkpoint_prefix(rannet_dir)  # its `checkpoint` file may name a checkpoint elsewhere
    checkpoint_files = sorted(Path(prefix).parent.glob(Path(prefix).name + ".*"))
    check_not_inputs(output_dir, "output_dir", [("the TensorFlow checkpoint file", path) for path in checkpoint_files])
    lock_folder(output_dir)  # released when this function returns
    for note in recover_interrupted(output_dir):
        logger.warning(f"Before converting: {note}.")
    if output_dir.exists() and not (output_dir.is_dir() and not contents(output_dir)) and not overwrite:
        raise OutputFolderNotEmptyError(output_dir)

    # 1. Read and check everything.
    config = read_rannet_config(config_path)
    variables, memory_review, config = read_checkpoint(prefix, config)
    _, vocab_lines = read_vocab(vocab_path)
    embedding = "the adaptive embedding" if config.cutoffs is not None else f"{PREFIX}/token-embedding/embeddings"
    if vocab_lines != config.vocab_size:  # the embeddings' rows were checked against it
        raise ValueError(
            f"{vocab_path}: the vocabulary has {vocab_lines} tokens, but {embedding} in {prefix}.index has "
            f"{config.vocab_size} rows"
        )
    config.memory_review = memory_review
    model = (RANForCausalLM if config.cutoffs is not None else RANForMaskedLM)(config)
    model.load_state_dict(convert_variables(variables, model), strict=True)
    model.eval()
    tokenizer = build_rannet_tokenizer(vocab_path)
    source_files = [config_path, vocab_path] + checkpoint_files

    # 2. Write into a temporary folder, then put it in place (an existing folder, empty or replaced on request, is
    # set aside until the new one is in place, and its entries that are not a model's files moved over; a mount point
    # keeps its place and gets new contents).
    with write_folder(output_dir, "converting", carry_over=keeps_user_files) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "README.md").write_text(model_card(config, rannet_dir, source_files), encoding="utf-8")
    return output_dir


def check_apart(rannet_dir: Path, output_dir: Path) -> None:
    """Refuse an output folder that is the source, contains it or lies inside it: replacing it would delete the
    official checkpoint, and writing into it would mix the two."""
    source, output = rannet_dir.resolve(), output_dir.resolve()
    if output == source:
        relation = "is the RAN checkpoint folder"
    elif output in source.parents:
        relation = f"contains the RAN checkpoint folder {rannet_dir}"
    elif source in output.parents:
        relation = f"lies inside the RAN checkpoint folder {rannet_dir}"
    else:
        return
    raise ValueError(
        f"The output folder {output_dir} {relation}: converting there would replace or mix with the checkpoint being "
        "read. Choose an output folder outside it."
    )
