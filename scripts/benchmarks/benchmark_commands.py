"""Wall time of whole commands, start-up included: the test suite, `import ran_hf`, the main job.

Each command runs `--repeats` times as a fresh process; with `--baseline`, the command and the baseline run in turn
(A B A B ...) and their ratio is taken pair by pair, so that a machine whose speed drifts during the run still gives a
fair ratio. Prints and saves min / median / max (quote the median) with the command, commit, date and machine:

    python scripts/benchmarks/benchmark_commands.py --output benchmarks/commands/import_time --repeats 10 \\
        --command ".venv/bin/python -c 'import ran_hf'" \\
        --baseline ".venv/bin/python -c 'import torch, transformers; from transformers import AutoModel'"
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmark_utils import POSITIVE, command_line, machine_info, result_path, result_record, write_result
from tqdm.auto import tqdm


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--command", required=True, help="the command to time, as a shell would split it")
    parser.add_argument("--baseline", help="a second command, timed in turn with the first; their ratio is reported")
    parser.add_argument("--repeats", type=POSITIVE, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each command first (disk caches)")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="set for both commands")
    parser.add_argument("--output", required=True, help="result prefix: writes PREFIX.json and PREFIX.md")
    args = parser.parse_args(argv)
    for item in args.env:
        if "=" not in item:
            parser.error(f"--env {item!r}: give NAME=VALUE")
    return args


def run_once(command: str, env: dict) -> float:
    """Seconds from start to exit of one run; a run that fails stops the benchmark with its output."""
    start = time.perf_counter()
    result = subprocess.run(shlex.split(command), env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{command!r} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return seconds


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "runs": values}


def main(argv=None) -> dict:
    args = parse_args(argv)
    env = {**os.environ, **dict(item.split("=", 1) for item in args.env)}
    commands = [args.command] + ([args.baseline] if args.baseline else [])
    for _ in range(args.warmup):
        for command in commands:
            run_once(command, env)
    seconds = {command: [] for command in commands}
    for _ in tqdm(range(args.repeats), desc="runs", unit="run"):
        for command in commands:
            seconds[command].append(run_once(command, env))

    figures = {"wall_seconds": {command: spread(values) for command, values in seconds.items()}}
    if args.baseline:
        ratios = [a / b for a, b in zip(seconds[args.command], seconds[args.baseline])]
        figures["ratio_to_baseline"] = spread(ratios)
    info = machine_info() | {"load_average_1min": os.getloadavg()[0]}
    info["date"] = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())  # several runs a day: the minute too
    # Whole commands, timed from outside: no model runs in this process, in no dtype.
    result = result_record(command_line(__file__, argv), vars(args), figures, device="cpu", dtype="none", info=info)

    lines = [f"# {Path(args.output).name}", "", f"`{result['command']}`", ""]
    machine = result["machine_info"]
    lines += [f"commit {result['commit']}, {result['date']}, {machine['cpu']}, {machine['cores']} cores", ""]
    lines += ["| command | min s | median s | max s |", "|---|---:|---:|---:|"]
    for command, values in figures["wall_seconds"].items():
        lines.append(f"| `{command}` | {values['min']:.2f} | {values['median']:.2f} | {values['max']:.2f} |")
    if args.baseline:
        ratio = figures["ratio_to_baseline"]
        lines += ["", f"ratio (pair by pair): median {ratio['median']:.2f} (min {ratio['min']:.2f}, max {ratio['max']:.2f})"]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    write_result(result_path(args.output, ".json"), json.dumps(result, indent=2) + "\n")
    write_result(result_path(args.output, ".md"), text)
    return result


if __name__ == "__main__":
    main()
