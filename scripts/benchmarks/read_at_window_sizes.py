#!/usr/bin/env python
"""Read the RANs of a memory-task result file again at other inference window sizes.

A RAN is trained at one set of window sizes (`window_size`, `training_window_sizes`) and may be read at any:
`window_size` is not a weight's shape. Which memory answers a question depends on it: a question whose facts sit in
its own window is answered by the window attention, one whose facts sit in earlier windows by the cell, memory review
and the associative memory. Reading one trained model at several window sizes, on the same test examples as
`benchmark_memory_tasks.py` (held-out seed, `--eval_examples` of the result file), says which of them learnt the task.
Each window is also read on the benchmark's validation examples at the training length, and the table names the
window those choose: the figure to quote, since the test examples did not pick it.

    python scripts/benchmarks/read_at_window_sizes.py \
        --results benchmarks/memory_tasks/qa1_128_6000steps_ran_window128_assoc_training_window_sizes_key_conv4.json \
        --checkpoints /tmp/memory_tasks_checkpoints_qa1_128_conv --window_sizes 32 64 128 --lengths 128 512 2048

Every RAN run of the file (each seed at its best rate) whose weights are in `--checkpoints` is read. Writes
`<--output>.{json,md,png}` (default: the result file's name with `_windows`).
"""

import argparse
import json
from pathlib import Path

import torch
from benchmark_memory_tasks import TEST_SEED, VALIDATION_SEED, accuracy, batch_maker, best_runs, build, checkpoint_path
from benchmark_utils import (
    POSITIVE,
    command_line,
    machine_info,
    machine_line,
    result_record,
    write_json_and_table,
)
from memory_tasks import STATE_VOCAB_SIZE, mqar_vocab_size
from tqdm.auto import tqdm


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, required=True, help="a benchmark_memory_tasks.py result file (.json)")
    parser.add_argument("--checkpoints", type=Path, required=True, help="the `--checkpoints` folder of its runs")
    parser.add_argument("--window_sizes", nargs="+", type=POSITIVE, required=True)
    parser.add_argument("--lengths", nargs="+", type=POSITIVE, required=True)
    parser.add_argument("--eval_tokens", type=POSITIVE, default=16384, help="tokens per evaluation batch")
    parser.add_argument("--threads", type=POSITIVE, default=1)
    parser.add_argument("--output", default=None, help="prefix of .json/.md/.png (default: <results>_windows)")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        parser.error(f"--results {args.results} is not a file")
    args.output = args.output or str(args.results.with_suffix("")) + "_windows"
    return args


def trained_rans(record: dict, checkpoints: Path) -> list[tuple[dict, Path]]:
    """The RAN runs at their best rate (every seed) whose weights are in `checkpoints`, with the path of each."""
    settings, runs = record["settings"], record["results"]["runs"]
    found = []
    for pairs, train_length in sorted({(r["pairs"], r["train_length"]) for r in runs if r["model"] == "ran"}):
        best, _ = best_runs(runs, "ran", pairs, train_length)
        for run in runs:
            key = (run["model"], run["pairs"], run["train_length"], run["learning_rate"])
            if key == ("ran", pairs, train_length, best):
                path = checkpoint_path(run, argparse.Namespace(**{**settings, "checkpoints": checkpoints}))
                if path.is_file():
                    found.append((run, path))
    return found


def read_at_window_sizes(run: dict, weights: Path, settings: dict, args) -> tuple[dict, dict]:
    """{window size: {length: accuracy}} of one trained RAN on the benchmark's test examples, and {window size:
    accuracy} on its validation examples at the training length."""
    vocab_size = mqar_vocab_size() if run["task"] == "mqar" else STATE_VOCAB_SIZE
    model = build("ran", vocab_size, argparse.Namespace(**settings), max(args.lengths))
    model.load_state_dict(torch.load(weights))
    make_batch = batch_maker(run["task"], run["pairs"])
    read, validation = {}, {}
    for window in tqdm(args.window_sizes, desc=f"seed {run['seed']}", leave=False):
        model.config.window_size = window  # not a weight's shape: the model reads at it from its next call on
        validation[str(window)] = accuracy(
            model, make_batch, VALIDATION_SEED, settings["validation_examples"], run["train_length"], args.eval_tokens
        )
        read[str(window)] = {
            str(length): accuracy(
                model, make_batch, TEST_SEED + length, settings["eval_examples"], length, args.eval_tokens
            )
            for length in args.lengths
        }
    return read, validation


def chosen_window(validation: dict) -> str:
    """The window size with the best validation accuracy (the smallest of equals: the cheapest to attend)."""
    return max(validation, key=lambda window: (validation[window], -int(window)))


def table(runs: list[dict], args) -> str:
    header = "| seed | trained windows | read at window | validation | "
    header += " | ".join(f"{n} tokens" for n in args.lengths) + " |"
    lines = [header, "|" + "---|" * 3 + "---:|" * (1 + len(args.lengths))]
    for run in runs:
        trained = run["ran_config"].get("training_window_sizes") or [run["ran_config"].get("window_size")]
        for window, by_length in run["accuracy_by_window"].items():
            cells = " | ".join(f"{100 * by_length[str(n)]:.1f}%" for n in args.lengths)
            mark = " (chosen)" if window == run["chosen_window"] else ""
            validation = f"{100 * run['validation_by_window'][window]:.1f}%"
            lines.append(f"| {run['seed']} | {trained} | {window}{mark} | {validation} | {cells} |")
    return "\n".join(lines)


def plot(runs: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.2, 3.6))
    for i, window in enumerate(map(str, args.window_sizes)):
        for run, style in zip(runs, ("o-", "s--", "^:")):
            by_length = run["accuracy_by_window"][window]
            label = f"read at window {window}, seed {run['seed']}"
            axis.plot(args.lengths, [by_length[str(n)] for n in args.lengths], f"C{i}{style}", label=label)
    axis.set_xscale("log", base=2)
    axis.set(xlabel="tokens", ylabel="answer accuracy", ylim=(0, 1.02), title="one model, read at several windows")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(machine_line(info), flush=True)
    source = json.loads(args.results.read_text())
    found = trained_rans(source, args.checkpoints)
    if not found:
        raise SystemExit(f"no RAN weights of {args.results} in {args.checkpoints}: train them first (its command)")
    runs = []
    for run, weights in found:
        read, validation = read_at_window_sizes(run, weights, source["settings"], args)
        fields = ("task", "pairs", "train_length", "learning_rate", "seed", "ran_config", "commit", "accuracy")
        runs.append({**{name: run.get(name) for name in fields}, "accuracy_by_window": read})
        runs[-1] |= {"validation_by_window": validation, "chosen_window": chosen_window(validation)}
    settings = {**vars(args), "source_command": source["command"]}
    record = result_record(command_line(__file__, argv), settings, {"runs": runs}, device="cpu", dtype="float32",
                           info=info)  # fmt: skip
    text = f"# {args.results.stem}: read at other window sizes\n\nCommand: `{record['command']}`\n\n"
    text += f"Machine: {machine_line(info)}\n\n{table(runs, args)}\n\n"
    text += "Validation: the benchmark's validation examples at the training length; (chosen): the window they pick. "
    text += "`accuracy` of each run in the JSON is what the benchmark read at its own window size."
    write_json_and_table(args.output, record, text)
    plot(runs, args, Path(args.output + ".png"))
    print(text)
    return record


if __name__ == "__main__":
    main()
