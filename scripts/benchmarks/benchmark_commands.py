"""Wall and CPU time of whole commands, start-up included: `import ran_hf`, the test suite, the main job.

Each command runs `--repeats` times as a fresh process, timed from outside: wall seconds from start to exit, and the
CPU seconds (user + system) the kernel counts for it and its children (`os.wait4`, what `/usr/bin/time` reports).
With `--baseline`, the command and the baseline run in turn (A B A B ...) and their ratio is taken pair by pair, so
that a machine whose speed drifts during the run still gives a fair ratio. Prints and saves min / median / max (quote
the median) with the command, commit, date and machine. What import ran_hf costs against importing Transformers:

    python scripts/benchmarks/benchmark_commands.py --output benchmarks/import/import_time --repeats 10 --warmup 2 \\
        --command ".venv/bin/python -c 'import ran_hf'" \\
        --baseline ".venv/bin/python -c 'import torch, transformers; from transformers import AutoModel'"
"""

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmark_utils import POSITIVE, command_line, machine_info, result_path, result_record, write_json_and_table
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


KINDS = ("wall_seconds", "cpu_seconds")


def run_once(command: str, env: dict, log: Path) -> dict:
    """Wall and CPU seconds of one run, its output appended to `log`; a run that fails stops the benchmark."""
    with log.open("a") as output:
        start = time.perf_counter()
        process = subprocess.Popen(shlex.split(command), env=env, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
    if (code := os.waitstatus_to_exitcode(status)) != 0:
        sys.exit(f"{command!r} exited {code}; its output is in {log}:\n{log.read_text()[-3000:]}")
    return {"wall_seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime}


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "runs": values}


def fmt(values) -> str:
    return " / ".join(f"{value:.2f}" for value in values)


def main(argv=None) -> dict:
    args = parse_args(argv)
    env = {**os.environ, **dict(item.split("=", 1) for item in args.env)}
    commands = [args.command] + ([args.baseline] if args.baseline else [])
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    log = result_path(args.output, ".log")
    log.unlink(missing_ok=True)
    load_before = os.getloadavg()
    for _ in range(args.warmup):
        for command in commands:
            run_once(command, env, log)
    runs = {command: [] for command in commands}
    for _ in tqdm(range(args.repeats), desc="runs", unit="run"):
        for command in commands:
            runs[command].append(run_once(command, env, log))
    log.unlink()  # kept only when a run failed

    figures = {kind: {command: spread([run[kind] for run in runs[command]]) for command in commands} for kind in KINDS}
    if args.baseline:
        pairs = list(zip(runs[args.command], runs[args.baseline]))
        figures["ratio_to_baseline"] = {kind: spread([a[kind] / b[kind] for a, b in pairs]) for kind in KINDS}
    figures["load_average"] = {"before": load_before, "after": os.getloadavg()}
    info = machine_info()
    info["date"] = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())  # several runs a day: the minute too
    # Whole commands, timed from outside: no model runs in this process, in no dtype.
    result = result_record(command_line(__file__, argv), vars(args), figures, device="cpu", dtype="none", info=info)

    lines = [f"# {Path(args.output).name}", "", f"`{result['command']}`", ""]
    machine = result["machine_info"]
    lines += [f"commit {result['commit']}, {result['date']}, {machine['cpu']}, {machine['cores']} cores", ""]
    lines += [f"Load average (1, 5, 15 min): {fmt(load_before)} before the runs, {fmt(os.getloadavg())} after.", ""]
    lines += [f"{args.repeats} runs of each after {args.warmup} not counted. Seconds, min / median / max:", ""]
    lines += ["| command | wall | CPU (user + system) |", "|---|---|---|"]
    rows = [(f"`{command}`", {kind: figures[kind][command] for kind in KINDS}) for command in commands]
    if args.baseline:
        rows.append(("ratio, pair by pair", figures["ratio_to_baseline"]))
    for label, row in rows:
        cells = [fmt(row[kind][at] for at in ("min", "median", "max")) for kind in KINDS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_json_and_table(args.output, result, text)
    return result


if __name__ == "__main__":
    main()
