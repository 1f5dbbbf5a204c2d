#!/usr/bin/env python
"""Time and peak memory of reading a training split the ways the scripts can: record by record in Python (what
`load_splits` did before it went through `datasets`), through `datasets` into Arrow, whole or cut to its first
documents, and streamed.

    python scripts/benchmarks/benchmark_data_loading.py          # EURLEX-57K train (45,000 documents), ~5 minutes

Every measurement runs in a fresh process (one thread of work; imports done before the clock starts): `seconds` is
the wall time of the reading alone, `peak_mib` the process's peak resident memory (`ru_maxrss`, what
`/usr/bin/time -v` reports as "Maximum resident set size"), `imports_mib` the resident memory once the imports are
done. Arrow readings are taken with an empty `datasets` cache (`first`), then again with the cache the first one
wrote (`cached`). Each figure is the median of `--repeats` processes. Methods:

  records          ran_hf.files.data.read_records + check_columns + Dataset.from_dict
                   (load_splits before it used datasets)
  load_dataset     datasets.load_dataset("json") alone, no checks
  load_splits      scripts/data_loading.load_splits, the labels of the whole split, the texts checked
                   (run_classification.py without --max_train_samples)
  load_splits_cut  the same, keeping the first --first documents before the texts are checked
                   (run_classification.py --max_train_samples N: the labels still come from the whole split)
  stream_first     datasets.load_dataset(streaming=True).take(N): the alternative for a cut, measured, not used
  read_first       ran_hf.files.data.read_records(limit=N): only the first N records read
                   (train_tokenizer.py --max_documents N)

Writes `benchmarks/data_loading/data_loading_cpu.json` and `.md` (command, commit, date, machine, library versions).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


SCRIPTS = Path(__file__).resolve().parents[1]
DEFAULT_FILE = SCRIPTS.parents[1] / "shared" / "data" / "eurlex57k" / "train.jsonl.gz"
METHODS = ("records", "load_dataset", "load_splits", "load_splits_cut", "stream_first", "read_first")
ARROW_METHODS = ("load_dataset", "load_splits", "load_splits_cut")


def resident_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(method: str, path: str, first: int, cache_dir: str) -> dict:
    """Read `path` one way in this process; what it cost."""
    import datasets

    sys.path.insert(0, str(SCRIPTS))
    from data_loading import check_split_texts, first_examples, load_splits

    from ran_hf.files.data import check_columns, read_records

    datasets.disable_progress_bars()
    files = {"train": path}
    data_args = argparse.Namespace(dataset_name=None, train_file=path)
    imports_mib = resident_mib()
    start = time.perf_counter()
    if method == "records":
        records = read_records(path, ["text"])
        check_columns(records, ["text", "label"], path)
        dataset = datasets.Dataset.from_dict({column: [r[column] for r in records] for column in ("text", "label")})
        labels, rows = dataset["label"][:], len(dataset)
    elif method == "load_dataset":
        dataset = datasets.load_dataset("json", data_files=path, split="train", cache_dir=cache_dir)
        labels, rows = dataset["label"][:], len(dataset)
    elif method in ("load_splits", "load_splits_cut"):
        splits = load_splits(None, None, files, ["text"], ("label",), ("text",), cache_dir=cache_dir)
        labels = splits["train"]["label"][:]  # the classes come from the whole split, read as run_classification does
        if method == "load_splits_cut":
            splits = first_examples(splits, {"train": first})
        check_split_texts(splits, ["text"], data_args)
        rows = len(splits["train"])
    elif method == "stream_first":
        stream = datasets.load_dataset("json", data_files=path, split="train", streaming=True)
        rows = len(list(stream.take(first)))
        labels = None
    elif method == "read_first":
        rows = len(read_records(path, ["text"], limit=first))
        labels = None
    else:
        raise ValueError(f"unknown method {method!r}")
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "peak_mib": resident_mib(),
        "imports_mib": imports_mib,
        "rows": rows,
        "labelled_rows": None if labels is None else len(labels),
    }


def run_one(method: str, path: str, first: int, cache_dir: str) -> dict:
    """`measure` in a fresh interpreter, with the wall time of the whole process."""
    command = [sys.executable, __file__, "--single", method, "--file", path, "--first", str(first)]
    start = time.perf_counter()
    completed = subprocess.run([*command, "--cache_dir", cache_dir], capture_output=True, text=True, check=True)
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    return {**result, "process_seconds": time.perf_counter() - start}


def median_of(runs: list[dict]) -> dict:
    keys = ("seconds", "peak_mib", "imports_mib", "process_seconds")
    return {**runs[0], **{key: statistics.median(run[key] for run in runs) for key in keys}, "repeats": len(runs)}


def markdown(report: dict) -> str:
    info, settings = report["machine_info"], report["settings"]
    lines = [
        f"# Reading `{settings['file']}`",
        "",
        f"Command: `{report['command']}`  ",
        (
            f"Commit {report['commit']}, {report['date']}; {info['cpu']} x{info['threads']} threads, "
            f"{info['memory_gib']} GiB; Python {info['python']}, datasets {info['datasets']}, "
            f"pyarrow {info['pyarrow']}, transformers {info['transformers']}, torch {info['torch']}. Load average "
            f"{info['load_average']} (other work on the machine slows the timings, not the memory figures)."
        ),
        "",
        (
            f"Median of {settings['repeats']} fresh processes each. `seconds`: the reading alone; `peak MiB`: the "
            "process's peak resident memory; `imports MiB`: resident once the imports are done (the same for every "
            "method)."
        ),
        "",
        "| method | cache | rows kept | seconds | peak MiB | imports MiB | process seconds |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['method']} | {row['cache']} | {row['rows']:,} | {row['seconds']:.2f} | {row['peak_mib']:,.0f} | "
            f"{row['imports_mib']:,.0f} | {row['process_seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default=str(DEFAULT_FILE), help="jsonl(.gz) file with `text` and `label` columns")
    parser.add_argument("--first", type=int, default=100, help="documents kept by the cut methods")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per figure (the median is kept)")
    parser.add_argument("--output", default=str(SCRIPTS.parent / "benchmarks" / "data_loading" / "data_loading_cpu"))
    parser.add_argument("--single", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--cache_dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag in ("first", "repeats"):  # checked here: argument_checks imports transformers into the measured process
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag}: must be at least 1, got {getattr(args, flag)}")
    if args.single:
        print(json.dumps(measure(args.single, args.file, args.first, args.cache_dir)))
        return

    import platform

    import datasets
    import pyarrow
    from benchmark_utils import command_line, machine_info, result_path, result_record, write_result

    info = machine_info("cpu")
    info.update(
        datasets=datasets.__version__,
        pyarrow=pyarrow.__version__,
        python=platform.python_version(),
        memory_gib=round(
            int(Path("/proc/meminfo").read_text().split()[1]) / 2**20 if Path("/proc/meminfo").exists() else 0
        ),
    )
    load_before = os.getloadavg()[0]  # other work on a shared machine slows the timings, not the memory figures
    results = []
    for method in args.methods:
        caches = ("first", "cached") if method in ARROW_METHODS else ("none",)
        runs = {cache: [] for cache in caches}
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as cache_dir:  # every repeat starts from an empty cache
                for cache in caches:
                    runs[cache].append(run_one(method, args.file, args.first, cache_dir))
        for cache in caches:
            row = {"method": method, "cache": cache, **median_of(runs[cache])}
            results.append(row)
            print(
                f"{method:16} {cache:7} {row['rows']:>7,} rows {row['seconds']:7.2f} s {row['peak_mib']:8,.0f} MiB "
                f"(imports {row['imports_mib']:,.0f} MiB)",
                flush=True,
            )
    info["load_average"] = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    settings = {
        "file": os.path.relpath(args.file, SCRIPTS.parent),
        "first": args.first,
        "methods": args.methods,
        "repeats": args.repeats,
        "output": args.output,
    }
    # No model runs: the figures are of reading files, in no dtype.
    report = result_record(command_line(__file__), settings, results, device="cpu", dtype="none", info=info)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_result(result_path(output, ".json"), json.dumps(report, indent=2) + "\n")
    write_result(result_path(output, ".md"), markdown(report))
    print(f"Wrote {output}.json and .md")


if __name__ == "__main__":
    main()
