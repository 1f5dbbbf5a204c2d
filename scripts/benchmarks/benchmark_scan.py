#!/usr/bin/env python
"""Cost of the cell scan alone, per window and layer: the reference loop against the fused scan.

    python scripts/benchmarks/benchmark_scan.py                      # CPU, one thread, about two minutes
    python scripts/benchmarks/benchmark_scan.py --scans reference fused --repeats 21 --threads 1
    python scripts/benchmarks/benchmark_scan.py --dropout 0.1      # training with dropout: scan_<device>_dropout.*

One RAN layer with random weights (dropout off unless `--dropout` sets both rates) and random window keys and values;
each measurement times the scan function that `config.scan_implementation` names (`ALL_SCAN_FUNCTIONS`), nothing else
of the layer:
  train   forward and backward (a fixed random probe of all four outputs), per scan step
  infer   forward under `torch.no_grad()`, per scan step
Every figure is the median of `--repeats` timed calls after a warm-up call. A scan step is one window of every
sequence in the batch, so at batch 1 it is the cost of one window in one layer. `ops/step` counts the aten ops of
one forward and backward (`torch.profiler`, those not called from inside another aten op) per scan step. Writes
`benchmarks/scan/scan_<device>.json` and `.md`.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from benchmark_utils import FRACTION, NON_NEGATIVE, POSITIVE, command_line, machine_info, machine_line, result_record
from torch.profiler import ProfilerActivity, profile

from ran_hf import RANConfig
from ran_hf.cell_scan import ALL_SCAN_FUNCTIONS
from ran_hf.ran_layer import RANLayer
from ran_hf.window_layout import RANWindowLayout


# (name, hidden size, heads, window, lengths of the sequences in the batch)
CASES = [
    ("hidden 64, window 16, batch 1", 64, 4, 16, [16 * 64]),
    ("hidden 64, window 16, batch 8", 64, 4, 16, [16 * n for n in (64, 60, 56, 50, 43, 37, 30, 24)]),
    ("hidden 768, window 256, batch 1", 768, 12, 256, [256 * 8]),
]


def scan_inputs(hidden_size: int, num_heads: int, window: int, lengths: list, device: torch.device, dropout=0.0):
    """A layer and what its scan reads: the starting cell, the previous raw cell, window keys and values, layout."""
    torch.manual_seed(0)
    config = RANConfig(
        vocab_size=100,
        hidden_size=hidden_size,
        num_hidden_layers=1,
        num_attention_heads=num_heads,
        head_dim=hidden_size // num_heads,
        window_size=window,
        min_window_size=min(16, window // 4),
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    layer = RANLayer(config, layer_idx=0).to(device).train()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
    layout = RANWindowLayout.from_attention_mask(mask, config)
    num_windows, num_slots = layout.window_slots.shape
    slot_shape = (num_windows, num_heads, num_slots, config.head_dim)
    keys = torch.randn(slot_shape, device=device, requires_grad=True)
    values = torch.randn(slot_shape, device=device, requires_grad=True)
    cell = torch.randn(len(lengths), hidden_size, device=device, requires_grad=True)
    previous_raw = torch.zeros(len(lengths), hidden_size, device=device)
    return layer, (cell, previous_raw, keys, values, layout)


def train_step(scan, layer, inputs, probes):
    outputs = scan(layer, *inputs)
    sum((output * probe).sum() for output, probe in zip(outputs, probes)).backward()


def median_seconds(function, repeats: int, device: torch.device) -> float:
    function()  # warm-up
    durations = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize()
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)


def count_ops(function) -> int:
    """Aten ops that one call dispatches, those called by another aten op not counted again."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        function()
    return sum(
        1
        for event in profiler.events()
        if event.name.startswith("aten::")
        and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::"))
    )


def measure(case, scan_name: str, args, device: torch.device) -> dict:
    name, hidden_size, num_heads, window, lengths = case
    layer, inputs = scan_inputs(hidden_size, num_heads, window, lengths, device, args.dropout)
    layer.config.scan_implementation = scan_name
    implementation = ALL_SCAN_FUNCTIONS[scan_name]

    def scan(layer, *scan_inputs):  # the implementation itself, on the layer's scan module and weights
        return implementation(layer.cell_scan, layer.cell_scan_weights(), *scan_inputs)

    layout = inputs[-1]
    with torch.no_grad():
        shapes = [output.shape for output in scan(layer, *inputs)]
    generator = torch.Generator().manual_seed(1)
    probes = [torch.randn(shape, generator=generator).to(device) for shape in shapes]

    def train():
        train_step(scan, layer, inputs, probes)
        layer.zero_grad(set_to_none=True)
        for tensor in inputs[:4]:
            tensor.grad = None

    def infer():
        layer.eval()  # inference drops nothing
        with torch.no_grad():
            scan(layer, *inputs)
        layer.train()

    steps = layout.num_steps
    return {
        "case": name,
        "scan": scan_name,
        "hidden_size": hidden_size,
        "window_size": window,
        "batch_size": len(lengths),
        "steps": steps,
        "train_ms_per_step": median_seconds(train, args.repeats, device) / steps * 1e3,
        "infer_ms_per_step": median_seconds(infer, args.repeats, device) / steps * 1e3,
        "ops_per_step": count_ops(train) / steps,
    }


def markdown_table(results: list, info: dict, command: str) -> str:
    rows = [
        "| case | scan | steps | train ms/step | train vs reference | infer ms/step | ops/step (train) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    reference = {r["case"]: r for r in results if r["scan"] == "reference"}
    for r in results:
        base = reference.get(r["case"])
        speedup = f"{base['train_ms_per_step'] / r['train_ms_per_step']:.2f}x" if base else "–"
        rows.append(
            f"| {r['case']} | {r['scan']} | {r['steps']} | {r['train_ms_per_step']:.3f} | {speedup} | "
            f"{r['infer_ms_per_step']:.3f} | {r['ops_per_step']:.0f} |"
        )
    header = (
        f"Machine: {machine_line(info)}\n\nCommand: `{command}`\n\n"
        "Cost of the cell scan alone, per scan step (one window of every sequence) and layer: median of the timed "
        "calls. `train` is forward and backward, `infer` forward under `no_grad`; `ops/step` counts the aten ops "
        "of one forward and backward (`torch.profiler`).\n"
    )
    return header + "\n" + "\n".join(rows) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scans", nargs="+", default=["reference", "fused"], help="registered scan names")
    parser.add_argument("--cases", nargs="+", type=NON_NEGATIVE, help=f"indices into the cases (default all): {CASES}")
    parser.add_argument("--repeats", type=POSITIVE, default=15, help="timed calls per figure (the median is kept)")
    parser.add_argument("--threads", type=POSITIVE, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dropout", type=FRACTION, default=0.0, help="hidden and attention dropout rate (training)")
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks/scan"))
    args = parser.parse_args()
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = machine_info(args.device)
    print(machine_line(info))
    cases = [CASES[index] for index in args.cases] if args.cases else CASES
    results = []
    print(f"{'case':<32} {'scan':<10} {'steps':>5} {'train ms/step':>14} {'infer ms/step':>14} {'ops/step':>9}")
    for case in cases:
        for scan_name in args.scans:
            result = measure(case, scan_name, args, device)
            results.append(result)
            print(
                f"{result['case']:<32} {scan_name:<10} {result['steps']:>5} {result['train_ms_per_step']:>14.3f} "
                f"{result['infer_ms_per_step']:>14.3f} {result['ops_per_step']:>9.0f}",
                flush=True,
            )

    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = f"scan_{device.type}" + ("_dropout" if args.dropout else "")
    command = command_line(__file__)
    report = result_record(command, vars(args), results, device=device.type, dtype="float32", info=info)
    (args.output_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    (args.output_dir / f"{name}.md").write_text(markdown_table(results, info, command))
    print(f"wrote {args.output_dir / name}.json and .md")


if __name__ == "__main__":
    main()
