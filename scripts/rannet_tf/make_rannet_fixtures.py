"""Generate numerical reference fixtures from the official RAN implementation.

The official implementation is the TensorFlow package ``rannet==0.3.1`` (with
``langml==0.4.2``). It is not a dependency of ``ran_hf``: run this script from a
separate environment that has TensorFlow, tf-keras, langml and rannet installed::

    python3 -m venv /work/tfenv
    /work/tfenv/bin/pip install tensorflow==2.21.0 tf-keras==2.21.0 langml==0.4.2 rannet==0.3.1
    /work/tfenv/bin/python scripts/rannet_tf/make_rannet_fixtures.py

For every entry of ``FIXTURES`` it writes ``<output_dir>/<name>/`` holding

* ``config.json`` -- the rannet config (``RanNetParams`` keys),
* ``vocab.txt`` -- a tiny lower-cased WordPiece vocabulary,
* ``model.ckpt.index``, ``model.ckpt.data-00000-of-00001``, ``checkpoint`` --
  a TF checkpoint whose variable names are those of
  ``RanNet.variable_mapping()``, i.e. what ``RanNet.load_rannet`` reads,
* ``expected.npz`` -- inputs and rannet's outputs, laid out as below.

Every weight is drawn at random (LayerNorm gammas and betas and all biases
included), so a port that confuses a gamma with a beta, drops a bias or
transposes a kernel cannot pass by accident. The outputs are computed by a
model reloaded from the written checkpoint with rannet's own loader, so the
fixtures also prove that the checkpoint layout is the official one.

Each case is one unpadded sequence run alone (batch size 1): the official
outputs depend on padding, so padded batches are no reference (see
RAN_ARCHITECTURE.md). Cases are concatenated along the token axis; case ``k``
owns tokens ``offsets[k]:offsets[k + 1]``. With ``C`` cases, ``T`` tokens in
all, ``D`` = embedding_size, ``V`` = vocab_size, ``N`` = ran_layers, the keys
of ``expected.npz`` are::

    lengths             (C,)       int32    length of each case
    offsets             (C + 1,)   int32    cumulative lengths, offsets[0] = 0
    input_ids           (T,)       int32    token ids (never 0, the pad id)
    windows             (n, 3)     int32    rows (case, start, end): rannet's
                                            windows, merge rule applied
    token_states        (T, D)     float32  last layer token states
    mlm_logits          (T, V)     float32  MLM head output before softmax
    last_cell           (C, D)     float32  last layer final cell
    pooled_cell         (C, D)     float32  last layer cell, cell_pooling applied
    layer_last_cells    (C, N, D)  float32  final cell of every layer
    layer_pooled_cells  (C, N, D)  float32  pooled cell of every layer
    text                ()         str      sample text (last case)
    text_tokens         (t,)       str      its tokens (RanNetWordPieceTokenizer)
    text_ids            (t,)       int32    its ids = the last case's input_ids

Besides these folders the script writes three more:

* ``<name>_training/`` for the fixtures marked ``training_checkpoint``: the
  same weights saved the way ``rannet``'s pretraining saves them (Keras
  ``save_weights`` of ``RanNetForMLMPretrain``: object-based names such as
  ``layer_with_weights-2/encode_attn/q_dense/kernel/.ATTRIBUTES/VARIABLE_VALUE``,
  files ``01.weights.index``, ``01.weights.data-00000-of-00001`` and
  ``checkpoint``), with the same config.json and vocab.txt. Its outputs are
  those of ``<name>/expected.npz``. The script checks that
  ``RanNet.export_checkpoint`` turns it into exactly the official names and
  values.
* ``tf_bundle/``: a checkpoint of a few tensors of every common dtype
  (bfloat16, float16, integers, bool, a scalar, an empty tensor) written by
  ``tf.train.Checkpoint`` in several shards (``sharded.index``,
  ``sharded.data-0000k-of-0000n``), the larger tensors in slices, and
  ``expected.npz`` with what ``tf.train.load_variable`` reads from it:
  ``names`` (str), ``dtypes`` (TensorFlow dtype names) and ``tensor_<i>``
  for ``names[i]`` (bfloat16 widened to float32).
* ``tokenizer/``: ``vocab.txt``, a deterministic WordPiece vocabulary
  (rannet's default special tokens, ``[unused0..999]`` included, then
  characters, words and word pieces counted on the training splits of
  CoNLL-2003, 20 Newsgroups and EURLEX-57K), and ``cases.jsonl``: one case a
  line, ``{"text": ..., "ids": [...]}`` (``"pair"`` for a second sequence)
  with the ids ``RanNetWordPieceTokenizer.encode`` gives. Hand-written cases
  carry their text; the sentences of the benchmark data carry a reference
  instead, as the data may not be committed: ``{"source": <file under
  ../shared/data>, "index": k, "start": s, "end": e, "sha256": ...}`` is
  characters ``s:e`` of the text of record ``k`` (``jsonl.gz`` files) or of
  sentence ``k`` (CoNLL files: the words of the ``k``-th sentence, ``-DOCSTART-``
  blocks skipped, joined by single spaces); ``sha256`` is the first 16 hex
  digits of the UTF-8 text's hash.
"""

import os


# rannet needs the Keras 2 API bundled with TensorFlow; set before importing TF.
os.environ.setdefault("TF_KERAS", "1")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
import zipfile  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from itertools import islice  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from langml import keras  # noqa: E402
from rannet import RanNet, RanNetForMLMPretrain, RanNetParams, RanNetWordPieceTokenizer  # noqa: E402
from rannet.tokenizer import SpecialTokens  # noqa: E402
from tokenizers.normalizers import BertNormalizer  # noqa: E402
from tokenizers.pre_tokenizers import BertPreTokenizer  # noqa: E402


# rannet's default initializers warn about being unseeded; every weight is
# overwritten below, so the warning is noise.
warnings.filterwarnings("ignore", message=".*is unseeded.*")

CHECKPOINT_PREFIX = "model.ckpt"

# Small configs covering 1-3 layers, every cell_pooling and several
# window / min-window combinations. Memory review is always on: the official
# variable mapping (and so every loadable checkpoint) assumes it.
FIXTURES: list[dict] = [
    {
        "name": "l1_d32_w4_last",
        "seed": 1101,
        "config": {
            "vocab_size": 60,
            "embedding_size": 32,
            "ran_layers": 1,
            "head_num": 2,
            "head_size": 8,
            "window_size": 4,
            "min_window_size": 2,
            "cell_pooling": "last",
        },
    },
    {
        "name": "l2_d24_w6_mean",
        "seed": 1102,
        "config": {
            "vocab_size": 80,
            "embedding_size": 24,
            "ran_layers": 2,
            "head_num": 2,
            "head_size": 8,
            "window_size": 6,
            "min_window_size": 3,
            "cell_pooling": "mean",
        },
    },
    {
        "name": "l3_d16_w8_max",
        "seed": 1103,
        "training_checkpoint": True,
        "config": {
            "vocab_size": 64,
            "embedding_size": 16,
            "ran_layers": 3,
            "head_num": 2,
            "head_size": 8,
            "window_size": 8,
            "min_window_size": 3,
            "cell_pooling": "max",
        },
    },
]

# Default location of the benchmark data (../shared/data next to the project).
DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "data")

# Keys of the config.json written next to each checkpoint that are the same
# for every fixture (rannet's RanNetParams reads all of them).
COMMON_CONFIG = {
    "dropout_rate": 0.1,
    "embedding_initializer": "truncated_normal",
    "kernel_initializer": "truncated_normal",
    "kernel_initializer_range": 0.02,
}

# Vocabulary shared by all fixtures, truncated to each vocab_size. Special
# tokens come first ([PAD] must be id 0: rannet's mask is ``ids > 0``), then
# word pieces and the words of SAMPLE_TEXT, so that even the smallest
# vocabulary tokenizes the sample text.
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[SEP]", "[MASK]", "[START]", "[END]", "[unused0]", "[unused1]"]
WORD_PIECES = [".", ",", "!", "?", "'", "##s", "##ed", "##ing", "##ly", "##er", "##est", "##al"]
WORDS = (
    "the they she and in about it walk talk rain play look work a of to is that was for on "
    "with as he we you i this be at by not are from or have an but what all were when there "
    "can more one time day year people way world life hand part place case week company "
    "system program question number night point home water room mother area money story "
    "fact month lot right study book eye job word business issue side kind head house"
).split()
VOCAB = SPECIAL_TOKENS + WORD_PIECES + WORDS
# Upper case, a punctuation mark, "##" continuations and an unknown word.
SAMPLE_TEXT = "They walked in the Rain, and she talked about it. Zebras!"


def rannet_windows(length: int, window_size: int, min_window_size: int) -> list[tuple[int, int]]:
    """Return the [start, end) windows rannet cuts a sequence of ``length`` into.

    Mirrors ``rannet.ran.ran``: windows of ``window_size`` from position 0;
    a final partial window shorter than ``min_window_size`` is merged into
    the window before it; a sequence of at most one window is one window.
    """
    starts = list(range(0, length, window_size))
    windows = list(zip(starts[:-1], starts[1:]))
    if not windows:
        return [(0, length)]
    if length - windows[-1][1] < min_window_size:
        windows[-1] = (windows[-1][0], length)
        return windows
    return windows + [(windows[-1][1], length)]


def probe_lengths(window_size: int, min_window_size: int) -> list[int]:
    """Sequence lengths that hit every window case for the given window sizes.

    A single token; shorter than, equal to and just over one window; the
    longest merged remainder (W + w_min - 1) and the shortest unmerged one
    (W + w_min); a whole multiple of W; and a merged and an unmerged tail
    after two full windows.
    """
    w, m = window_size, min_window_size
    lengths = {1, w // 2, w, w + 1, w + m - 1, w + m, 2 * w, 2 * w + m - 1, 2 * w + m}
    return sorted(lengths)


def checkpoint_name(layer_name: str, weight_name: str) -> str:
    """Map a Keras weight of layer ``layer_name`` to its official checkpoint name.

    Keras names nested weights in several ways (e.g. ``RAN-0/window-loop/
    cell-glu/dense-t/kernel:0``, ``cell-initializer/kernel:0`` without the
    layer, ``Dense/kernel:0`` inside ``MLM-Hidden``); the checkpoint stores
    them lower-cased under ``rannet/<layer>/...`` without the helper scopes
    (``window-loop``, ``cell-initializer-group``). This is the naming
    ``RanNet.restore_weights_from_checkpoint`` looks up.
    """
    name = weight_name.split(":")[0].lower()
    layer = layer_name.lower()
    if name.split("/")[0] != layer:
        name = f"{layer}/{name}"
    for scope in ("/window-loop", "/cell-initializer-group"):
        name = name.replace(scope, "")
    return f"rannet/{name}"


def model_checkpoint_names(model: keras.Model, ran_layers: int) -> dict[str, tf.Variable]:
    """Return {checkpoint name: Keras variable} for every mapped layer of ``model``.

    Fails if the names differ from ``RanNet.variable_mapping`` in any way, so a
    checkpoint written from this dict is exactly what rannet expects.
    """
    mapping = RanNet.variable_mapping(ran_layers=ran_layers)
    variables = {}
    for layer_name in mapping:
        for weight in model.get_layer(layer_name).weights:
            variables[checkpoint_name(layer_name, weight.name)] = weight
    expected = {name for names in mapping.values() for name in names}
    if set(variables) != expected:
        raise RuntimeError(
            f"checkpoint names differ from RanNet.variable_mapping: "
            f"missing {sorted(expected - set(variables))}, extra {sorted(set(variables) - expected)}"
        )
    return variables


def random_weights(shapes: dict[str, Sequence[int]], seed: int) -> dict[str, np.ndarray]:
    """Draw a random float32 value for every checkpoint variable.

    Scales keep activations O(1) so that attention is neither uniform nor
    one-hot. Gammas and betas are drawn away from their 1/0 initial values
    so that a port that ignores them, or swaps them, fails the comparison.
    Names are visited in sorted order so the draw does not depend on how
    Keras orders its weights.
    """
    rng = np.random.default_rng(seed)
    values = {}
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        kind = name.rsplit("/", 1)[-1]
        if kind == "kernel":
            value = rng.normal(0.0, 1.0 / np.sqrt(shape[0]), shape)
        elif kind == "embeddings":
            value = rng.normal(0.0, 0.5, shape)
        elif kind == "gamma":
            value = rng.uniform(0.5, 1.5, shape)
        elif kind in ("beta", "bias"):
            value = rng.normal(0.0, 0.3, shape)
        else:
            raise ValueError(f"unexpected variable {name}")
        values[name] = value.astype(np.float32)
    return values


def write_checkpoint(values: dict[str, np.ndarray], prefix: str) -> None:
    """Save ``values`` as a TF1-style checkpoint (as ``RanNet.export_checkpoint`` does).

    ``save_relative_paths`` keeps the ``checkpoint`` state file free of
    absolute paths, so the folder can move.
    """
    with tf.Graph().as_default():
        variables = {name: tf.compat.v1.Variable(value, name=name) for name, value in values.items()}
        saver = tf.compat.v1.train.Saver(var_list=variables, save_relative_paths=True)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            saver.save(session, prefix, write_meta_graph=False)


def build_model(params: RanNetParams, cell_pooling: str) -> keras.Model:
    """Build an MLM model (logits, no softmax) with rannet's default initializers."""
    rannet = RanNet(
        params, return_history=True, apply_cell_transform=False, mlm_softmax=False, cell_pooling=cell_pooling
    )
    return rannet(with_mlm=True)


def load_model(folder: str, cell_pooling: str) -> keras.Model:
    """Load a fixture folder through rannet's own ``RanNet.load_rannet``.

    ``cell_pooling`` is passed explicitly: ``RanNet`` defaults it to ``last``
    and then ignores the value in config.json.
    """
    _, model = RanNet.load_rannet(
        config_path=os.path.join(folder, "config.json"),
        checkpoint_path=os.path.join(folder, CHECKPOINT_PREFIX),
        with_mlm=True,
        return_history=True,
        apply_cell_transform=False,
        mlm_softmax=False,
        cell_pooling=cell_pooling,
    )
    return model


def probe_model(model: keras.Model, ran_layers: int) -> keras.Model:
    """Expose each RAN layer's [last_cell, token_states, pooled_cell] and the MLM logits."""
    outputs = []
    for i in range(ran_layers):
        outputs.extend(model.get_layer(f"RAN-{i}").output)
    outputs.append(model.output)
    return keras.Model(model.inputs, outputs)


def run_case(probe: keras.Model, ids: np.ndarray, ran_layers: int) -> dict[str, np.ndarray]:
    """Run one unpadded sequence (batch of 1) and collect the reference outputs."""
    # rannet's Input-Token is float32; ids are small integers, so exact.
    batch = ids[None, :].astype(np.float32)
    raw = [t.numpy()[0] for t in probe(batch, training=False)]
    # A second, identical run shows that dropout is off (config.json keeps
    # a real dropout rate, as the released config does).
    for first, second in zip(raw, probe(batch, training=False)):
        np.testing.assert_array_equal(first, second.numpy()[0])
    last_cells = np.stack(raw[0 : 3 * ran_layers : 3])
    token_states = np.stack(raw[1 : 3 * ran_layers : 3])
    pooled_cells = np.stack(raw[2 : 3 * ran_layers : 3])
    return {
        "token_states": token_states[-1],
        "mlm_logits": raw[-1],
        "last_cell": last_cells[-1],
        "pooled_cell": pooled_cells[-1],
        "layer_last_cells": last_cells,
        "layer_pooled_cells": pooled_cells,
    }


# Outputs that have one row per token (concatenated over cases); all others
# have one row per case (stacked).
TOKEN_KEYS = ("token_states", "mlm_logits")


def run_cases(probe: keras.Model, inputs: list[np.ndarray], ran_layers: int) -> dict[str, np.ndarray]:
    """Run every case and lay the outputs out as documented at the top of this file."""
    per_case = [run_case(probe, ids, ran_layers) for ids in inputs]
    return {
        key: (np.concatenate if key in TOKEN_KEYS else np.stack)([out[key] for out in per_case]).astype(np.float32)
        for key in per_case[0]
    }


def save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write an uncompressed .npz with fixed zip timestamps.

    ``np.savez`` stamps each member with the current time, so regenerating
    identical fixtures would still change their bytes; a fixed stamp keeps
    reruns free of spurious diffs. Random floats do not compress, so no
    compression is used.
    """
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for key, value in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with archive.open(info, "w") as member:
                np.lib.format.write_array(member, np.asarray(value), allow_pickle=False)


def make_fixture(spec: dict, output_dir: str) -> str:
    """Write one fixture folder and return its path."""
    config = dict(spec["config"], **COMMON_CONFIG)
    params = RanNetParams(config)
    n_layers = config["ran_layers"]
    folder = os.path.join(output_dir, spec["name"])
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)

    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    vocab = VOCAB[: config["vocab_size"]]
    assert len(vocab) == config["vocab_size"], "extend VOCAB for this vocab_size"
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")

    # Random weights, written under the official names.
    keras.backend.clear_session()
    fresh = build_model(params, config["cell_pooling"])
    shapes = {name: var.shape for name, var in model_checkpoint_names(fresh, n_layers).items()}
    values = random_weights(shapes, spec["seed"])
    write_checkpoint(values, os.path.join(folder, CHECKPOINT_PREFIX))

    # Reload with rannet's loader and check that every variable arrived, MLM
    # head included (the loader silently skips MLM layers it cannot load).
    keras.backend.clear_session()
    model = load_model(folder, config["cell_pooling"])
    for name, var in model_checkpoint_names(model, n_layers).items():
        np.testing.assert_array_equal(var.numpy(), values[name], err_msg=name)

    tokenizer = RanNetWordPieceTokenizer.from_file(os.path.join(folder, "vocab.txt"), lowercase=True)
    encoding = tokenizer.encode(SAMPLE_TEXT)
    text_ids = np.asarray(encoding.ids, dtype=np.int32)

    rng = np.random.default_rng(spec["seed"] + 1)
    window, min_window = config["window_size"], config["min_window_size"]
    inputs = [
        rng.integers(1, config["vocab_size"], size=n).astype(np.int32) for n in probe_lengths(window, min_window)
    ]
    inputs.append(text_ids)

    lengths = np.asarray([len(ids) for ids in inputs], dtype=np.int32)
    windows = [
        (k, start, end) for k, n in enumerate(lengths) for start, end in rannet_windows(int(n), window, min_window)
    ]
    arrays = {
        "lengths": lengths,
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        "input_ids": np.concatenate(inputs),
        "windows": np.asarray(windows, dtype=np.int32),
        **run_cases(probe_model(model, n_layers), inputs, n_layers),
        "text": np.asarray(SAMPLE_TEXT),
        "text_tokens": np.asarray(encoding.tokens),
        "text_ids": text_ids,
    }
    save_npz(os.path.join(folder, "expected.npz"), arrays)
    if spec.get("training_checkpoint"):
        make_training_checkpoint(params, values, folder, folder + "_training")
    return folder


TRAINING_CHECKPOINT_PREFIX = "01.weights"


def make_training_checkpoint(
    params: RanNetParams, values: dict[str, np.ndarray], source_folder: str, folder: str
) -> None:
    """Save ``values`` as rannet's pretraining does, in ``folder``.

    ``rannet pretrain`` builds ``RanNetForMLMPretrain`` and saves it with a
    Keras ``ModelCheckpoint(save_weights_only=True)``, i.e.
    ``model.save_weights``: an object-based checkpoint whose names follow
    Python attributes, not ``RanNet.variable_mapping``. rannet's own
    ``RanNet.export_checkpoint`` must turn it into exactly the official names
    and ``values``; this is checked here.
    """
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    for name in ("config.json", "vocab.txt"):
        shutil.copyfile(os.path.join(source_folder, name), os.path.join(folder, name))

    keras.backend.clear_session()
    model = RanNetForMLMPretrain(params)()
    for name, var in model_checkpoint_names(model, params.ran_layers).items():
        var.assign(values[name])
    prefix = os.path.join(folder, TRAINING_CHECKPOINT_PREFIX)
    model.save_weights(prefix)

    with tempfile.TemporaryDirectory() as tmp, tf.Graph().as_default():
        exported = os.path.join(tmp, CHECKPOINT_PREFIX)
        RanNet.export_checkpoint(os.path.join(folder, "config.json"), prefix, exported)
        names = [name for name, _ in tf.train.list_variables(exported)]
        if sorted(names) != sorted(values):
            raise RuntimeError(f"{folder}: export_checkpoint gives other names than the official ones")
        for name in names:
            np.testing.assert_array_equal(tf.train.load_variable(exported, name), values[name], err_msg=name)


# Tensors of every dtype a checkpoint commonly holds, for the checkpoint reader.
BUNDLE_SHARD_BYTES = 2048


def make_bundle_fixture(output_dir: str) -> str:
    """Write ``tf_bundle/``: a sharded checkpoint of tensors of many dtypes and what TensorFlow reads from it.

    Tensors larger than a shard are saved in slices (under keys that encode
    the slice); ``float32_tall`` has slices that start beyond row 63, whose
    keys need multi-byte numbers.
    """
    folder = os.path.join(output_dir, "tf_bundle")
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    rng = np.random.default_rng(1200)
    tensors = {
        "float32_matrix": tf.constant(rng.normal(size=(24, 40)), tf.float32),
        "float32_tall": tf.constant(rng.normal(size=(300, 2)), tf.float32),
        "float64_vector": tf.constant(rng.normal(size=(7,)), tf.float64),
        "float16_matrix": tf.constant(rng.normal(size=(3, 5)), tf.float16),
        "bfloat16_matrix": tf.constant(rng.normal(size=(4, 6)), tf.bfloat16),
        "int8_vector": tf.constant(rng.integers(-128, 128, size=9), tf.int8),
        "uint8_vector": tf.constant(rng.integers(0, 256, size=9), tf.uint8),
        "int32_tensor": tf.constant(rng.integers(-(2**31), 2**31, size=(2, 3, 4)), tf.int32),
        "int64_vector": tf.constant(rng.integers(-(2**62), 2**62, size=5), tf.int64),
        "bool_vector": tf.constant(rng.integers(0, 2, size=11).astype(bool)),
        "float32_scalar": tf.constant(-2.5, tf.float32),
        "float32_empty": tf.zeros((0, 3), tf.float32),
    }
    checkpoint = tf.train.Checkpoint(**{name: tf.Variable(value) for name, value in tensors.items()})
    policy = tf.train.experimental.MaxShardSizePolicy(max_shard_size=BUNDLE_SHARD_BYTES)
    prefix = os.path.join(folder, "sharded")
    checkpoint.write(prefix, options=tf.train.CheckpointOptions(experimental_sharding_callback=policy))

    names, dtypes, arrays = [], [], {}
    for name, _ in tf.train.list_variables(prefix):
        value = tf.train.load_variable(prefix, name)
        if name == "_CHECKPOINTABLE_OBJECT_GRAPH":
            continue  # a serialized proto (string), not a tensor the converter reads
        dtype = tf.as_dtype(value.dtype).name
        arrays[f"tensor_{len(names)}"] = value.astype(np.float32) if dtype == "bfloat16" else value
        names.append(name)
        dtypes.append(dtype)
    shards = [f for f in os.listdir(folder) if f.startswith("sharded.data-")]
    if len(shards) < 2:
        raise RuntimeError(f"{folder}: expected several shards, got {shards}")
    save_npz(
        os.path.join(folder, "expected.npz"), {"names": np.asarray(names), "dtypes": np.asarray(dtypes), **arrays}
    )
    return folder


# Hand-written tokenizer cases: accents, scripts, numbers, URLs, control and
# zero-width characters, emoji, over-long words, special-token literals.
TOKENIZER_TEXTS = [
    "",
    "   ",
    "They walked in the Rain, and she talked about it. Zebras!",
    "Café naïve résumé, Ångström in Zürich and São Paulo; ÉCOLE Françoise Øresund Łódź.",
    "東京 is in 日本, 北京欢迎你 and 서울 too.",
    "αβγ Ωμέγα, Москва and Kraków.",
    "Email john.doe@example.com or visit https://example.org/a-b_c?q=1&x=2#frag now.",
    "In 1997, revenue rose 12.5% to $3,400,000 (approx. 3.4m) on 01/02/2003 at 10:45pm.",
    "Article 93 (3) (c) of Regulation (EEC) No 1234/2007, OJ L 299, 16.11.2007, p. 1.",
    "state-of-the-art e-mail foo_bar C++ C# .NET x86-64 U.S.A. Ph.D. i.e. e.g.",
    "Don't stop -- it's ``quoted'' and \u201ccurly\u201d \u2018single\u2019\u2026 \u2014 dash.",
    "tab\there\nnew line\r\nand\u200bzero\u00a0width\u2028separator\x00null\x07bell",
    "I love it \U0001f600\U0001f44d\U0001f3fd!!! \u2764\ufe0f",
    "pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "a" * 99 + " " + "b" * 100 + " " + "c" * 101,
    "The [MASK] sat on the [MASK].",
    "[SEP] [PAD] [UNK] [START] [END] [unused0] [unused999] [unused1000]",
    "[mask] [Mask] x[MASK]y [MASK][MASK] [ MASK ]",
    "SHOUTING IN ALL CAPS, MiXeD cAsE and camelCaseWords.",
    "Ⅻ ½ ² ﬁ ﬀ ＡＢＣ１２３ full-width and ligatures",
]

TOKENIZER_PAIRS = [
    ("Is this the first sentence?", "Yes, and this is the second one."),
    ("Café au lait", "[MASK] au lait"),
    ("", "only the second"),
    ("EU Regulation No 1234/2007", "It entered into force on 16 November 2007."),
]

# Sentences sampled from the benchmark data (test splits), per source.
TOKENIZER_SOURCES = ("conll2003/test.txt", "20newsgroups/test.jsonl.gz", "eurlex57k/test.jsonl.gz")
SENTENCES_PER_SOURCE = 100


def conll_sentences(path: str) -> Iterator[str]:
    """The sentences of a CoNLL-2003 file, words joined by single spaces, -DOCSTART- blocks skipped."""
    with open(path, encoding="utf-8") as f:
        for block in f.read().split("\n\n"):
            words = [line.split(" ")[0] for line in block.splitlines() if line.strip()]
            if words and words[0] != "-DOCSTART-":
                yield " ".join(words)


def jsonl_texts(path: str) -> Iterator[str]:
    """The ``text`` field of every record of a gzipped JSON-lines file."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def source_texts(data_dir: str, source: str) -> Iterator[str]:
    path = os.path.join(data_dir, source)
    return jsonl_texts(path) if source.endswith(".jsonl.gz") else conll_sentences(path)


SENTENCE = re.compile(r"\S[^\n]*?(?:[.!?](?=\s)|(?=\n)|$)")


def sentence_spans(text: str, min_chars: int = 20, max_chars: int = 400) -> list[tuple[int, int]]:
    """(start, end) of the sentences and lines of ``text`` that are ``min_chars`` to ``max_chars`` long."""
    return [m.span() for m in SENTENCE.finditer(text) if min_chars <= len(m.group()) <= max_chars]


def short_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def sample_sentences(data_dir: str, source: str, count: int, seed: int) -> list[dict]:
    """``count`` sentence references drawn at random from ``source``, in file order."""
    rng = np.random.default_rng(seed)
    texts = list(source_texts(data_dir, source))
    if source.endswith(".jsonl.gz"):
        candidates = [
            (k, span)
            for k in sorted(rng.choice(len(texts), size=4 * count, replace=False))
            for span in sentence_spans(texts[k])[:50]
        ]
    else:
        candidates = [(k, (0, len(text))) for k, text in enumerate(texts) if len(text.split()) >= 3]
    picks = sorted(rng.choice(len(candidates), size=count, replace=False))
    refs = []
    for k, (start, end) in (candidates[i] for i in picks):
        refs.append(
            {
                "source": source,
                "index": int(k),
                "start": int(start),
                "end": int(end),
                "sha256": short_sha256(texts[k][start:end]),
            }
        )
    return refs


def build_vocab(
    data_dir: str, num_words: int = 2200, num_prefixes: int = 300, num_suffixes: int = 500, min_char_count: int = 5
) -> list[str]:
    """A WordPiece vocabulary built by counting (the tokenizers trainer is not deterministic).

    rannet's default special tokens first (as its own trainer puts them), then
    frequent characters (alone and as ``##`` continuations), frequent words,
    word-initial prefixes and ``##`` suffixes, counted on lower-cased,
    accent-stripped words of the training splits.
    """
    normalizer, pre_tokenizer = BertNormalizer(lowercase=True), BertPreTokenizer()
    newsgroups = jsonl_texts(os.path.join(data_dir, "20newsgroups", "train.jsonl.gz"))
    eurlex = jsonl_texts(os.path.join(data_dir, "eurlex57k", "dev.jsonl.gz"))
    corpus = [
        *conll_sentences(os.path.join(data_dir, "conll2003", "train.txt")),
        *islice(newsgroups, 3000),
        *islice(eurlex, 1000),
    ]
    words = Counter()
    for text in corpus:
        words.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))

    def most_common(counter: Counter, n: int) -> list[str]:
        return [item for item, _ in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]

    chars, prefixes, suffixes = Counter(), Counter(), Counter()
    for word, n in words.items():
        for char in word:
            chars[char] += n
        if len(word) >= 7:
            prefixes.update({word[:k]: n for k in (3, 4, 5)})
        if len(word) >= 5:
            suffixes.update({"##" + word[-k:]: n for k in (2, 3, 4)})
    alphabet = sorted(c for c, n in chars.items() if n >= min_char_count)
    multi_char_words = Counter({w: n for w, n in words.items() if len(w) > 1})
    vocab = (
        SpecialTokens().tokens
        + alphabet
        + ["##" + c for c in alphabet]
        + most_common(multi_char_words, num_words)
        + most_common(prefixes, num_prefixes)
        + most_common(suffixes, num_suffixes)
    )
    return list(dict.fromkeys(vocab))  # drop repeats, keep the first position


def make_tokenizer_fixture(output_dir: str, data_dir: str) -> str:
    """Write ``tokenizer/``: a vocabulary and RanNetWordPieceTokenizer's ids for real and hand-written text."""
    folder = os.path.join(output_dir, "tokenizer")
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    vocab_path = os.path.join(folder, "vocab.txt")
    with open(vocab_path, "w", encoding="utf-8") as f:
        f.write("\n".join(build_vocab(data_dir)) + "\n")
    tokenizer = RanNetWordPieceTokenizer.from_file(vocab_path, lowercase=True)

    cases = [{"text": text} for text in TOKENIZER_TEXTS]
    cases += [{"text": text, "pair": pair} for text, pair in TOKENIZER_PAIRS]
    for seed, source in enumerate(TOKENIZER_SOURCES, start=1300):
        refs = sample_sentences(data_dir, source, SENTENCES_PER_SOURCE, seed)
        texts = list(source_texts(data_dir, source))
        cases += [dict(ref, text=texts[ref["index"]][ref["start"] : ref["end"]]) for ref in refs]
    with open(os.path.join(folder, "cases.jsonl"), "w", encoding="utf-8") as f:
        for case in cases:
            pair = case.get("pair")
            encoding = tokenizer.encode(case["text"]) if pair is None else tokenizer.encode(case["text"], pair)
            ids = encoding.ids
            if "source" in case:
                case = {key: value for key, value in case.items() if key != "text"}  # the data stays out of git
            f.write(json.dumps(dict(case, ids=ids), ensure_ascii=True) + "\n")
    return folder


def check_fixture(spec: dict, folder: str) -> float:
    """Reload a written folder from scratch and return the largest output deviation."""
    config = spec["config"]
    keras.backend.clear_session()
    model = load_model(folder, config["cell_pooling"])
    with np.load(os.path.join(folder, "expected.npz")) as expected:
        offsets = expected["offsets"]
        inputs = [expected["input_ids"][offsets[k] : offsets[k + 1]] for k in range(len(offsets) - 1)]
        got = run_cases(probe_model(model, config["ran_layers"]), inputs, config["ran_layers"])
        return max(float(np.max(np.abs(value - expected[key]))) for key, value in got.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output_dir", default="tests/fixtures/rannet", help="folder that receives one sub-folder per fixture"
    )
    parser.add_argument("--only", nargs="*", default=None, help="names of the fixtures to (re)generate; default: all")
    parser.add_argument(
        "--data_dir",
        default=DEFAULT_DATA_DIR,
        help="benchmark data (CoNLL-2003, 20 Newsgroups, EURLEX-57K) for the tokenizer cases",
    )
    args = parser.parse_args()

    specs = [s for s in FIXTURES if args.only is None or s["name"] in args.only]
    os.makedirs(args.output_dir, exist_ok=True)
    # The layout description travels with the fixtures.
    with open(os.path.join(args.output_dir, "README.md"), "w") as f:
        f.write(
            "# rannet reference fixtures\n\n"
            "Written by `scripts/rannet_tf/make_rannet_fixtures.py`; what follows is its docstring.\n\n"
        )
        f.write(__doc__.replace("::\n", ":\n"))
    for spec in specs:
        folder = make_fixture(spec, args.output_dir)
        worst = check_fixture(spec, folder)
        if worst != 0.0:
            raise RuntimeError(f"{folder}: reloaded outputs differ by {worst}")
        report(folder)
        if spec.get("training_checkpoint"):
            report(folder + "_training")
    if args.only is None or "tf_bundle" in args.only:
        report(make_bundle_fixture(args.output_dir))
    if args.only is None or "tokenizer" in args.only:
        report(make_tokenizer_fixture(args.output_dir, args.data_dir))


def report(folder: str) -> None:
    size_kb = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 1024
    print(f"{folder}: ok ({size_kb:.0f} KiB)")


if __name__ == "__main__":
    main()
