#!/usr/bin/env python
"""Peak memory of a RAN forward + backward pass on one long sequence, at growing lengths.

    python scripts/benchmarks/benchmark_memory.py            # 4K, 8K, 16K, 32K tokens on CPU
    python scripts/benchmarks/benchmark_memory.py --lengths 8192 32768 --device cuda

Every length runs in a fresh process so that one measurement cannot inherit another's peak. On CPU the peak is the
growth of the process's resident memory over its size just before the pass (after a short warm-up); on CUDA it is
`torch.cuda.max_memory_allocated` over the memory held before the pass. Activation bytes (tensors autograd keeps
for the backward pass, each storage counted once) are reported too: they are exact and independent of the
allocator. Writes a table to stdout and JSON + a log-log plot under --output_dir.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmark_utils import PeakMemory, machine_info, machine_line, run_in_subprocess


def measure(length: int, args) -> dict:
    """One forward + backward pass at `length` tokens, in this process."""
    from ran_hf import RANConfig, RANModel

    torch.manual_seed(0)
    config = RANConfig(
        vocab_size=1000,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        head_dim=args.hidden_size // args.num_heads,
        window_size=args.window_size,
        min_window_size=16,
    )
    device = torch.device(args.device)
    model = RANModel(config).to(device).train()

    def step(num_tokens: int, count_saved: bool = False) -> int:
        ids = torch.randint(1, config.vocab_size, (1, num_tokens), device=device)
        storages = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        if count_saved:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                outputs = model(ids)
        else:
            outputs = model(ids)
        (outputs.last_hidden_state.float().mean() + outputs.pooler_output.float().mean()).backward()
        model.zero_grad(set_to_none=True)
        return sum(storages.values())

    step(512)  # warm-up: allocator pools, lazy initialisation
    memory = PeakMemory(device)
    memory.reset()
    start = time.perf_counter()
    saved = step(length, count_saved=True)
    peak = memory.peak_bytes()
    seconds = time.perf_counter() - start
    return {"length": length, "peak_bytes": peak, "saved_activation_bytes": saved, "seconds": seconds}


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["length"] for r in results]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.loglog(lengths, [r["peak_bytes"] / 2**20 for r in results], "o-", label="peak memory")
    axis.loglog(lengths, [r["saved_activation_bytes"] / 2**20 for r in results], "s--", label="saved activations")
    reference = results[0]["peak_bytes"] / 2**20
    axis.loglog(lengths, [reference * n / lengths[0] for n in lengths], ":", color="gray", label="linear")
    axis.set_xlabel("tokens in the sequence")
    axis.set_ylabel("MiB")
    axis.set_title("RAN forward + backward, batch 1")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--window_size", type=int, default=256)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks"))
    parser.add_argument("--single", type=int, help=argparse.SUPPRESS)  # internal: measure one length and print JSON
    args = parser.parse_args()

    if args.single is not None:
        print(json.dumps(measure(args.single, args)))
        return

    info = machine_info(args.device)
    print(machine_line(info))
    results = []
    print(f"{'tokens':>8} {'peak MiB':>10} {'saved MiB':>10} {'seconds':>8}")
    for length in args.lengths:
        result = run_in_subprocess(__file__, ["--single", str(length)] + strip_lengths(sys.argv[1:]))
        if "error" in result:
            raise SystemExit(f"measuring {length} tokens failed: {result['error']}")
        results.append(result)
        print(
            f"{length:>8} {result['peak_bytes'] / 2**20:>10.1f} {result['saved_activation_bytes'] / 2**20:>10.1f} "
            f"{result['seconds']:>8.2f}",
            flush=True,
        )
    by_length = {r["length"]: r for r in results}
    if 8192 in by_length and 32768 in by_length:
        ratio = by_length[32768]["peak_bytes"] / by_length[8192]["peak_bytes"]
        saved_ratio = by_length[32768]["saved_activation_bytes"] / by_length[8192]["saved_activation_bytes"]
        print(f"peak(32K) / peak(8K) = {ratio:.2f} (linear: 4.00); saved activations: {saved_ratio:.2f}")

    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = f"memory_{args.device}"
    report = {"machine_info": info, "config": vars(args) | {"output_dir": str(args.output_dir)}, "results": results}
    (args.output_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(results, args.output_dir / f"{name}.png")
    print(f"wrote {args.output_dir / name}.json and .png")


def strip_lengths(argv: list) -> list:
    """The command line minus `--lengths ...`, to hand the other settings to a child process."""
    kept, skipping = [], False
    for token in argv:
        if token.startswith("--lengths"):
            skipping = "=" not in token
            continue
        if skipping and not token.startswith("--"):
            continue
        skipping = False
        kept.append(token)
    return kept


if __name__ == "__main__":
    main()
