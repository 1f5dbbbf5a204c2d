#!/usr/bin/env python
"""Per-token decoding latency and cache memory at growing contexts: causal RAN against a GPT-2 of the same size.

    python scripts/benchmarks/benchmark_decode.py                       # contexts 512, 4K, 16K, 64K on CPU
    python scripts/benchmarks/benchmark_decode.py --contexts 512 4096 --device cuda

RAN reads the context for real (chunked prefill through its `RANCache`), then decodes `--steps` tokens greedily;
the latency is the mean over those steps, which cover a whole window so that the cell updates at window ends are
counted. GPT-2 (Transformers, same width, depth and heads, random weights) gets a `DynamicCache` holding keys and
values for the whole context — filled with random values, since decoding cost depends only on the cache size and a
quadratic prefill of 64K tokens would take hours on a CPU — then decodes `--gpt2_steps` tokens. Cache memory is the
bytes the cache object holds (for RAN, `RANCache.nbytes()`: the total bytes of its tensors), per context, so that
a flat cache shows as the same bytes at every context. By default a causal RAN's tokens review every earlier window's
cell, so its cache grows by one cell per window and layer; `--memory_review_cells N` bounds the review to the last N
windows (a setting of a trained model too), and the cache stays flat. `--bf16_autocast` runs both models under
`torch.autocast(dtype=torch.bfloat16)` (float32 weights). Writes a table to stdout and JSON + PNG under
--output_dir; the JSON is rewritten after every context, so a run stopped by a time limit keeps those it finished.
"""

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from benchmark_utils import POSITIVE, command_line, machine_info, machine_line, result_record, write_result
from tqdm.auto import tqdm
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from ran_hf import RANConfig, RANForCausalLM


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def ran_decode(model, context: int, steps: int, prefill_chunk: int, device) -> dict:
    generator = torch.Generator().manual_seed(context)
    ids = torch.randint(1, model.config.vocab_size, (1, context), generator=generator).to(device)
    cache, start = None, time.perf_counter()
    for offset in tqdm(range(0, context, prefill_chunk), desc=f"RAN prefill {context}", leave=False):
        outputs = model(ids[:, offset : offset + prefill_chunk], past_key_values=cache, use_cache=True)
        cache = outputs.past_key_values
    synchronize(device)
    prefill_seconds = time.perf_counter() - start
    token = outputs.logits[:, -1:].argmax(-1)
    latencies = []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = model(token, past_key_values=cache, use_cache=True)
        token = outputs.logits[:, -1:].argmax(-1)
        synchronize(device)
        latencies.append(time.perf_counter() - start)
    return {
        "ms_per_token": 1000 * statistics.mean(latencies),
        "ms_per_token_median": 1000 * statistics.median(latencies),
        "cache_bytes": outputs.past_key_values.nbytes(),
        "prefill_seconds": prefill_seconds,
    }


@torch.no_grad()
def gpt2_decode(model, context: int, steps: int, device, dtype=torch.float32) -> dict:
    config = model.config
    head_dim = config.n_embd // config.n_head
    cache = DynamicCache(config=config)
    shape = (1, config.n_head, context, head_dim)
    for layer_idx in range(config.n_layer):
        keys, values = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))  # as a prefill makes them
        cache.update(keys, values, layer_idx)
    token = torch.ones(1, 1, dtype=torch.long, device=device)
    latencies = []
    for step in range(steps):
        position = torch.tensor([[context + step]], device=device)
        start = time.perf_counter()
        outputs = model(token, past_key_values=cache, position_ids=position, use_cache=True)
        token = outputs.logits[:, -1:].argmax(-1)
        synchronize(device)
        latencies.append(time.perf_counter() - start)
    cache_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return {
        "ms_per_token": 1000 * statistics.mean(latencies),
        "ms_per_token_median": 1000 * statistics.median(latencies),
        "cache_bytes": cache_bytes,
    }


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, memory) = plt.subplots(1, 2, figsize=(10, 4))
    for name, marker in (("ran", "o-"), ("gpt2", "s--")):
        points = [(r["context"], r[name]) for r in results if r.get(name)]
        contexts = [c for c, _ in points]
        latency.loglog(contexts, [m["ms_per_token"] for _, m in points], marker, label=name.upper())
        memory.loglog(contexts, [m["cache_bytes"] / 2**20 for _, m in points], marker, label=name.upper())
    latency.set(xlabel="context (tokens)", ylabel="ms per generated token", title="decoding latency")
    memory.set(xlabel="context (tokens)", ylabel="cache MiB", title="cache memory")
    for axis in (latency, memory):
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=POSITIVE, nargs="+", default=[512, 4096, 16384, 65536])
    parser.add_argument("--hidden_size", type=POSITIVE, default=256)
    parser.add_argument("--num_layers", type=POSITIVE, default=4)
    parser.add_argument("--num_heads", type=POSITIVE, default=4)
    parser.add_argument("--window_size", type=POSITIVE, default=256)
    parser.add_argument("--vocab_size", type=POSITIVE, default=8192)
    parser.add_argument("--steps", type=POSITIVE, default=256, help="RAN decoding steps per context (>= one window)")
    parser.add_argument("--gpt2_steps", type=POSITIVE, default=32)
    parser.add_argument("--gpt2_max_context", type=POSITIVE, default=65536, help="largest context tried for GPT-2")
    parser.add_argument("--prefill_chunk", type=POSITIVE, default=8192)
    parser.add_argument(
        "--memory_review_cells", type=POSITIVE, help="RAN reviews the cells of the last N windows only (a flat cache)"
    )
    parser.add_argument("--bf16_autocast", action="store_true", help="decode under bfloat16 autocast")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks/decode"))
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)

    ran_config = RANConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        head_dim=args.hidden_size // args.num_heads,
        window_size=args.window_size,
        min_window_size=16,
        is_causal=True,
        memory_review_cells=args.memory_review_cells,
    )
    ran = RANForCausalLM(ran_config).to(device).eval()
    gpt2_config = GPT2Config(
        vocab_size=args.vocab_size,
        n_embd=args.hidden_size,
        n_layer=args.num_layers,
        n_head=args.num_heads,
        n_positions=max(args.contexts) + max(args.gpt2_steps, args.steps) + 1,
        bos_token_id=None,
        eos_token_id=None,
    )
    gpt2 = GPT2LMHeadModel(gpt2_config).to(device).eval()
    info = machine_info(str(device))
    print(machine_line(info))
    print(f"RAN {ran.num_parameters():,} parameters, GPT-2 {gpt2.num_parameters():,} (incl. position table)")

    dtype = "bfloat16 autocast" if args.bf16_autocast else "float32"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16_autocast else contextlib.nullcontext()
    cache_dtype = torch.bfloat16 if args.bf16_autocast else torch.float32  # GPT-2's keys and values under autocast
    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = f"decode_{device.type}" + (f"_review{args.memory_review_cells}" if args.memory_review_cells else "")
    command = command_line(__file__)
    with autocast:
        ran_decode(ran, 64, 8, args.prefill_chunk, device)  # warm-up: allocator, lazy initialisation
        gpt2_decode(gpt2, 64, 4, device, cache_dtype)
    results = []
    header = f"{'context':>8} {'RAN ms/tok':>11} {'RAN cache MiB':>14} {'GPT-2 ms/tok':>13} {'GPT-2 cache MiB':>16}"
    print(header)
    for context in args.contexts:
        with autocast:
            row = {"context": context, "ran": ran_decode(ran, context, args.steps, args.prefill_chunk, device)}
        if context <= args.gpt2_max_context:
            try:
                with autocast:
                    row["gpt2"] = gpt2_decode(gpt2, context, args.gpt2_steps, device, cache_dtype)
            except (RuntimeError, MemoryError) as error:  # out of memory: report where GPT-2 stops fitting
                row["gpt2"] = None
                print(f"GPT-2 at {context}: {type(error).__name__}: {str(error)[:80]}")
        results.append(row)
        gpt2_row = row.get("gpt2")
        print(
            f"{context:>8} {row['ran']['ms_per_token']:>11.2f} {row['ran']['cache_bytes'] / 2**20:>14.3f} "
            + (
                f"{gpt2_row['ms_per_token']:>13.2f} {gpt2_row['cache_bytes'] / 2**20:>16.1f}"
                if gpt2_row
                else f"{'-':>13} {'-':>16}"
            ),
            flush=True,
        )
        report = result_record(command, vars(args), results, device=device.type, dtype=dtype, info=info)
        write_result(args.output_dir / f"{name}.json", json.dumps(report, indent=2))

    first, last = results[0], results[-1]
    ran_ratio = last["ran"]["ms_per_token"] / first["ran"]["ms_per_token"]
    print(f"RAN latency {last['context']} / {first['context']}: {ran_ratio:.2f}")
    print(f"RAN cache bytes {last['context']} / {first['context']}: "
          f"{last['ran']['cache_bytes'] / first['ran']['cache_bytes']:.2f}")  # fmt: skip
    if first.get("gpt2") and last.get("gpt2"):
        gpt2_ratio = last["gpt2"]["ms_per_token"] / first["gpt2"]["ms_per_token"]
        print(f"GPT-2 latency {last['context']} / {first['context']}: {gpt2_ratio:.2f}")
    plot(results, args.output_dir / f"{name}.png")
    print(f"wrote {args.output_dir / name}.json and .png")


if __name__ == "__main__":
    main()
