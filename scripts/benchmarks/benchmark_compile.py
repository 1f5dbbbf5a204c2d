#!/usr/bin/env python
"""`torch.compile(RANModel)`: graph breaks, graphs compiled across window counts, compile time, and the step time of
the compiled model against eager.

    python scripts/benchmarks/benchmark_compile.py                  # CPU, one thread, a few minutes
    python scripts/benchmarks/benchmark_compile.py --device cuda --hidden_size 768 --num_layers 12 --num_heads 12 \\
        --window_size 256 --lengths 2048 4096 8192 12288

1. `torch._dynamo.explain` on one forward: graphs and graph breaks, with where each break happens.
2. A compiled model (inductor) run on inputs of growing window counts, inference then training: frames compiled
   after each new window count (none should follow the second), seconds spent compiling, and the step time
   (median of --repeats) against the same model in eager mode, with the largest output difference.
Writes benchmarks/compile/compile_<device>.{json,md}.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo
from benchmark_utils import POSITIVE, command_line, machine_info, machine_line, result_record, sized_ran_config
from torch._dynamo.utils import counters


def build_model(args, device):
    from ran_hf import RANModel

    config = sized_ran_config(args, min_window_size=max(1, args.window_size // 4), scan_implementation=args.scan)
    torch.manual_seed(0)
    return RANModel(config).to(device)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step(model, ids, train: bool):
    if train:
        outputs = model(ids)
        (outputs.last_hidden_state.pow(2).mean() + outputs.pooler_output.pow(2).mean()).backward()
        return outputs.last_hidden_state.detach()
    with torch.no_grad():
        return model(ids).last_hidden_state


def timed(function, device, repeats):
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        result = function()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=POSITIVE, default=64)
    parser.add_argument("--num_layers", type=POSITIVE, default=2)
    parser.add_argument("--num_heads", type=POSITIVE, default=4)
    parser.add_argument("--window_size", type=POSITIVE, default=16)
    parser.add_argument("--lengths", type=POSITIVE, nargs="+", default=[160, 256, 400, 512], help="tokens, batch 1")
    parser.add_argument("--scan", default="reference", help="config.scan_implementation")
    parser.add_argument("--repeats", type=POSITIVE, default=5)
    parser.add_argument("--threads", type=POSITIVE, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks/compile"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = machine_info(args.device)
    print(machine_line(info))

    model = build_model(args, device).eval()
    generator = torch.Generator().manual_seed(1)
    inputs = {n: torch.randint(1, 1000, (1, n), generator=generator).to(device) for n in args.lengths}

    explanation = torch._dynamo.explain(model)(inputs[args.lengths[0]])
    breaks = [
        {
            "reason": reason.reason.splitlines()[0],
            "where": [f"{f.name} ({Path(f.filename).name}:{f.lineno})" for f in reason.user_stack[-2:]],
        }
        for reason in explanation.break_reasons
    ]
    print(f"explain: {explanation.graph_count} graphs, {explanation.graph_break_count} graph breaks")
    for entry in breaks:
        print(f"  break: {entry['reason']} at {' <- '.join(reversed(entry['where']))}")
    torch._dynamo.reset()

    results = []
    compiled = torch.compile(model)
    for train in (False, True):
        model.train(train)
        mode = "training" if train else "inference"
        for length, ids in inputs.items():
            windows = -(-length // args.window_size)
            frames_before = counters["stats"]["unique_graphs"]
            start = time.perf_counter()
            step(compiled, ids, train)  # compiles if this shape needs it
            synchronize(device)
            first_call = time.perf_counter() - start
            new_graphs = counters["stats"]["unique_graphs"] - frames_before
            compiled_time, got = timed(lambda: step(compiled, ids, train), device, args.repeats)
            eager_time, want = timed(lambda: step(model, ids, train), device, args.repeats)
            model.zero_grad(set_to_none=True)
            row = {
                "mode": mode,
                "tokens": length,
                "windows": windows,
                "new_graphs": new_graphs,
                "first_call_s": first_call,
                "eager_ms": eager_time * 1e3,
                "compiled_ms": compiled_time * 1e3,
                "max_abs_diff": (got - want).abs().max().item(),
            }
            results.append(row)
            print(
                f"{mode:<10} {length:>6} tokens {windows:>4} windows: {new_graphs} new graphs, first call "
                f"{first_call:6.1f} s, eager {row['eager_ms']:8.1f} ms, compiled {row['compiled_ms']:8.1f} ms, "
                f"max diff {row['max_abs_diff']:.1e}"
            )

    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.output_dir / f"compile_{device.type}"
    settings = {key: value for key, value in vars(args).items() if key != "output_dir"}
    summary = {"graphs": explanation.graph_count, "graph_breaks": explanation.graph_break_count, "breaks": breaks}
    command = command_line(__file__)
    figures = {"explain": summary, "timings": results}
    report = result_record(command, settings, figures, device=device.type, dtype="float32", info=info)
    with open(f"{stem}.json", "w") as file:
        json.dump(report, file, indent=2)
    lines = [
        f"# torch.compile(RANModel) ({device.type})",
        "",
        f"`{machine_line(info)}`",
        "",
        f"Command: `{command}`",
        "",
        f"Settings: {settings}. Batch 1, random weights, inductor.",
        "",
        f"`torch._dynamo.explain`, one forward: {explanation.graph_count} graphs, "
        f"{explanation.graph_break_count} graph breaks:",
        "",
        *[f"- {entry['reason']}, at {' <- '.join(reversed(entry['where']))}" for entry in breaks],
        "",
        "New graphs: graphs compiled on the first call at this window count (after the first two counts, none"
        " should be). First call: its seconds, compiling included. Step times: median of the timed calls.",
        "",
        "| mode | tokens | windows | new graphs | first call (s) | eager (ms) | compiled (ms) | max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['mode']} | {r['tokens']} | {r['windows']} | {r['new_graphs']} | {r['first_call_s']:.1f} | "
            f"{r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | {r['max_abs_diff']:.1e} |"
            for r in results
        ],
    ]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
