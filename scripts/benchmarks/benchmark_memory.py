#!/usr/bin/env python
"""Peak memory of RAN on one long sequence, at growing lengths: inference (forward) and training (forward + backward),
and stream training of the causal LM (chunks carrying a detached `RANCache`: truncated backpropagation).

    python scripts/benchmarks/benchmark_memory.py --threads 1   # inference at 62.5K ... 1M, training at 8K ... 128K
    python scripts/benchmarks/benchmark_memory.py --inference_lengths 100000 --training_lengths 8192 32768 \\
        --device cuda

Every measurement runs in a fresh process so that one cannot inherit another's peak. On CPU the peak is the growth
of the process's resident memory over its size just before the pass (after a short warm-up), and, exactly, the most
bytes held at once by tensors the pass created (`LiveTensorPeak`): the resident size also counts what the allocator
keeps and moves by tens of MiB between runs of the same code, so the targets are judged on the exact count. On CUDA
the peak is `torch.cuda.max_memory_allocated` over the memory held before the pass. For training, activation bytes
(tensors autograd keeps for the backward pass, each storage counted once) are reported too. Stream training reads
`--stream_chunk_size`-token chunks of one stream, backpropagating through each chunk alone: its peak should not grow
with the number of chunks. Writes a table to stdout and JSON + a log-log plot under --output_dir.
"""

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from benchmark_utils import (
    POSITIVE,
    LiveTensorPeak,
    PeakMemory,
    command_line,
    machine_info,
    machine_line,
    result_record,
    run_in_subprocess,
)
from tqdm.auto import tqdm


def ran_config(args, **fields):
    from ran_hf import RANConfig

    torch.manual_seed(0)
    return RANConfig(
        vocab_size=1000,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        head_dim=args.hidden_size // args.num_heads,
        window_size=args.window_size,
        **fields,
    )


def tensor_counter(device: torch.device):
    """On CPU, the exact count of live tensor bytes; CUDA's allocator statistics are exact already."""
    return LiveTensorPeak() if device.type == "cpu" else contextlib.nullcontext()


def measure(length: int, args) -> dict:
    """One pass at `length` tokens, in this process: forward only (`--mode inference`) or forward + backward."""
    from ran_hf import RANModel

    if args.mode == "stream":
        return measure_stream(length, args)

    config = ran_config(args, min_window_size=16)
    device = torch.device(args.device)
    training = args.mode == "training"
    model = RANModel(config).to(device).train(training)

    def step(num_tokens: int, count_saved: bool = False) -> int:
        ids = torch.randint(1, config.vocab_size, (1, num_tokens), device=device)
        if not training:
            with torch.no_grad():
                model(ids)
            return 0
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
    with tensor_counter(device) as tensors:
        saved = step(length, count_saved=True)
    peak = memory.peak_bytes()
    seconds = time.perf_counter() - start
    return {
        "mode": args.mode,
        "length": length,
        "peak_bytes": peak,
        "tensor_peak_bytes": tensors.peak_bytes if tensors else peak,
        "saved_activation_bytes": saved,
        "seconds": seconds,
    }


def measure_stream(num_chunks: int, args) -> dict:
    """Causal-LM training over `num_chunks` chunks of one stream, the cache carried and detached between chunks."""
    from ran_hf import RANForCausalLM

    config = ran_config(args, is_causal=True)
    device = torch.device(args.device)
    model = RANForCausalLM(config).to(device).train()

    def train_on(chunks: int) -> None:
        cache = None
        for _ in range(chunks):
            ids = torch.randint(1, config.vocab_size, (1, args.stream_chunk_size), device=device)
            outputs = model(ids, labels=ids, past_key_values=cache, use_cache=True)
            outputs.loss.backward()
            model.zero_grad(set_to_none=True)
            cache = outputs.past_key_values.detach()

    train_on(2)  # warm-up: allocator pools, lazy initialisation
    memory = PeakMemory(device)
    memory.reset()
    start = time.perf_counter()
    with tensor_counter(device) as tensors:
        train_on(num_chunks)
    peak = memory.peak_bytes()
    return {
        "mode": "stream",
        "length": num_chunks * args.stream_chunk_size,
        "chunks": num_chunks,
        "peak_bytes": peak,
        "tensor_peak_bytes": tensors.peak_bytes if tensors else peak,
        "saved_activation_bytes": 0,
        "seconds": time.perf_counter() - start,
    }


def exact_peak(result: dict) -> int:
    """Live tensor bytes where counted (CPU), else the allocator's peak (CUDA, and reports older than the count)."""
    return result.get("tensor_peak_bytes", result["peak_bytes"])


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    for mode, marker in (("inference", "o"), ("training", "s"), ("stream", "^")):
        runs = [r for r in results if r["mode"] == mode]
        if not runs:
            continue
        lengths = [r["length"] for r in runs]
        peaks = [exact_peak(r) / 2**20 for r in runs]
        label = "stream training: peak memory" if mode == "stream" else f"{mode}: peak memory"
        line = axis.loglog(lengths, peaks, f"{marker}-", label=label)[0]
        if any("tensor_peak_bytes" in r for r in runs):
            resident = [r["peak_bytes"] / 2**20 for r in runs]
            axis.loglog(lengths, resident, f"{marker}", color=line.get_color(), alpha=0.35, fillstyle="none")
        if mode != "stream":  # stream training should stay flat, not grow
            axis.loglog(lengths, [peaks[0] * n / lengths[0] for n in lengths], ":", color=line.get_color())
        if mode == "training":
            saved = [r["saved_activation_bytes"] / 2**20 for r in runs]
            label = "training: saved activations"
            axis.loglog(lengths, saved, f"{marker}--", color=line.get_color(), alpha=0.5, label=label)
    axis.plot([], [], ":", color="gray", label="linear in the length")
    if any("tensor_peak_bytes" in r for r in results):
        axis.plot([], [], "o", color="gray", alpha=0.35, fillstyle="none", label="resident-size growth (CPU)")
    axis.set_xlabel("tokens in the sequence (stream: read in chunks)")
    axis.set_ylabel("MiB")
    axis.set_title("RAN peak memory, batch 1 (inference: forward; training: forward + backward)", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--inference_lengths", type=POSITIVE, nargs="*", default=[62500, 125000, 250000, 500000, 1000000]
    )
    parser.add_argument("--training_lengths", type=POSITIVE, nargs="*", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--stream_chunks", type=POSITIVE, nargs="*", default=[4, 16, 64])
    parser.add_argument("--stream_chunk_size", type=POSITIVE, default=4096)
    parser.add_argument("--hidden_size", type=POSITIVE, default=128)
    parser.add_argument("--num_layers", type=POSITIVE, default=2)
    parser.add_argument("--num_heads", type=POSITIVE, default=4)
    parser.add_argument("--window_size", type=POSITIVE, default=256)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--threads", type=POSITIVE, help="CPU threads (default: PyTorch's); 1 keeps a shared machine fair"
    )
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks/memory"))
    # internal: measure one length in one mode and print JSON
    parser.add_argument("--single", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--mode", default="training", choices=["inference", "training", "stream"], help=argparse.SUPPRESS
    )
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.single is not None:
        print(json.dumps(measure(args.single, args)))
        return

    info = machine_info(args.device)
    print(machine_line(info))
    settings = ["--hidden_size", args.hidden_size, "--num_layers", args.num_layers, "--num_heads", args.num_heads]
    settings += ["--window_size", args.window_size, "--device", args.device, "--threads", torch.get_num_threads()]
    settings += ["--stream_chunk_size", args.stream_chunk_size]
    runs = [("inference", n) for n in args.inference_lengths] + [("training", n) for n in args.training_lengths]
    runs += [("stream", n) for n in args.stream_chunks]
    results = []
    started = time.perf_counter()
    tqdm.write(f"{'mode':>9} {'tokens':>9} {'peak MiB':>10} {'resident':>10} {'saved MiB':>10} {'seconds':>8}")
    progress = tqdm(runs, desc="measurements")
    for mode, length in progress:
        progress.set_postfix_str(f"{mode} {length}" + (" chunks" if mode == "stream" else ""))
        result = run_in_subprocess(__file__, [str(a) for a in ["--single", length, "--mode", mode, *settings]])
        if "error" in result:
            raise SystemExit(f"measuring {mode} at {length} tokens failed: {result['error']}")
        results.append(result)
        tqdm.write(
            f"{mode:>9} {result['length']:>9} {exact_peak(result) / 2**20:>10.1f} "
            f"{result['peak_bytes'] / 2**20:>10.1f} "
            f"{result['saved_activation_bytes'] / 2**20:>10.1f} {result['seconds']:>8.2f}"
        )
    progress.close()
    for mode in ("inference", "training"):
        # Linear memory: 4x the tokens, 4x the peak.
        peaks = {r["length"]: exact_peak(r) for r in results if r["mode"] == mode}
        longest = max(peaks, default=None)
        if longest is not None and longest // 4 in peaks and longest % 4 == 0:
            ratio = peaks[longest] / peaks[longest // 4]
            print(f"{mode}: peak({longest}) / peak({longest // 4}) = {ratio:.2f} (linear: 4.00)")
    stream = {r["chunks"]: exact_peak(r) for r in results if r["mode"] == "stream"}
    if len(stream) > 1:
        fewest, most = min(stream), max(stream)
        print(f"stream: peak after {most} chunks / after {fewest} = {stream[most] / stream[fewest]:.3f} (flat: 1.00)")
    print(f"total time {time.perf_counter() - started:.0f} s")

    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = f"memory_{args.device}"
    settings = {key: value for key, value in vars(args).items() if key not in ("single", "mode")}
    # A mode given no lengths (`--training_lengths` with none) keeps its results from the last report, so that one
    # mode can be measured again alone; `settings["earlier_runs"]` then says which run measured each kept mode.
    measured = {mode for mode, _ in runs}
    report_path = args.output_dir / f"{name}.json"
    earlier = json.loads(report_path.read_text()) if report_path.is_file() else {}
    kept = [r for r in earlier.get("results", []) if r["mode"] not in measured]
    if kept:
        earlier_settings = dict(earlier["settings"])
        earlier_runs = earlier_settings.pop("earlier_runs", {})
        run = {key: earlier[key] for key in ("command", "commit", "date", "machine_info")}
        run["settings"] = earlier_settings
        settings["earlier_runs"] = {mode: earlier_runs.get(mode, run) for mode in sorted({r["mode"] for r in kept})}
    results = kept + results
    report = result_record(command_line(__file__), settings, results, device=args.device, dtype="float32", info=info)
    report_path.write_text(json.dumps(report, indent=2))
    plot(results, args.output_dir / f"{name}.png")
    print(f"wrote {args.output_dir / name}.json and .png")


if __name__ == "__main__":
    main()
