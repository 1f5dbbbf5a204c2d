"""Generate reference fixtures of the official sequence-to-sequence RAN (``RanNetForSeq2Seq``).

Run it from the TensorFlow environment described in ``make_rannet_fixtures.py``::

    TF_KERAS=1 TF_USE_LEGACY_KERAS=1 /work/tfenv/bin/python scripts/rannet_tf/make_seq2seq_fixtures.py

It writes ``<output_dir>/seq2seq_l2_d24_w6/`` holding ``config.json``, ``vocab.txt``
and a checkpoint under the official variable names (``RanNetForSeq2Seq`` has the
variables of the MLM model, so ``RanNet.variable_mapping()`` names them all), and
``expected.npz`` with, for cases concatenated along the token axis as in
``make_rannet_fixtures.py`` (case ``k`` owns tokens ``offsets[k]:offsets[k + 1]``)::

    lengths         (C,)       int32    length of each case (source + target)
    source_lengths  (C,)       int32    tokens of segment 0 in each case
    offsets         (C + 1,)   int32    cumulative lengths
    input_ids       (T,)       int32    token ids (never 0, the pad id)
    token_type_ids  (T,)       int32    0 for the source, 1 for the target
    token_states    (T, D)     float32  last layer token states
    mlm_logits      (T, V)     float32  MLM head output before the softmax
    probabilities   (T, V)     float32  ``RanNetForSeq2Seq``'s own output (its softmax)

Every case puts a source token in its last window and leaves a final window of
at least ``min_window_size`` tokens: there the official model reads, for every
token, exactly what a target-causal model may read (docs/seq2seq.md says where
it reads more).
"""

import os
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
from langml import keras  # noqa: E402
from make_rannet_fixtures import (  # noqa: E402  (sets the Keras environment before TensorFlow loads)
    CHECKPOINT_PREFIX,
    COMMON_CONFIG,
    VOCAB,
    model_checkpoint_names,
    random_weights,
    report,
    save_npz,
    write_checkpoint,
)
from rannet import RanNet, RanNetForSeq2Seq, RanNetParams  # noqa: E402


SPEC = {
    "name": "seq2seq_l2_d24_w6",
    "seed": 3501,
    "config": {
        "vocab_size": 60,
        "embedding_size": 24,
        "ran_layers": 2,
        "head_num": 2,
        "head_size": 8,
        "window_size": 6,
        "min_window_size": 2,
        "cell_pooling": "last",
    },
}
# (source length, target length): one window; a boundary window as the last; an exact multiple of the window;
# a one-token source; a one-token target; three windows.
CASES = [(3, 2), (8, 3), (7, 1), (1, 4), (5, 1), (13, 5), (14, 3)]


def official_windows_hold_source(source: int, target: int, window: int, min_window: int) -> bool:
    """The last official window holds a source token, and no short tail was merged into it."""
    total = source + target
    tail = total % window
    if total > window and 0 < tail < min_window:
        return False
    last_start = ((total - 1) // window) * window
    return last_start < source


def logits_network(params: RanNetParams) -> RanNet:
    """The seq2seq network with the MLM head's logits (``RanNetForSeq2Seq`` ends in a softmax)."""
    return RanNet(
        params,
        return_sequences=True,
        return_cell=False,
        mlm_softmax=False,
        apply_cell_transform=False,
        apply_lm_mask=False,
        apply_seq2seq_mask=True,
    )


def with_token_states(model: keras.Model, ran_layers: int) -> keras.Model:
    last = model.get_layer(f"RAN-{ran_layers - 1}").output[1]
    return keras.Model(model.inputs, [last, model.output])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="tests/fixtures/rannet")
    args = parser.parse_args()
    config = dict(SPEC["config"], **COMMON_CONFIG)
    params = RanNetParams(config)
    layers, window, min_window = config["ran_layers"], config["window_size"], config["min_window_size"]
    for source, target in CASES:
        assert official_windows_hold_source(source, target, window, min_window), (source, target)

    folder = os.path.join(args.output_dir, SPEC["name"])
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(VOCAB[: config["vocab_size"]]) + "\n")

    keras.backend.clear_session()
    logits = logits_network(params)(with_mlm=True, seq2seq=True)
    shapes = {name: var.shape for name, var in model_checkpoint_names(logits, layers).items()}
    values = random_weights(shapes, SPEC["seed"])
    write_checkpoint(values, os.path.join(folder, CHECKPOINT_PREFIX))

    # The official class, loaded by rannet's own loader from the written checkpoint; the logits model is the same
    # network without the final softmax, loaded the same way.
    checkpoint = os.path.join(folder, CHECKPOINT_PREFIX)
    keras.backend.clear_session()
    official = RanNetForSeq2Seq(params)
    official_model = official.restore_weights_from_checkpoint(official(), checkpoint, ran_layers=layers)
    rannet = logits_network(params)
    logits = rannet.restore_weights_from_checkpoint(rannet(with_mlm=True, seq2seq=True), checkpoint, ran_layers=layers)
    for name, var in model_checkpoint_names(logits, layers).items():
        np.testing.assert_array_equal(var.numpy(), values[name], err_msg=name)
    probe = with_token_states(logits, layers)

    rng = np.random.default_rng(SPEC["seed"] + 1)
    ids, segments, states, mlm_logits, probabilities = [], [], [], [], []
    for source, target in CASES:
        case_ids = rng.integers(1, config["vocab_size"], size=source + target).astype(np.int32)
        case_segments = np.asarray([0] * source + [1] * target, dtype=np.int32)
        batch = [case_ids[None].astype(np.float32), case_segments[None].astype(np.float32)]
        token_states, case_logits = (t.numpy()[0] for t in probe(batch, training=False))
        case_probabilities = official_model(batch, training=False).numpy()[0]
        # The official class is the logits model followed by its softmax.
        shifted = np.exp(case_logits - case_logits.max(-1, keepdims=True))
        np.testing.assert_allclose(shifted / shifted.sum(-1, keepdims=True), case_probabilities, atol=1e-6)
        ids.append(case_ids)
        segments.append(case_segments)
        states.append(token_states)
        mlm_logits.append(case_logits)
        probabilities.append(case_probabilities)

    lengths = np.asarray([s + t for s, t in CASES], dtype=np.int32)
    save_npz(
        os.path.join(folder, "expected.npz"),
        {
            "lengths": lengths,
            "source_lengths": np.asarray([s for s, _ in CASES], dtype=np.int32),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            "input_ids": np.concatenate(ids),
            "token_type_ids": np.concatenate(segments),
            "token_states": np.concatenate(states).astype(np.float32),
            "mlm_logits": np.concatenate(mlm_logits).astype(np.float32),
            "probabilities": np.concatenate(probabilities).astype(np.float32),
        },
    )
    report(folder)


if __name__ == "__main__":
    main()
