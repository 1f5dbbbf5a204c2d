#!/usr/bin/env python
"""Where a RAN training step spends its GPU time: CUDA kernels by total time, launches, step time.

    python scripts/benchmarks/profile_step.py --device cuda --models ran-fused ran-triton transformer --shape 8x8192

One masked-LM training step (bf16 autocast, forward with labels, backward) of a `RANForMaskedLM` with random
weights, BERT-base shape by default, profiled with `torch.profiler` after two warm-up steps. Models: `ran-SCAN`
(any `scan_implementation`), `ran-SCAN+pytorch-token-ops` (the normalisations, gated linear units and rotary
embedding as PyTorch ops, not Triton kernels), and `transformer`, the same-size windowed transformer of
benchmark_kernels.py (block attention, no dropout). Prints, per
model, the step's wall time (between synchronisations, the median of `--repeats` steps), the number of CUDA kernels
launched, and the kernels that take the most time. Writes `profile_<model>_<shape>.txt` tables and one JSON.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmark_utils import (
    POSITIVE,
    TRAINING_DROPOUT,
    command_line,
    machine_info,
    machine_line,
    result_record,
    sized_ran_config,
)

from benchmark_kernels import BlockAttentionMLM
from ran_hf import RANForMaskedLM, kernels


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
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks/cuda"))
    args = parser.parse_args()
    batch, length = (int(part) for part in args.shape.split("x"))
    device = torch.device(args.device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # CPU: a smoke test
    info = machine_info(args.device)
    print(machine_line(info))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.models:
        scan, _, options = name.removeprefix("ran-").partition("+")
        for op in ("norm", "glu", "rotary"):
            kernels.TRITON[op] = options != "pytorch-token-ops"
        if name == "transformer":
            model = BlockAttentionMLM(args.vocab_size, args.hidden_size, args.num_layers, args.num_heads,
                                      args.window_size)  # fmt: skip
        else:
            config = sized_ran_config(args, min_window_size=16, scan_implementation=scan, **TRAINING_DROPOUT)
            model = RANForMaskedLM(config)
        model = model.to(device).train()
        ids = torch.randint(1, args.vocab_size, (batch, length), device=device)

        def loss_of_step():
            if name == "transformer":
                return model(ids, ids)
            return model(input_ids=ids, labels=ids).loss

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_of_step()
            loss.backward()
            model.zero_grad(set_to_none=True)

        for _ in range(2):
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
        (args.output_dir / f"profile_{name.replace('+', '-')}_{args.shape}.txt").write_text(table)
        seconds = statistics.median(times)
        tokens_per_second = batch * length / seconds
        peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        results.append({
            "model": name, "shape": args.shape, "step_seconds": seconds, "tokens_per_second": tokens_per_second,
            "cuda_kernels": launches, "peak_gib": peak_gib,
        })  # fmt: skip
        print(f"{name}: step {seconds * 1000:.0f} ms, {tokens_per_second:,.0f} tok/s, {launches:,} CUDA kernels")
        print(table)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    dtype = "bfloat16 autocast"
    report = result_record(command_line(__file__), vars(args), results, device=device.type, dtype=dtype, info=info)
    (args.output_dir / f"profile_{args.shape}.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
