#!/usr/bin/env python
"""What `import ran_hf` costs, side by side with what importing Transformers costs:

    python scripts/benchmarks/benchmark_import.py            # 10 runs of each, about 2 minutes on 2 cores

A = `python -c "import ran_hf"` and B = `python -c "import torch, transformers; from transformers import AutoModel"`
run in turn (A B A B ..., after `--warmup` runs of each that are not counted), each a whole fresh interpreter, timed
from outside: wall seconds from start to exit, and the child's user and system seconds as the kernel counts them
(`os.wait4`, what `/usr/bin/time` reports). The ratio A / B is taken pair by pair, so that a machine whose speed
drifts during the call still gives a meaningful ratio; quote the medians. `ran_hf` is this checkout's (`src/` first
on `PYTHONPATH`), whatever is installed: run the script from another checkout to measure that one.

Writes `benchmarks/import/import_time.json` and `.md` (command, commit, date, machine, library versions).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmark_utils import POSITIVE, machine_info, result_path, write_result

REPO = Path(__file__).resolve().parents[2]
KINDS = ("wall_s", "cpu_s", "user_s")
COMMANDS = {
    "A": ["python", "-c", "import ran_hf"],
    "B": ["python", "-c", "import torch, transformers; from transformers import AutoModel"],
}


def run_once(command: list, env: dict) -> dict:
    """One fresh interpreter: its wall, user and system seconds."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, *command[1:]], env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited with {process.returncode}")
    return {"wall_s": wall, "user_s": usage.ru_utime, "cpu_s": usage.ru_utime + usage.ru_stime}


def spread(values: list) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(record: dict) -> str:
    machine, settings, results = record["machine_info"], record["settings"], record["results"]
    lines = [
        "# What `import ran_hf` costs",
        "",
        f"Command: `{record['command']}` (commit {record['commit']}, {record['date']})",
        "",
        f"Machine: {machine['cpu_model']}, {machine['nproc']} processors, torch {machine['torch']}, transformers "
        f"{machine['transformers']}, Python {machine['python']}; `{machine['uname']}`. Load average "
        f"{results['load_average']['before']} before the runs, {results['load_average']['after']} after.",
        "",
        f"{settings['runs']} runs of each, in turn, after {settings['warmup']} of each not counted; whole process, "
        "timed from outside. Quote the medians.",
        "",
        "| command | wall s (min / median / max) | CPU s, user + system | user s |",
        "|---|---|---|---|",
    ]
    rows = [(f"{key}: `{command}`", results[key]) for key, command in settings["commands"].items()]
    for label, row in [*rows, ("A / B, pair by pair", results["ratio_a_to_b"])]:
        cells = [" / ".join(f"{row[kind][at]:.2f}" for at in ("min", "median", "max")) for kind in KINDS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=POSITIVE, default=10, help="counted runs of each command")
    parser.add_argument("--warmup", type=int, default=2, help="runs of each before the counted ones")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/import/import_time"), help="file prefix")
    args = parser.parse_args()

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    found = subprocess.run(
        [sys.executable, "-c", "import ran_hf; print(ran_hf.__file__)"], env=env, capture_output=True, text=True
    ).stdout.strip()
    if Path(found).resolve() != (REPO / "src" / "ran_hf" / "__init__.py").resolve():
        raise SystemExit(f"`import ran_hf` finds {found}, not this checkout's")

    load_before = os.getloadavg()
    runs = {key: [] for key in COMMANDS}
    for counted in [False] * args.warmup + [True] * args.runs:
        for key, command in COMMANDS.items():
            measured = run_once(command, env)
            if counted:
                runs[key].append(measured)
    load_after = os.getloadavg()

    info = machine_info()
    info.update(nproc=os.cpu_count(), cpu_model=cpu_model(), python=platform.python_version())
    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip()
    info["uname"] = uname or " ".join(filter(None, platform.uname()))
    commit, date = info.pop("git_sha"), info.pop("date")
    info.pop("device")
    changed = [f"--{name} {value}" for name, value in vars(args).items() if value != parser.get_default(name)]
    record = {
        "command": " ".join(["python scripts/benchmarks/benchmark_import.py", *changed]),
        "commit": commit,
        "date": date,
        "machine_info": info,
        "device": "cpu",
        "dtype": "none",  # no model runs
        "settings": {
            "runs": args.runs,
            "warmup": args.warmup,
            "order": "A B A B ...",
            "commands": {key: " ".join(command[:2]) + f' "{command[2]}"' for key, command in COMMANDS.items()},
            "ran_hf": str(Path(found).resolve().relative_to(REPO.resolve())),  # this checkout's
        },
        "results": {
            **{key: {kind: spread([run[kind] for run in runs[key]]) for kind in KINDS} for key in COMMANDS},
            "ratio_a_to_b": {
                kind: spread([a[kind] / b[kind] for a, b in zip(runs["A"], runs["B"])]) for kind in KINDS
            },
            "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]},
            "runs": runs,
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_result(result_path(args.output, ".json"), json.dumps(record, indent=2) + "\n")
    write_result(result_path(args.output, ".md"), markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
