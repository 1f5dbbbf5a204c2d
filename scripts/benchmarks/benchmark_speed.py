#!/usr/bin/env python
"""Tokens per second and peak memory, inference and training, for RAN and the long-document encoders users pick.

    python scripts/benchmarks/benchmark_speed.py                  # CPU, lengths 512 2K 8K 32K, < 15 minutes here
    python scripts/benchmarks/benchmark_speed.py --device cuda --dtype bfloat16
    python scripts/benchmarks/benchmark_speed.py --models ran ceiling longformer --lengths 8192 --repeats 3

Models, all at the same width, depth and heads, random weights, dropout off:
  ran            ran_hf RAN, window `--window_size` (default 256)
  ran-fused      the same RAN with the fused cell scan (`scan_implementation="fused"`); not in the default list
  ran-triton     the same RAN with the Triton cell scan (`scan_implementation="triton"`; CUDA); not in the default list
  ran-small      ran_hf RAN, window `--small_window_size` (default 64)
  ran-causal     the default causal RAN (`is_causal=True`: its associative memory and key convolution included),
                 window `--window_size`; not in the default list
  ran-compiled   `torch.compile(RAN)`, compiled during the (untimed) warm-up at the measured shape; not in the
                 default list, as compiling takes minutes on a small CPU
  ceiling        RAN's per-token work without the recurrence: the same projections, GLUs, norms and memory review,
                 every window reading the starting cell, so the cell work of all windows runs in one batch and
                 no scan remains. The best a RAN layer could do.
  longformer     Transformers' Longformer, sliding window `--window_size`
  bigbird        Transformers' BigBird, block-sparse attention (block 64, 3 random blocks)
  modernbert     Transformers' ModernBERT, local window `--window_size`, a global layer every third (layer 0)
  bert           Transformers' BERT, full attention, up to `--bert_max_length`
  rannet         the official TensorFlow rannet 0.3.1, when `--rannet_python` points at an interpreter that has it

Each (model, length) runs in a fresh process: a warm-up pass, then inference (no grad) and training (forward and
backward of the mean token state), each the fastest of at least `--repeats` calls and `--min_seconds` of timing.
Peak memory: growth of resident memory on CPU, the allocator's peak on CUDA. Writes JSON, a markdown table and
log-log plots under --output_dir.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from benchmark_utils import (
    POSITIVE,
    POSITIVE_FLOAT,
    PeakMemory,
    command_line,
    machine_info,
    machine_line,
    result_record,
    run_in_subprocess,
    sized_ran_config,
)

from ran_hf.cell_scan import RANScanInterface


MODELS = ["ran", "ran-small", "ceiling", "longformer", "bigbird", "modernbert", "bert", "rannet"]
OPTIONAL_MODELS = ["ran-causal", "ran-fused", "ran-triton", "ran-compiled"]
VOCAB_SIZE = 1000


def ran_config(args, window_size, **fields):
    return sized_ran_config(args, window_size, VOCAB_SIZE, **fields)


def scan_without_recurrence(cell_scan, weights, cell, previous_raw, keys, values, layout):
    """A cell scan where every window reads the starting cell: one batched step, no loop.

    The per-window work is the scan's (cell projections, attention over the window, output projection, norms, the
    residual GLU against the previous window's raw cell), so what remains between RAN and this is the recurrence.
    """
    scale = 1.0 / math.sqrt(cell_scan.head_dim)
    normed = weights.input_norm(cell[layout.window_sequence], cell_scan.dropout)  # (K, D)
    query, key, value = cell_scan.project(weights.qkv_proj, normed).unbind(-3)  # (K, H, d)
    token_scores = torch.einsum("khd,khsd->khs", query, keys).masked_fill(~layout.slot_mask[:, None], float("-inf"))
    cell_score = (query * key).sum(-1, keepdim=True)
    probs = torch.softmax(torch.cat([cell_score, token_scores], -1) * scale, dim=-1)  # (K, H, 1 + S)
    attended = probs[..., :1] * value + torch.einsum("khs,khsd->khd", probs[..., 1:], values)
    raw = cell_scan.write_cell(weights, attended.flatten(-2), normed)  # (K, D)
    previous = torch.cat([raw[:1], raw[:-1]])  # the window before (ignored across sequences: timing only)
    cells = cell_scan.cell_norm(raw + cell_scan.cell_glu(previous))

    def step_major(per_window):  # (K, ...) -> (N, B, ...)
        return torch.cat([per_window, per_window[:1] * 0])[layout.step_windows]

    return step_major(key), step_major(value), step_major(raw), step_major(cells)


WITHOUT_RECURRENCE = "without-recurrence"
RANScanInterface.register(WITHOUT_RECURRENCE, scan_without_recurrence)


def build_model(name: str, args, max_length: int) -> torch.nn.Module:
    import transformers

    width, layers, heads = args.hidden_size, args.num_layers, args.num_heads
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": 4 * width,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    if name in ("ran", "ran-fused", "ran-triton", "ran-small", "ceiling", "ran-compiled", "ran-causal"):
        from ran_hf import RANModel

        window = args.small_window_size if name == "ran-small" else args.window_size
        fields = {"scan_implementation": WITHOUT_RECURRENCE} if name == "ceiling" else {}
        if name in ("ran-fused", "ran-triton"):
            fields = {"scan_implementation": name.removeprefix("ran-")}
        if name == "ran-causal":
            fields = {"is_causal": True}
        return RANModel(ran_config(args, window, **fields))
    if name == "longformer":
        config = transformers.LongformerConfig(
            **common, attention_window=args.window_size, max_position_embeddings=max_length + args.window_size + 2
        )
        return transformers.LongformerModel(config, add_pooling_layer=False)
    if name == "bigbird":
        config = transformers.BigBirdConfig(
            **common,
            attention_type="block_sparse",
            block_size=64,
            num_random_blocks=3,
            max_position_embeddings=max_length + 64,
        )
        return transformers.BigBirdModel(config, add_pooling_layer=False)
    if name == "modernbert":
        config = transformers.ModernBertConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=2 * width,  # its GLU doubles the inner width: 4 * width parameters as the others
            local_attention=args.window_size,
            max_position_embeddings=max_length,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        )
        return transformers.ModernBertModel(config)
    if name == "bert":
        config = transformers.BertConfig(**common, max_position_embeddings=max_length)
        return transformers.BertModel(config, add_pooling_layer=False)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def measure(name: str, length: int, batch_size: int, args) -> dict:
    """Throughput and peak memory of one model at one shape, in this (fresh) process."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = build_model(name, args, max_length=length).to(device=device, dtype=dtype).train()
    ids = torch.randint(3, VOCAB_SIZE, (batch_size, length), device=device)
    warmup_ids = ids[:, : min(length, 512)]
    if name == "ran-compiled":
        model, warmup_ids = torch.compile(model), ids  # compile for the measured shape, outside the timing

    def forward():
        return model(input_ids=ids).last_hidden_state

    def train_step():
        forward().float().mean().backward()
        model.zero_grad(set_to_none=True)

    def timed(function):
        """Seconds of the fastest call among at least `--repeats` calls and `--min_seconds` of timing.

        The fastest call, as `timeit` reports: the first call at a new shape also pays for fresh memory pages, and
        other work on a shared machine only ever slows a call down.
        """
        durations, start = [], time.perf_counter()
        while len(durations) < args.repeats or time.perf_counter() - start < args.min_seconds:
            call_start = time.perf_counter()
            function()
            if device.type == "cuda":
                torch.cuda.synchronize()
            durations.append(time.perf_counter() - call_start)
        return min(durations)

    # Warm-up (allocator pools, lazy initialisation, compilation): a training step at the measured shape when it is
    # short, at 512 tokens otherwise.
    if length * batch_size <= 4096:
        warmup_ids = ids
    model(input_ids=warmup_ids).last_hidden_state.float().mean().backward()
    model.zero_grad(set_to_none=True)
    memory = PeakMemory(device)
    memory.reset()
    with torch.no_grad():
        inference_seconds = timed(forward)
    inference_peak = memory.peak_bytes()
    training_seconds = timed(train_step)
    training_peak = memory.peak_bytes()
    tokens = batch_size * length
    return {
        "model": name,
        "length": length,
        "batch_size": batch_size,
        "inference_tokens_per_s": tokens / inference_seconds,
        "training_tokens_per_s": tokens / training_seconds,
        "inference_peak_bytes": inference_peak,
        "training_peak_bytes": training_peak,
    }


def shapes(args) -> list:
    return [(length, 1) for length in args.lengths] + [(args.short_length, args.short_batch_size)]


def run_rannet(args, length: int, batch_size: int) -> dict:
    """The official TensorFlow model, measured by `../rannet_tf/benchmark_rannet_tf.py` under `--rannet_python`."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "rannet_tf" / "benchmark_rannet_tf.py"
    command = [
        args.rannet_python, str(script), "--length", str(length), "--batch_size", str(batch_size),
        "--hidden_size", str(args.hidden_size), "--num_layers", str(args.num_layers), "--num_heads",
        str(args.num_heads), "--window_size", str(args.window_size), "--repeats", str(args.repeats),
        "--min_seconds", str(args.min_seconds),
    ] + (["--threads", str(args.threads)] if args.threads else [])  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if completed.returncode != 0:
        return {"error": (completed.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(completed.stdout.strip().splitlines()[-1])


def markdown_table(results: list, info: dict, command: str) -> str:
    rows = [
        "| model | batch x length | train tok/s | train vs RAN | infer tok/s | infer vs RAN | train peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    reference = {(r["length"], r["batch_size"]): r for r in results if r["model"] == "ran" and "error" not in r}
    for r in results:
        shape = f"{r['batch_size']} x {r['length']}"
        if "error" in r:
            rows.append(f"| {r['model']} | {shape} | – | – | – | – | {r['error'][:60]} |")
            continue
        ran = reference.get((r["length"], r["batch_size"]))
        train_ratio = f"{r['training_tokens_per_s'] / ran['training_tokens_per_s']:.2f}" if ran else "–"
        infer_ratio = f"{r['inference_tokens_per_s'] / ran['inference_tokens_per_s']:.2f}" if ran else "–"
        rows.append(
            f"| {r['model']} | {shape} | {r['training_tokens_per_s']:,.0f} | {train_ratio} | "
            f"{r['inference_tokens_per_s']:,.0f} | {infer_ratio} | {r['training_peak_bytes'] / 2**20:,.0f} |"
        )
    header = (
        f"Machine: {machine_line(info)}\n\nCommand: `{command}`\n\nRatios are model / RAN (> 1: faster than RAN).\n"
    )
    return header + "\n" + "\n".join(rows) + "\n"


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("training_tokens_per_s", "training tokens / s"),
        ("inference_tokens_per_s", "inference tokens / s"),
        ("training_peak_bytes", "training peak MiB"),
    ]
    for axis, (key, label) in zip(axes, panels):
        for model in dict.fromkeys(r["model"] for r in results):
            points = sorted(
                (r["length"], r[key] / (2**20 if "bytes" in key else 1))
                for r in results
                if r["model"] == model and r["batch_size"] == 1 and "error" not in r
            )
            if points:
                axis.loglog(*zip(*points), "o-" if model.startswith("ran") else "s--", label=model)
        axis.set(xlabel="tokens (batch 1)", ylabel=label)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS + OPTIONAL_MODELS)
    parser.add_argument("--lengths", type=POSITIVE, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--short_length", type=POSITIVE, default=512, help="the batched short-document point")
    parser.add_argument("--short_batch_size", type=POSITIVE, default=8)
    parser.add_argument("--hidden_size", type=POSITIVE, default=128)
    parser.add_argument("--num_layers", type=POSITIVE, default=2)
    parser.add_argument("--num_heads", type=POSITIVE, default=4)
    parser.add_argument("--window_size", type=POSITIVE, default=256)
    parser.add_argument("--small_window_size", type=POSITIVE, default=64)
    parser.add_argument("--bert_max_length", type=POSITIVE, default=8192, help="full attention beyond this is skipped")
    parser.add_argument("--repeats", type=POSITIVE, default=2, help="fewest timed calls per measurement")
    parser.add_argument("--min_seconds", type=POSITIVE_FLOAT, default=2.0, help="shortest timing per measurement")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rannet_python", default=os.environ.get("RANNET_PYTHON"), help="python with rannet")
    parser.add_argument("--timeout", type=POSITIVE_FLOAT, default=600, help="seconds one measurement may take")
    parser.add_argument(
        "--max_point_seconds", type=POSITIVE_FLOAT, default=60, help="skip shapes slower than this per step"
    )
    parser.add_argument("--threads", type=POSITIVE, help="torch threads (default: torch's choice, all cores)")
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks/speed"))
    parser.add_argument("--single", nargs=3, metavar=("MODEL", "LENGTH", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.single:
        name, length, batch_size = args.single
        print(json.dumps(measure(name, int(length), int(batch_size), args)))
        return

    info = machine_info(args.device)
    print(machine_line(info))
    forwarded = [
        "--hidden_size", str(args.hidden_size), "--num_layers", str(args.num_layers), "--num_heads",
        str(args.num_heads), "--window_size", str(args.window_size), "--small_window_size",
        str(args.small_window_size), "--repeats", str(args.repeats), "--min_seconds", str(args.min_seconds),
        "--device", args.device, "--dtype", args.dtype,
    ] + (["--threads", str(args.threads)] if args.threads else [])  # fmt: skip
    results, slowest = [], {}
    print(f"{'model':<11} {'shape':>10} {'train tok/s':>12} {'infer tok/s':>12} {'train MiB':>10}")
    for length, batch_size in shapes(args):
        for name in args.models:
            if name == "bert" and length > args.bert_max_length:
                continue
            # A model that would need longer than --max_point_seconds here (judged, optimistically, from its last
            # throughput) is reported as too slow instead of stalling the run.
            estimate = batch_size * length / slowest[name] if name in slowest else 0.0
            if estimate > args.max_point_seconds:
                result = {"error": f"skipped: one training step would take ~{estimate:.0f}s or more"}
            elif name == "rannet":
                if not args.rannet_python:
                    continue
                try:
                    result = run_rannet(args, length, batch_size)
                except Exception as error:  # a timeout: report it in the table, keep going
                    result = {"error": f"{type(error).__name__}"}
            else:
                try:
                    result = run_in_subprocess(
                        __file__, ["--single", name, str(length), str(batch_size), *forwarded], timeout=args.timeout
                    )
                except Exception as error:  # a timeout: report it in the table, keep going
                    result = {"error": f"{type(error).__name__}"}
            result.update(model=name, length=length, batch_size=batch_size)
            results.append(result)
            if "training_tokens_per_s" in result:
                slowest[name] = result["training_tokens_per_s"]
            shape = f"{batch_size}x{length}"
            if "error" in result:
                print(f"{name:<11} {shape:>10}  {result['error']}", flush=True)
            else:
                print(
                    f"{name:<11} {shape:>10} {result['training_tokens_per_s']:>12,.0f} "
                    f"{result['inference_tokens_per_s']:>12,.0f} {result['training_peak_bytes'] / 2**20:>10,.0f}",
                    flush=True,
                )

    print_ratios(results)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = f"speed_{torch.device(args.device).type}"
    command = command_line(__file__)
    device = torch.device(args.device).type
    report = result_record(command, vars(args), results, device=device, dtype=args.dtype, info=info)
    (args.output_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    (args.output_dir / f"{name}.md").write_text(markdown_table(results, info, command))
    plot(results, args.output_dir / f"{name}.png")
    print(f"wrote {args.output_dir / name}.json, .md and .png")


def print_ratios(results: list) -> None:
    """The figures the targets are stated in, side by side."""
    by_key = {(r["model"], r["length"], r["batch_size"]): r for r in results if "error" not in r}
    print("\ntraining throughput relative to RAN (> 1: faster than RAN)")
    for (model, length, batch_size), result in sorted(by_key.items(), key=lambda item: (item[0][1], item[0][0])):
        ran = by_key.get(("ran", length, batch_size))
        if ran and model != "ran":
            ratio = result["training_tokens_per_s"] / ran["training_tokens_per_s"]
            print(f"  {model:<11} {batch_size}x{length:<6} {ratio:6.2f}")
    ran_8k, ran_32k = by_key.get(("ran", 8192, 1)), by_key.get(("ran", 32768, 1))
    if ran_8k and ran_32k:
        print(
            f"RAN training peak memory 32K / 8K: {ran_32k['training_peak_bytes'] / ran_8k['training_peak_bytes']:.2f}"
        )


if __name__ == "__main__":
    main()
