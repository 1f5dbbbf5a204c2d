#!/usr/bin/env python
"""Throughput and peak memory of the official TensorFlow RAN (rannet 0.3.1) at one shape.

Run with an interpreter that has `tensorflow`, `tf-keras`, `langml` and `rannet` installed (the TensorFlow
environment of `scripts/README.md`); `scripts/benchmarks/benchmark_speed.py` calls it through `--rannet_python`.
Prints one JSON line with the same fields as the PyTorch measurements.
"""

import os


# rannet needs the Keras 2 API bundled with TensorFlow; set before importing it.
os.environ.setdefault("TF_KERAS", "1")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from rannet import RanNet, RanNetParams  # noqa: E402


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--window_size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--min_seconds", type=float, default=2.0)
    parser.add_argument("--threads", type=int, help="TensorFlow intra-op threads (default: its choice)")
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)

    params = RanNetParams(
        {
            "vocab_size": 1000,
            "embedding_size": args.hidden_size,
            "dropout_rate": 0.0,
            "ran_layers": args.num_layers,
            "head_size": args.hidden_size // args.num_heads,
            "head_num": args.num_heads,
            "window_size": args.window_size,
            "min_window_size": min(16, args.window_size // 4),
        }
    )
    model = RanNet(params, apply_cell_transform=False)(with_mlm=False)
    rng = np.random.default_rng(0)
    ids = tf.constant(rng.integers(3, 1000, (args.batch_size, args.length)), dtype=tf.float32)

    def forward(inputs):
        return model(inputs, training=False)[0]

    def train_step(inputs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(inputs, training=True)[0])
        return tape.gradient(loss, model.trainable_variables)

    def timed(function):
        """Seconds of the fastest call among at least `--repeats` calls and `--min_seconds` of timing."""
        durations, start = [], time.perf_counter()
        while len(durations) < args.repeats or time.perf_counter() - start < args.min_seconds:
            call_start = time.perf_counter()
            function(ids)
            durations.append(time.perf_counter() - call_start)
        return min(durations)

    warmup = ids if args.length * args.batch_size <= 4096 else ids[:, :512]
    forward(warmup)  # warm-up: graph tracing, allocator
    train_step(warmup)
    baseline = resident_bytes()
    inference_seconds = timed(forward)
    inference_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    training_seconds = timed(train_step)
    training_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    tokens = args.batch_size * args.length
    print(
        json.dumps(
            {
                "inference_tokens_per_s": tokens / inference_seconds,
                "training_tokens_per_s": tokens / training_seconds,
                "inference_peak_bytes": max(0, inference_peak),
                "training_peak_bytes": max(0, training_peak),
            }
        )
    )


if __name__ == "__main__":
    main()
