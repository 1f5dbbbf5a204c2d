"""Reference fixtures for two official options: a starting cell as input (``with_cell=True``) and the adaptive LM.

Run it from the TensorFlow environment described in ``make_rannet_fixtures.py``::

    TF_KERAS=1 TF_USE_LEGACY_KERAS=1 /work/tfenv/bin/python scripts/rannet_tf/make_rannet_cell_and_adaptive_fixtures.py

It writes, under ``tests/fixtures/rannet/``:

* ``with_cell/<name>.npz`` for every encoder fixture ``<name>`` of ``make_rannet_fixtures.py`` (its checkpoint is
  reused, not copied): the encoder and MLM head loaded by ``RanNet.load_rannet(..., with_cell=True)`` and run on one
  unpadded sequence at a time with a random starting cell. Cases are laid out as in ``expected.npz`` (``lengths``,
  ``offsets``, ``input_ids``, ``token_states``, ``mlm_logits``, ``last_cell``, ``pooled_cell``, ``layer_last_cells``)
  plus ``initial_cells`` (C, D), the cell each case starts from, and ``no_cell_last_cell`` (C, D), the last cell the
  same model gives without one (so a test sees that the cell changes the outputs).
* ``adaptive_<name>/`` for every entry of ``ADAPTIVE``: a ``RanNetForAdaptiveLM`` (``cutoffs``, ``div_val``) with
  random weights saved by Keras ``save_weights`` (object-based names such as
  ``layer_with_weights-0/embeddings-1/.ATTRIBUTES/VARIABLE_VALUE``: ``rannet`` defines no other names for this class),
  ``config.json``, ``vocab.txt``, ``adaptive.json`` (``{"cutoffs": [...], "div_val": k}``, the constructor's
  arguments, which ``config.json`` does not hold) and ``expected.npz``: per unpadded case, ``input_ids``,
  ``embeddings`` (T, D) the adaptive input embedding, ``token_states`` (T, D) the last RAN layer's output (what the
  output mapping reads) and ``log_probs`` (T, V) the log of the adaptive softmax's probabilities.

``RanNetForAdaptiveLM`` works only with ``return_cell=True`` in ``rannet`` 0.3.1 (without it, building the model fails
on ``outputs[1]``); the cell output is not used here.
"""

import os


os.environ.setdefault("TF_KERAS", "1")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
from langml import keras  # noqa: E402
from rannet import RanNet, RanNetForAdaptiveLM, RanNetParams  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_rannet_fixtures import (  # noqa: E402
    CHECKPOINT_PREFIX,
    COMMON_CONFIG,
    FIXTURES,
    VOCAB,
    probe_lengths,
    save_npz,
)


warnings.filterwarnings("ignore", message=".*is unseeded.*")

# Adaptive LMs: two clusters with shrinking embeddings (div_val 2), and div_val 1 (one tied full softmax, cutoffs
# without effect in rannet's AdaptiveSoftmax).
ADAPTIVE: list[dict] = [
    {
        "name": "adaptive_l2_d16_w6_div2",
        "seed": 1201,
        "cutoffs": [12, 30],
        "div_val": 2,
        "config": {
            "vocab_size": 48,
            "embedding_size": 16,
            "ran_layers": 2,
            "head_num": 2,
            "head_size": 8,
            "window_size": 6,
            "min_window_size": 3,
            "cell_pooling": "last",
        },
    },
    {
        "name": "adaptive_l1_d16_w4_div1",
        "seed": 1202,
        "cutoffs": [20],
        "div_val": 1,
        "config": {
            "vocab_size": 40,
            "embedding_size": 16,
            "ran_layers": 1,
            "head_num": 2,
            "head_size": 8,
            "window_size": 4,
            "min_window_size": 2,
            "cell_pooling": "last",
        },
    },
]


def case_lengths(config: dict) -> list[int]:
    return probe_lengths(config["window_size"], config["min_window_size"])


def random_ids(rng, length: int, vocab_size: int) -> np.ndarray:
    return rng.integers(1, vocab_size, size=length).astype(np.int32)  # never 0, the pad id


# --------------------------------------------------------------------------------------------------------------------
# with_cell=True
# --------------------------------------------------------------------------------------------------------------------


def with_cell_probe(folder: str, config: dict, with_cell: bool) -> keras.Model:
    """The encoder fixture's checkpoint loaded by rannet's own loader, exposing every layer's outputs and the MLM
    logits (as `make_rannet_fixtures.probe_model`)."""
    keras.backend.clear_session()
    _, model = RanNet.load_rannet(
        config_path=os.path.join(folder, "config.json"),
        checkpoint_path=os.path.join(folder, CHECKPOINT_PREFIX),
        with_mlm=True,
        with_cell=with_cell,
        return_history=True,
        apply_cell_transform=False,
        mlm_softmax=False,
        cell_pooling=config["cell_pooling"],
    )
    outputs = []
    for i in range(config["ran_layers"]):
        outputs.extend(model.get_layer(f"RAN-{i}").output)
    outputs.append(model.output)
    return keras.Model(model.inputs, outputs)


def make_with_cell_fixture(spec: dict, output_dir: str, seed: int) -> str:
    config = spec["config"]
    folder = os.path.join(output_dir, spec["name"])
    layers, size = config["ran_layers"], config["embedding_size"]
    rng = np.random.default_rng(seed)
    lengths = case_lengths(config)
    inputs = [random_ids(rng, n, config["vocab_size"]) for n in lengths]
    # Standardised-looking cells (what a `last_cell` is): never all zeros, which rannet would replace.
    cells = rng.normal(0.0, 1.0, (len(lengths), size)).astype(np.float32)

    probe = with_cell_probe(folder, config, with_cell=True)
    runs = []
    for ids, cell in zip(inputs, cells):
        raw = [t.numpy()[0] for t in probe([ids[None].astype(np.float32), cell[None]], training=False)]
        runs.append(raw)
    plain = with_cell_probe(folder, config, with_cell=False)
    no_cell_last = [plain(ids[None].astype(np.float32), training=False)[3 * (layers - 1)].numpy()[0] for ids in inputs]

    arrays = {
        "lengths": np.array(lengths, np.int32),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        "input_ids": np.concatenate(inputs).astype(np.int32),
        "initial_cells": cells,
        "token_states": np.concatenate([raw[3 * (layers - 1) + 1] for raw in runs]),
        "mlm_logits": np.concatenate([raw[-1] for raw in runs]),
        "last_cell": np.stack([raw[3 * (layers - 1)] for raw in runs]),
        "pooled_cell": np.stack([raw[3 * (layers - 1) + 2] for raw in runs]),
        "layer_last_cells": np.stack([np.stack(raw[0 : 3 * layers : 3]) for raw in runs]),
        "no_cell_last_cell": np.stack(no_cell_last),
    }
    os.makedirs(os.path.join(output_dir, "with_cell"), exist_ok=True)
    path = os.path.join(output_dir, "with_cell", f"{spec['name']}.npz")
    save_npz(path, {key: np.asarray(value, dtype=value.dtype) for key, value in arrays.items()})
    return path


# --------------------------------------------------------------------------------------------------------------------
# RanNetForAdaptiveLM
# --------------------------------------------------------------------------------------------------------------------


def random_like(weights, seed: int) -> list[np.ndarray]:
    """Random values for every weight (biases and norms away from 0/1), drawn in the model's weight order."""
    rng = np.random.default_rng(seed)
    values = []
    for weight in weights:
        shape, name = tuple(weight.shape), weight.name.split(":")[0].rsplit("/", 1)[-1]
        if name.startswith("gamma"):
            value = rng.uniform(0.5, 1.5, shape)
        elif name.startswith(("beta", "bias")):
            value = rng.normal(0.0, 0.3, shape)
        elif name.startswith("embeddings"):
            value = rng.normal(0.0, 0.5, shape)
        else:  # kernels
            value = rng.normal(0.0, 1.0 / np.sqrt(shape[0]), shape)
        values.append(value.astype(np.float32))
    return values


def build_adaptive(spec: dict) -> keras.Model:
    keras.backend.clear_session()
    params = RanNetParams(dict(spec["config"], **COMMON_CONFIG))
    rannet = RanNetForAdaptiveLM(params, cutoffs=list(spec["cutoffs"]), div_val=spec["div_val"], return_cell=True)
    return rannet()


def adaptive_probe(model: keras.Model, ran_layers: int) -> keras.Model:
    """Input embedding, last RAN layer's token states and the adaptive softmax's probabilities."""
    return keras.Model(
        model.inputs,
        [
            model.get_layer("Adaptive-Embedding").output[0],
            model.get_layer(f"RAN-{ran_layers - 1}").output[1],
            model.get_layer("Adaptive-Softmax").output,
        ],
    )


def make_adaptive_fixture(spec: dict, output_dir: str) -> str:
    config = dict(spec["config"], **COMMON_CONFIG)
    folder = os.path.join(output_dir, spec["name"])
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(folder, "adaptive.json"), "w") as f:
        json.dump({"cutoffs": spec["cutoffs"], "div_val": spec["div_val"]}, f)
        f.write("\n")
    vocab = VOCAB[: config["vocab_size"]]
    assert len(vocab) == config["vocab_size"], "extend VOCAB for this vocab_size"
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")

    model = build_adaptive(spec)
    model.set_weights(random_like(model.weights, spec["seed"]))
    prefix = os.path.join(folder, "model.weights")
    model.save_weights(prefix)  # TensorFlow format: object-based names
    # Outputs of a model rebuilt from scratch and loaded from the written checkpoint.
    model = build_adaptive(spec)
    model.load_weights(prefix).assert_existing_objects_matched()
    probe = adaptive_probe(model, config["ran_layers"])

    rng = np.random.default_rng(spec["seed"] + 1)
    lengths = case_lengths(config)
    inputs = [random_ids(rng, n, config["vocab_size"]) for n in lengths]
    outputs = [[t.numpy()[0] for t in probe(ids[None].astype(np.float32), training=False)] for ids in inputs]
    probs = np.concatenate([out[2] for out in outputs])
    assert np.allclose(probs.sum(-1), 1.0, atol=1e-5), "the adaptive softmax's rows must sum to 1"
    save_npz(
        os.path.join(folder, "expected.npz"),
        {
            "lengths": np.array(lengths, np.int32),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            "input_ids": np.concatenate(inputs).astype(np.int32),
            "embeddings": np.concatenate([out[0] for out in outputs]).astype(np.float32),
            "token_states": np.concatenate([out[1] for out in outputs]).astype(np.float32),
            "log_probs": np.log(probs).astype(np.float32),
        },
    )
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="tests/fixtures/rannet")
    args = parser.parse_args()
    for seed, spec in enumerate(FIXTURES, start=1250):
        print(make_with_cell_fixture(spec, args.output_dir, seed))
    for spec in ADAPTIVE:
        print(make_adaptive_fixture(spec, args.output_dir))


if __name__ == "__main__":
    main()
