#!/usr/bin/env python
"""Where a RAN training step spends its GPU time: CUDA kernels by total time, launches, step time.

    python scripts/benchmarks/profile_step.py --device cuda --models ran-fused ran-triton transformer --shape 8x8192

One masked-LM training step (bf16 autocast, forward with labels, backward) of a `RANForMaskedLM` with random
weights, BERT-base shape by default, profiled with `torch.profiler` after two warm-up steps. Models: `ran-SCAN`
(any `scan_implementation`), `ran-SCAN+pytorch-token-ops` (the normalisations, gated linear units and rotary
embedding and the window projection as PyTorch ops, not Triton kernels), `transformer`, the same-size windowed
transformer of benchmark_kernels.py (block attention, no dropout), and `modernbert` and `longformer`: Transformers'
`ModernBertForMaskedLM` (sdpa, local window `--modernbert_window`, 128 as in ModernBERT-base, a global layer every
third) and `LongformerForMaskedLM` (its own sliding-window attention, `--longformer_window`, 512 as in
Longformer-base), built from config as benchmark_speed.py builds them, at the run's width, depth and heads. Prints,
per model, the step's wall time (between synchronisations, the median of `--repeats` steps), the number of CUDA
kernels launched, the peak memory (`torch.cuda.max_memory_allocated`, reset before each model; on CUDA only) and
the kernels that take the most time. Writes `profile_<model>_<shape>.txt` tables and one JSON,
`profile_<shape>.json`, rewritten after every model (a run stopped by a time limit keeps the models it finished):
per model the step, the kernels, the peak and its ratio to the transformer's, and the top `--top_kernels` kernels by
self CUDA time (on a CPU, a smoke run: operators by self CPU time). A model that runs out of memory is a row with
its error.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from benchmark_kernels import BlockAttentionMLM
from benchmark_utils import (
    POSITIVE,
    TRAINING_DROPOUT,
    command_line,
    machine_info,
    machine_line,
    result_record,
    sized_ran_config,
    write_result,
)
from torch.profiler import ProfilerActivity, profile

from ran_hf import RANForMaskedLM
from ran_hf.kernels import choice as kernel_choice


BASELINES = ("modernbert", "longformer")  # Transformers' classes, built from config as benchmark_speed.py does


def transformers_mlm(name: str, args, length: int) -> torch.nn.Module:
    """ModernBERT or Longformer with a masked-LM head, random weights: benchmark_speed.build_model's configuration
    (on the meta device, for its config only) with this run's vocabulary and the model's own attention window."""
    import transformers
    from benchmark_speed import build_model

    window = args.modernbert_window if name == "modernbert" else args.longformer_window
    sizes = argparse.Namespace(hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
                               window_size=window, small_window_size=window)  # fmt: skip
    with torch.device("meta"):
        config = build_model(name, sizes, max_length=length).config
    config.vocab_size = args.vocab_size
    attention = {"attn_implementation": "sdpa"} if name == "modernbert" else {}  # Longformer has its own attention
    return transformers.AutoModelForMaskedLM.from_config(config, **attention)


def top_kernels(profiler, device: torch.device, count: int) -> list:
    """The `count` kernels (CUDA) or operators (CPU) that took the most self time in the profiled step."""
    events = list(profiler.key_averages())
    if device.type == "cuda":
        events = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
    field = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"  # microseconds
    events.sort(key=lambda event: getattr(event, field), reverse=True)
    return [{"name": e.key, "calls": e.count, "self_ms": getattr(e, field) / 1000} for e in events[:count]]


def with_memory_ratios(results: list) -> list:
    """Each model's peak memory over the transformer's (where both were measured), and whether it is <= 1.1x."""
    base = next((r.get("peak_bytes") for r in results if r["model"] == "transformer"), None)
    for row in results:
        if base and row.get("peak_bytes") is not None:
            row["peak_vs_transformer"] = row["peak_bytes"] / base
            row["peak_within_1.1x_transformer"] = row["peak_bytes"] <= 1.1 * base
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["ran-fused", "ran-triton", "transformer"])
    parser.add_argument("--shape", default="8x8192", help="BATCHxLENGTH")
    parser.add_argument("--hidden_size", type=POSITIVE, default=768)
    parser.add_argument("--num_layers", type=POSITIVE, default=12)
    parser.add_argument("--num_heads", type=POSITIVE, default=12)
    parser.add_argument("--window_size", type=POSITIVE, default=256)
    parser.add_argument("--vocab_size", type=POSITIVE, default=30522)
    parser.add_argument("--repeats", type=POSITIVE, default=3)
    parser.add_argument("--warmups", type=POSITIVE, default=2, help="untimed steps before the timed ones")
    parser.add_argument("--modernbert_window", type=POSITIVE, default=128)
    parser.add_argument("--longformer_window", type=POSITIVE, default=512)
    parser.add_argument("--top_kernels", type=POSITIVE, default=15, help="kernels kept in the JSON")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks/cuda"))
    args = parser.parse_args()
    batch, length = (int(part) for part in args.shape.split("x"))
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    synchronize = torch.cuda.synchronize if on_cuda else (lambda: None)  # CPU: a smoke test
    info = machine_info(args.device)
    print(machine_line(info))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    command, dtype = command_line(__file__), "bfloat16 autocast"
    header = f"{machine_line(info)} | device {device.type} | {dtype}\n{command}\n\n"
    results = []
    for name in args.models:
        scan, _, options = name.removeprefix("ran-").partition("+")
        for op in kernel_choice.TRITON_TOKEN_OPS:
            kernel_choice.TRITON[op] = options != "pytorch-token-ops"
        if on_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            row = profile_model(name, scan, args, batch, length, device, synchronize, header)
        except torch.cuda.OutOfMemoryError as error:  # a row that says so; the next models still run
            row = {"model": name, "shape": args.shape, "error": f"out of memory: {str(error).splitlines()[0]}"}
            print(f"{name}: {row['error']}")
        results.append(row)
        if on_cuda:
            torch.cuda.empty_cache()
        report = result_record(command, vars(args), with_memory_ratios(results), device=device.type, dtype=dtype,
                               info=info)  # fmt: skip
        write_result(args.output_dir / f"profile_{args.shape}.json", json.dumps(report, indent=2, default=str))


def profile_model(name, scan, args, batch, length, device, synchronize, header) -> dict:
    """One model's training step: warm-ups, the median of `--repeats` timed steps, one profiled step."""
    if name == "transformer":
        model = BlockAttentionMLM(args.vocab_size, args.hidden_size, args.num_layers, args.num_heads,
                                  args.window_size)  # fmt: skip
    elif name in BASELINES:
        model = transformers_mlm(name, args, length)
    else:
        config = sized_ran_config(args, min_window_size=16, scan_implementation=scan, **TRAINING_DROPOUT)
        model = RANForMaskedLM(config)
    model = model.to(device).train()
    ids = torch.randint(3, args.vocab_size, (batch, length), device=device)  # 0-2: special tokens (Longformer's pad)

    def loss_of_step():
        if name == "transformer":
            return model(ids, ids)
        return model(input_ids=ids, labels=ids).loss

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of_step()
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(args.warmups):
        step()
    synchronize()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as profiler:
        step()
        synchronize()
    events = [event for event in profiler.key_averages() if event.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(event.count for event in events)
    table = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    (args.output_dir / f"profile_{name.replace('+', '-')}_{args.shape}.txt").write_text(header + table)
    seconds = statistics.median(times)
    tokens_per_second = batch * length / seconds
    peak_bytes = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    row = {
        "model": name, "shape": args.shape, "step_seconds": seconds, "tokens_per_second": tokens_per_second,
        "cuda_kernels": launches, "peak_bytes": peak_bytes,
        "peak_gib": None if peak_bytes is None else peak_bytes / 2**30,
        "parameters": sum(p.numel() for p in model.parameters()),
        "top_kernels_by": "self CUDA time" if device.type == "cuda" else "self CPU time (operators; no GPU)",
        "top_kernels": top_kernels(profiler, device, args.top_kernels),
    }  # fmt: skip
    if name in BASELINES:
        row["attention"] = model.config._attn_implementation
        row["attention_window"] = args.modernbert_window if name == "modernbert" else args.longformer_window
    print(f"{name}: step {seconds * 1000:.0f} ms, {tokens_per_second:,.0f} tok/s, {launches:,} CUDA kernels")
    print(table)
    return row


if __name__ == "__main__":
    main()
