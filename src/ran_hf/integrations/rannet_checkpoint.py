"""An official RAN checkpoint's variables read into a model's state dict: names of the `rannet` release and of its
own pretraining's Keras checkpoints mapped to one official naming, the adaptive LM recognised with its clusters, every
variable checked against the shapes the config gives, then each converted (Keras kernels transposed) into the
`RANForMaskedLM` or `RANForCausalLM` weights it becomes. convert_rannet.py writes the folder around them."""

import re

import numpy as np
import torch

from ..configuration_ran import LAYER_DESIGN_FIELDS, RANConfig
from ..files.tf_checkpoint import TFCheckpointReader
from ..modeling_ran import RANForCausalLM, RANForMaskedLM


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


def _training_parts(name: str) -> tuple[int, str] | None:
    """(layer number, attribute path) of a variable of `rannet`'s pretraining checkpoints; None for another name."""
    match = _TRAINING_NAME.match(name)
    return None if match is None else (int(match.group(1)), match.group(2))


def official_variable_name(name: str, num_layers: int) -> str | None:
    """The official (`RanNet.variable_mapping`) name of a checkpoint variable; None for a name it cannot map.

    Official names map to themselves. Names of `rannet`'s pretraining checkpoints follow the Keras model's
    structure: layers with weights are numbered in model order (token embedding, embedding norm, the RAN layers, the
    MLM hidden block, the MLM output bias) and their sub-layers are named by Python attribute.
    """
    if name.startswith(PREFIX + "/"):
        return name
    if (parts := _training_parts(name)) is None:
        return None
    index, path = parts
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
    if (parts := _training_parts(name)) is None:
        return None
    index, path = parts
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
