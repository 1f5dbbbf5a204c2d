"""Measure how far information travels between windows in rannet's causal LM mode.

rannet's causal mode (``RanNetForLM``, i.e. ``apply_lm_mask=True``) applies a
triangular mask to every window's [cell; tokens] block, so the cell (position
0) attends only to itself. If that is so, no token ever reaches the cell, and
the tokens of one window cannot influence the outputs of any later window.

For random-weight models with 1-3 layers this script changes every token of
the first window and reports the largest change of the outputs of later
windows (logits, and the probabilities ``RanNetForLM`` returns), next to the
same measurement for the bidirectional model; it also reports how much the
first window's own outputs change (to show the change reaches the model) and
how much a change of the last token moves any earlier causal output. Run it with the
TensorFlow environment described in ``make_rannet_fixtures.py``::

    /work/tfenv/bin/python scripts/rannet_tf/measure_rannet_causal_influence.py
"""

import os


os.environ.setdefault("TF_KERAS", "1")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
from langml import keras  # noqa: E402

# Shared with the fixture generator (same folder, so importable when run as a script).
from make_rannet_fixtures import COMMON_CONFIG, model_checkpoint_names, random_weights, write_checkpoint  # noqa: E402
from rannet import RanNet, RanNetForLM, RanNetParams  # noqa: E402


def build_models(config: dict, checkpoint: str) -> dict[str, keras.Model]:
    """Build the causal and bidirectional models and load the same weights into each."""
    params = RanNetParams(config)
    builders = {
        # Exactly what rannet ships for language modelling (softmax output).
        "causal_probs": lambda: RanNetForLM(params),
        # RanNetForLM without the final softmax, to read logits.
        "causal_logits": lambda: RanNet(
            params, return_cell=False, apply_cell_transform=False, mlm_softmax=False, apply_lm_mask=True
        ),
        # The bidirectional encoder with the MLM head, as a contrast.
        "bidirectional_logits": lambda: RanNet(
            params, return_cell=False, apply_cell_transform=False, mlm_softmax=False
        ),
    }
    models = {}
    for name, build in builders.items():
        rannet = build()
        model = rannet() if isinstance(rannet, RanNetForLM) else rannet(with_mlm=True)
        models[name] = rannet.restore_weights_from_checkpoint(model, checkpoint, ran_layers=config["ran_layers"])
    return models


def measure(config: dict, seed: int, num_windows: int, trials: int) -> dict[str, float]:
    """Return the largest output changes over ``trials`` random inputs."""
    keras.backend.clear_session()
    probe = RanNet(RanNetParams(config), apply_cell_transform=False, mlm_softmax=False)(with_mlm=True)
    shapes = {name: var.shape for name, var in model_checkpoint_names(probe, config["ran_layers"]).items()}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = os.path.join(tmp, "model.ckpt")
        values = random_weights(shapes, seed)
        write_checkpoint(values, checkpoint)
        models = build_models(config, checkpoint)
    # rannet's loader skips MLM layers it cannot load without failing; make
    # sure every model really carries the random weights.
    for model in models.values():
        for name, var in model_checkpoint_names(model, config["ran_layers"]).items():
            np.testing.assert_array_equal(var.numpy(), values[name], err_msg=name)

    window = config["window_size"]
    length = num_windows * window  # whole windows, so no merge is involved
    rng = np.random.default_rng(seed + 1)
    results: dict[str, float] = {}

    def record(key: str, value: float) -> None:
        results[key] = max(results.get(key, 0.0), value)

    def run(name: str, ids: np.ndarray) -> np.ndarray:
        return models[name](ids[None, :].astype(np.float32), training=False).numpy()[0]

    for _ in range(trials):
        base = rng.integers(1, config["vocab_size"], size=length)
        first_changed = base.copy()
        # Shift every first-window token to another non-pad id.
        first_changed[:window] = (base[:window] + rng.integers(1, config["vocab_size"] - 1, size=window) - 1) % (
            config["vocab_size"] - 1
        ) + 1
        assert np.all(first_changed[:window] != base[:window])
        last_changed = base.copy()
        last_changed[-1] = base[-1] % (config["vocab_size"] - 1) + 1

        for name in models:
            a, b = run(name, base), run(name, first_changed)
            # Non-zero here shows the change does reach the model.
            record(f"{name}: first window -> first window", float(np.max(np.abs(a[:window] - b[:window]))))
            record(f"{name}: first window -> last window", float(np.max(np.abs(a[-window:] - b[-window:]))))
            record(f"{name}: first window -> all later windows", float(np.max(np.abs(a[window:] - b[window:]))))
            if name.startswith("causal"):
                c = run(name, last_changed)
                record(f"{name}: last token -> earlier positions", float(np.max(np.abs(a[:-1] - c[:-1]))))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3], help="ran_layers values to test")
    parser.add_argument("--window_size", type=int, default=6)
    parser.add_argument("--min_window_size", type=int, default=2)
    parser.add_argument("--num_windows", type=int, default=4, help="input length in whole windows")
    parser.add_argument("--trials", type=int, default=5, help="random inputs per model")
    parser.add_argument("--seed", type=int, default=2024)
    args = parser.parse_args()

    for layers in args.layers:
        config = dict(
            COMMON_CONFIG,
            vocab_size=64,
            embedding_size=16,
            ran_layers=layers,
            head_num=2,
            head_size=8,
            window_size=args.window_size,
            min_window_size=args.min_window_size,
            cell_pooling="last",
        )
        results = measure(config, args.seed + layers, args.num_windows, args.trials)
        print(f"ran_layers={layers} window_size={args.window_size} length={args.num_windows * args.window_size}")
        for key, value in results.items():
            print(f"  {key:<55} max |diff| = {value:.3e}")


if __name__ == "__main__":
    main()
