#!/usr/bin/env python
"""EURLEX-57K titles from bodies: the prefix RAN, the causal RAN and a GPT-2 of the same size, trained from scratch
with the same tokenizer, data, steps and batch, then scored by ROUGE on generated titles.

    python scripts/benchmarks/benchmark_summarization.py --output_dir benchmarks/summarization

Each model runs `scripts/summarization/run_summarization.py` in a fresh process (its progress bars show); the
results (ROUGE-1/2/L, eval loss, parameters, wall time) go to `eurlex_titles.json` and `.md` with the command,
commit, date and machine, and a bar chart to `eurlex_titles.png`. The tokenizer is the official RAN WordPiece
vocabulary (`tests/fixtures/rannet/tokenizer/vocab.txt`) as a Transformers tokenizer.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchmark_utils import (
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_FLOAT,
    command_line,
    machine_info,
    machine_line,
    result_record,
)


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "summarization" / "run_summarization.py"
VOCABULARY = ROOT / "tests" / "fixtures" / "rannet" / "tokenizer" / "vocab.txt"
DATA = ROOT.parent / "shared" / "data" / "eurlex57k"
LABELS = {"prefix": "RANForPrefixLM", "causal": "RANForCausalLM on source [SEP] target", "gpt2": "GPT-2 (baseline)"}
METRICS = ("eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_loss")


def run_kind(kind: str, args, tokenizer: Path, work: Path) -> dict:
    output_dir = work / kind
    overrides = (
        f"hidden_size={args.hidden_size},num_hidden_layers={args.num_layers},num_attention_heads={args.num_heads},"
        f"head_dim={args.hidden_size // args.num_heads},window_size={args.window_size},"
        f"min_window_size={max(1, args.window_size // 8)}"
    )
    command = [
        sys.executable, str(SCRIPT), "--model_kind", kind, "--tokenizer_name", str(tokenizer),
        "--config_overrides", overrides, "--train_file", str(args.train_file),
        "--validation_file", str(args.validation_file), "--title_from_first_line",
        "--max_source_length", str(args.max_source_length), "--max_target_length", str(args.max_target_length),
        "--max_train_samples", str(args.steps * args.batch_size), "--max_eval_samples", str(args.eval_samples),
        "--per_device_train_batch_size", str(args.batch_size), "--per_device_eval_batch_size", "16",
        "--max_steps", str(args.steps), "--learning_rate", str(args.learning_rate), "--warmup_steps",
        str(args.steps // 20), "--lr_scheduler_type", "cosine", "--save_strategy", "no", "--report_to", "none",
        "--logging_steps", str(max(1, args.steps // 10)), "--seed", str(args.seed),
        "--do_train", "--do_eval", "--output_dir", str(output_dir),
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    seconds = time.perf_counter() - started
    results = json.loads((output_dir / "all_results.json").read_text())
    generations = [json.loads(line) for line in (output_dir / "generations.jsonl").read_text().splitlines()]
    return {
        "model": kind,
        "label": LABELS[kind],
        "parameters": results["model_parameters"],
        "train_loss": results["train_loss"],
        **{name: results[name] for name in METRICS},
        "seconds": round(seconds, 1),
        "examples": generations[:3],
    }


def markdown(report: dict) -> str:
    lines = [
        "# EURLEX-57K titles from bodies: prefix RAN, causal RAN and GPT-2",
        "",
        f"`{report['command']}`",
        "",
        machine_line({**report["machine_info"], "git_sha": report["commit"]}) + f", {report['date']}",
        "",
        "| model | parameters | train loss | eval loss (title tokens) | ROUGE-1 | ROUGE-2 | ROUGE-L | wall time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['label']} | {row['parameters']:,} | {row['train_loss']:.2f} | {row['eval_loss']:.2f} | "
            f"{row['eval_rouge1']:.1f} | {row['eval_rouge2']:.1f} | {row['eval_rougeL']:.1f} | "
            f"{row['seconds']:.0f} s |"
        )
    lines += ["", "First generated titles (prediction / reference):", ""]
    for row in report["results"]:
        for example in row["examples"]:
            lines.append(f"- {row['model']}: {example['prediction']!r} / {example['reference']!r}")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("eval_rouge1", "eval_rouge2", "eval_rougeL")
    figure, axis = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(report["results"])
    for index, row in enumerate(report["results"]):
        positions = [metric + index * width for metric in range(len(names))]
        axis.bar(positions, [row[name] for name in names], width, label=row["label"])
    axis.set_xticks([metric + 0.4 - width / 2 for metric in range(len(names))], ["ROUGE-1", "ROUGE-2", "ROUGE-L"])
    axis.set_ylabel("F1 x 100")
    settings = report["settings"]
    axis.set_title(
        f"EURLEX-57K titles, {settings['steps']} steps x {settings['batch_size']} "
        f"(source {settings['max_source_length']} tokens)"
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["prefix", "causal", "gpt2"], choices=sorted(LABELS))
    parser.add_argument("--train_file", type=Path, default=DATA / "train.jsonl.gz")
    parser.add_argument("--validation_file", type=Path, default=DATA / "dev.jsonl.gz")
    parser.add_argument("--hidden_size", type=POSITIVE, default=128)
    parser.add_argument("--num_layers", type=POSITIVE, default=2)
    parser.add_argument("--num_heads", type=POSITIVE, default=4)
    parser.add_argument("--window_size", type=POSITIVE, default=128)
    parser.add_argument("--max_source_length", type=POSITIVE, default=512)
    parser.add_argument("--max_target_length", type=POSITIVE, default=32)
    parser.add_argument("--steps", type=POSITIVE, default=400)
    parser.add_argument("--batch_size", type=POSITIVE, default=8)
    parser.add_argument("--learning_rate", type=POSITIVE_FLOAT, default=2e-3)
    parser.add_argument("--eval_samples", type=POSITIVE, default=64)
    parser.add_argument("--seed", type=NON_NEGATIVE, default=0)
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "summarization")
    args = parser.parse_args()
    for name in ("train_file", "validation_file"):
        if not getattr(args, name).is_file():
            parser.error(f"--{name} {getattr(args, name)}: no such file")
    if args.hidden_size % args.num_heads:
        parser.error("--hidden_size must be a multiple of --num_heads")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the Trainer of run_summarization.py trains
    info = machine_info(device)
    print(machine_line(info))
    from ran_hf.integrations.convert_rannet import build_rannet_tokenizer

    with tempfile.TemporaryDirectory() as work:
        tokenizer = Path(work) / "tokenizer"
        build_rannet_tokenizer(VOCABULARY).save_pretrained(tokenizer)
        results = [run_kind(kind, args, tokenizer, Path(work)) for kind in args.kinds]
    report = result_record(command_line(__file__), vars(args), results, device=device, dtype="float32", info=info)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "eurlex_titles.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.output_dir / "eurlex_titles.md").write_text(markdown(report))
    plot(report, args.output_dir / "eurlex_titles.png")
    print(markdown(report))


if __name__ == "__main__":
    main()
