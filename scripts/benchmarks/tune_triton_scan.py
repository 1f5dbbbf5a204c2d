#!/usr/bin/env python
"""Block sizes and launch path of the Triton cell scan, timed on the scan alone (CUDA).

    python scripts/benchmarks/tune_triton_scan.py --output benchmarks/cuda/tune_triton_scan.json

For each variant (BLOCK_K, BLOCK_N, BLOCK_S, warps, and whether each kernel is launched through its
`torch.library.triton_op` or straight from Python), `benchmark_scan.measure` times one RAN layer's scan, forward and
backward and inference, per window, at BERT-base width; the fused scan is the baseline. Prints a table; saves JSON.
"""

import argparse
import json
from pathlib import Path

import torch
from benchmark_scan import measure
from benchmark_utils import FRACTION, POSITIVE, command_line, machine_info, machine_line, result_record

import ran_hf.kernels.triton_ops.scan as triton_scan
import ran_hf.kernels.triton_ops.scan_tiles as tiles


OPS = ["scan_project", "scan_output", "scan_write", "scan_write_grad", "scan_attention_grad", "scan_input_grad"]
CASES = [
    ("hidden 768, window 256, batch 1", 768, 12, 256, [256 * 8]),
    ("hidden 768, window 256, batch 8", 768, 12, 256, [256 * 8] * 8),
]
VARIANTS = [  # BLOCK_K, BLOCK_N, BLOCK_S, warps, through the op
    (32, 64, 32, 4, True),
    (32, 64, 32, 4, False),
    (64, 64, 32, 4, False),
    (128, 64, 32, 4, False),
    (128, 32, 64, 4, False),
    (128, 64, 64, 8, False),
    (256, 32, 64, 8, False),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=POSITIVE, default=5)
    parser.add_argument("--dropout", type=FRACTION, default=0.0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/cuda/tune_triton_scan.json"))
    args = parser.parse_args()
    device = torch.device("cuda")
    info = machine_info("cuda")
    print(machine_line(info))
    through_op = {name: getattr(triton_scan, name) for name in OPS}
    results = []
    for case in CASES:
        results.append({**measure(case, "fused", args, device), "variant": "fused"})
        for block_k, block_n, block_s, warps, via_op in VARIANTS:
            tiles.BLOCK_K, tiles.BLOCK_N, tiles.BLOCK_S, tiles.NUM_WARPS = block_k, block_n, block_s, warps
            for name, op in through_op.items():
                setattr(triton_scan, name, op if via_op else op._init_fn)
            variant = f"K{block_k} N{block_n} S{block_s} w{warps} {'op' if via_op else 'direct'}"
            results.append({**measure(case, "triton", args, device), "variant": variant})
        for r in results[-len(VARIANTS) - 1 :]:
            print(f"{r['case']:<34}{r['variant']:<28}train {r['train_ms_per_step']:7.3f} ms/window   "
                  f"infer {r['infer_ms_per_step']:7.3f} ms/window   ops {r['ops_per_step']:6.1f}")  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = result_record(command_line(__file__), vars(args), results, device="cuda", dtype="float32", info=info)
    args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
